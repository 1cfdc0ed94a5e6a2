# One image for every kinfer role (worker, gateway, lag monitor, telemetry, autoscaler, topics);
# the command picks the role. The default is the gateway. Two variants from this one file:
#
#   docker build -t kinfer .                                   # CPU: torch's CPU wheels
#   docker build --build-arg TORCH=cu124 -t kinfer:cuda .      # CUDA 12.4 (NVIDIA driver on the host)
#
# Three stages: the dependencies into a virtual environment (cached until pyproject.toml changes),
# kinfer into it, and a runtime holding that environment and nothing that built it.
ARG PYTHON=3.11

FROM python:${PYTHON}-slim AS deps
# cpu, or a CUDA build of torch's wheel index (cu121, cu124, ...).
ARG TORCH=cpu
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PATH=/opt/kinfer/bin:$PATH
WORKDIR /src
RUN python -m venv /opt/kinfer
# The dependencies alone first (torch and friends: most of the image), so that a change to kinfer's
# code rebuilds only the small stages below. torch comes from the variant's index; the rest from PyPI
# (pip keeps the torch already there when it satisfies pyproject's bound).
COPY pyproject.toml ./
RUN pip install torch --index-url "https://download.pytorch.org/whl/${TORCH}" \
    && python -c "import subprocess, sys, tomllib; \
deps = tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']; \
subprocess.check_call([sys.executable, '-m', 'pip', 'install', *deps])"

FROM deps AS build
COPY README.md LICENSE ./
# kinfer/ holds links to the five folders below: the installed package is `kinfer` alone (kinfer.topics, ...).
COPY kinfer kinfer
COPY topics topics
COPY producers producers
COPY consumers consumers
COPY batcher batcher
COPY ops ops
RUN pip install --no-deps .

FROM python:${PYTHON}-slim AS runtime
ENV PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 PATH=/opt/kinfer/bin:$PATH \
    KINFER_HOME=/home/kinfer/.kinfer KINFER_CACHE=/home/kinfer/.cache/kinfer
COPY --from=build /opt/kinfer /opt/kinfer
COPY LICENSE /app/LICENSE
COPY ops/deploy/docker-entrypoint.sh /app/ops/deploy/docker-entrypoint.sh
# The gateway's tenants file: the example's placeholder key admits nobody; mount your own over it.
COPY ops/deploy/tenants.example.json /etc/kinfer/tenants.json
RUN useradd --create-home --uid 10001 --shell /usr/sbin/nologin kinfer
WORKDIR /app

# Not root: state and caches (the ONNX export, the built-in tiny model) under the user's home.
USER kinfer
# 8000: the gateway; 9100-9103: Prometheus metrics of the worker, lag monitor, autoscaler, telemetry.
EXPOSE 8000 9100 9101 9102 9103
# Whatever the role: the gateway's /healthz, else the command's metrics port (ops/deploy/healthcheck.py).
HEALTHCHECK --interval=15s --timeout=5s --start-period=120s --retries=3 \
    CMD ["python", "-m", "kinfer.ops.deploy.healthcheck"]
# Secrets from files (KINFER_KAFKA_PASSWORD_FILE, KINFER_SIGNING_SECRET_FILE, KINFER_REDIS_PASSWORD_FILE:
# docker-compose.yml), then the command; without them it only runs the command.
ENTRYPOINT ["/bin/sh", "/app/ops/deploy/docker-entrypoint.sh"]
CMD ["kinfer", "gateway", "--host", "0.0.0.0", "--port", "8000", "--tenants", "/etc/kinfer/tenants.json"]
