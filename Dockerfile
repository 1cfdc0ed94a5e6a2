FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml README.md ./
COPY topics topics
COPY producers producers
COPY consumers consumers
COPY batcher batcher
COPY ops ops
RUN pip install --no-cache-dir .
ENV HF_HUB_OFFLINE=1
ENTRYPOINT []
