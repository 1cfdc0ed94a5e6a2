# The two commands: `make demo` (the whole pipeline, end to end) and `make test` (every test).
# Each one installs what it needs first, idempotently: the virtual environment and Python
# packages, Debian's redis-server, Kafka's jars from Maven Central, Debian's Prometheus
# (unpacked, not installed: promtool tests the alert rules) and Helm (built by Go from the module
# proxy: the chart's tests render it). `make check` is the edit loop: the unit tests without the
# model tests, on every core.

PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV ?= .venv
PY := $(VENV)/bin/python
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
export HF_HUB_OFFLINE := 1
# kinfer's caches (Kafka's jars, the built-in tiny-lm, ONNX exports) default to ~/.cache/kinfer; here they
# stay in the checkout's .cache/ (ignored by git), so CI keeps what it fetched before. The local stack's
# state is in KINFER_HOME, else ~/.local/state/kinfer.
export KINFER_CACHE ?= $(CURDIR)/.cache
HELM_VERSION := v4.3.2

.PHONY: deps demo test check lint typecheck unit stack-down clean

$(VENV)/.kinfer-deps: pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]'
	@touch $@

deps: $(VENV)/.kinfer-deps
	@command -v redis-server >/dev/null 2>&1 || [ -x /usr/bin/redis-server ] || \
		($(SUDO) apt-get update -q && $(SUDO) apt-get install -y -q redis-server)
	@command -v java >/dev/null 2>&1 || ($(SUDO) apt-get update -q && $(SUDO) apt-get install -y -q default-jre-headless)
	@command -v mvn >/dev/null 2>&1 || ($(SUDO) apt-get update -q && $(SUDO) apt-get install -y -q maven)
	@$(PY) -m kinfer.ops.cli stack fetch >/dev/null
	@# promtool (the alert rules' tests) and prometheus, from Debian's package, unpacked into the cache: no
	@# service is installed or started.
	@test -x $(KINFER_CACHE)/prometheus/usr/bin/promtool || (mkdir -p $(KINFER_CACHE)/prometheus && cd $(KINFER_CACHE) && \
		(apt-get download -q prometheus 2>/dev/null || ($(SUDO) apt-get update -q && apt-get download -q prometheus)) && \
		dpkg-deb -x prometheus_*.deb prometheus && rm -f prometheus_*.deb)

	@# helm (the chart's tests render it), built from the Go module proxy into the cache when Go is here.
	@test -x $(KINFER_CACHE)/helm/helm || ! command -v go >/dev/null 2>&1 || \
		GOBIN=$(KINFER_CACHE)/helm GOFLAGS=-mod=mod go install helm.sh/helm/v4/cmd/helm@$(HELM_VERSION)

demo: deps
	$(PY) -m kinfer.ops.cli demo

lint: deps
	$(PY) -m ruff check .

typecheck: deps
	$(PY) -m mypy

# Tests run on every core (pytest-xdist), a file's tests on one worker: integration tests start
# their own Kafka and Redis on free ports, one stack per worker.
test: lint typecheck
	$(PY) -m pytest -n auto --dist loadfile

check: deps
	$(PY) -m pytest tests/unit -m "not models and not slow" -n auto -q

unit: deps
	$(PY) -m pytest tests/unit -n auto

stack-down:
	$(PY) -m kinfer.ops.cli stack down

clean: stack-down
	rm -rf .kinfer .pytest_cache .mypy_cache .ruff_cache
