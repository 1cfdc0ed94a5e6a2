# One image for every kinfer role (worker, gateway, lag monitor, telemetry, autoscaler, topics);
# the command picks the role. The default is the gateway.
FROM python:3.11-slim

ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 HF_HUB_OFFLINE=1 \
    KINFER_HOME=/home/kinfer/.kinfer KINFER_CACHE=/home/kinfer/.cache/kinfer
WORKDIR /app

# The dependencies alone first (torch and friends: most of the image), so that a change to kinfer's
# code rebuilds only the small layer below.
COPY pyproject.toml ./
RUN python -c "import subprocess, sys, tomllib; \
deps = tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']; \
subprocess.check_call([sys.executable, '-m', 'pip', 'install', *deps])"

COPY README.md ./
# kinfer/ holds links to the five folders below: the installed package is `kinfer` alone (kinfer.topics, ...).
COPY kinfer kinfer
COPY topics topics
COPY producers producers
COPY consumers consumers
COPY batcher batcher
COPY ops ops
# The gateway's tenants file: the example's placeholder key admits nobody; mount your own over it.
COPY ops/tenants.example.json /etc/kinfer/tenants.json
RUN pip install --no-deps . \
    && useradd --create-home --uid 10001 --shell /usr/sbin/nologin kinfer

# Not root: state and caches (the ONNX export, the built-in tiny model) under the user's home.
USER kinfer
# 8000: the gateway; 9100-9102: Prometheus metrics of the worker, lag monitor and autoscaler.
EXPOSE 8000 9100 9101 9102
# Secrets from files (KINFER_KAFKA_PASSWORD_FILE, KINFER_SIGNING_SECRET_FILE, KINFER_REDIS_PASSWORD_FILE:
# docker-compose.yml), then the command; without them it only runs the command.
ENTRYPOINT ["/bin/sh", "/app/ops/docker-entrypoint.sh"]
CMD ["kinfer", "gateway", "--host", "0.0.0.0", "--port", "8000", "--tenants", "/etc/kinfer/tenants.json"]
