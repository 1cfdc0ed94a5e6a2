# One image for every kinfer role (worker, gateway, lag monitor, telemetry, autoscaler, topics);
# the command picks the role. The default is the gateway. Two variants from this one file:
#
#   docker build -t kinfer .                                   # CPU: torch's CPU build
#   docker build --build-arg TORCH=cuda -t kinfer:cuda .       # torch as PyPI ships it: CUDA 13 (NVIDIA driver on the host)
#
# Three stages: the dependencies into a virtual environment (cached until pyproject.toml or uv.lock
# changes), kinfer into it, and a runtime holding that environment and nothing that built it.
ARG PYTHON=3.11

FROM python:${PYTHON}-slim AS deps
# cpu (torch's CPU build), or cuda (the locked torch as PyPI has it, with its CUDA libraries).
ARG TORCH=cpu
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PATH=/opt/kinfer/bin:$PATH \
    UV_PROJECT_ENVIRONMENT=/opt/kinfer UV_PYTHON_DOWNLOADS=never UV_NO_CACHE=1 UV_LINK_MODE=copy UV_COMPILE_BYTECODE=1
WORKDIR /src
# The dependencies alone first (torch and friends: most of the image), so that a change to kinfer's
# code rebuilds only the small stages below: exactly the versions and hashes uv.lock names, by uv at
# the version the lock names. The CPU variant leaves out torch's CUDA build (torch, triton, the
# cuda-* and nvidia-* libraries) and takes torch's CPU build of the locked version from torch's index.
COPY pyproject.toml uv.lock ./
RUN locked() { sed -n "/^name = \"$1\"\$/{n;s/^version = \"\(.*\)\"\$/\1/p;}" uv.lock; } \
    && pip install "uv==$(locked uv)" && uv venv /opt/kinfer \
    && if [ "$TORCH" = cpu ]; then \
         uv sync --frozen --no-install-project \
             $(sed -n 's/^name = "\(torch\|triton\|nvidia-.*\|cuda-.*\)"$/--no-install-package \1/p' uv.lock) \
         && uv pip install --python /opt/kinfer/bin/python --no-deps \
             --index-url https://download.pytorch.org/whl/cpu "torch==$(locked torch)"; \
       else uv sync --frozen --no-install-project; fi

FROM deps AS build
COPY README.md LICENSE ./
# kinfer/ holds links to the five folders below: the installed package is `kinfer` alone (kinfer.topics, ...).
COPY kinfer kinfer
COPY topics topics
COPY producers producers
COPY consumers consumers
COPY batcher batcher
COPY ops ops
RUN uv pip install --python /opt/kinfer/bin/python --no-deps .

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
