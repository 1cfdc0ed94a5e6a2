# The two commands: `make demo` (the whole pipeline, end to end) and `make test` (every test).
# Each one installs what it needs first, idempotently: the virtual environment with exactly the
# Python packages uv.lock names (every version and hash, runtime and dev), Debian's redis-server,
# Kafka's jars from Maven Central, Debian's Prometheus (unpacked, not installed: promtool tests the
# alert rules) and Helm (built by Go from the module proxy: the chart's tests render it). `make check`
# is the edit loop: the unit tests without the model tests, on every core. `make lock` is the one
# way to upgrade: it resolves the newest versions pyproject.toml allows into uv.lock, then runs the
# tests on them.

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
TEST_WORKERS ?= $(shell echo $$(( $$(nproc) + 1 )))

.PHONY: deps lock demo test check lint typecheck unit stack-down clean

# uv installs the lock (and resolves it: `make lock`). It is bootstrapped into the environment at the
# version the lock itself names, so the sync that follows keeps it.
UV := $(VENV)/bin/uv
UV_VERSION := $(shell sed -n '/^name = "uv"$$/{n;s/^version = "\(.*\)"$$/\1/p;}' uv.lock)
export UV_PROJECT_ENVIRONMENT := $(VENV)
export UV_PYTHON_DOWNLOADS := never
# Every package's bytecode is compiled once, at install: a process never compiles what it imports (with
# PYTHONDONTWRITEBYTECODE set, as on CI machines, Python would compile it again in every process it
# starts: 14 s of CPU to import a model's transformers and torch, against 6 s compiled).
export UV_COMPILE_BYTECODE := 1

$(UV):
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet 'uv==$(UV_VERSION)'

# Exactly what uv.lock names, nothing else (an exact sync removes what the lock does not hold);
# --locked refuses a lock that no longer matches pyproject.toml: run `make lock`.
$(VENV)/.kinfer-deps: pyproject.toml uv.lock | $(UV)
	$(UV) sync --locked --extra dev --python $(PY) --quiet
	@touch $@

lock: | $(UV)
	$(UV) lock --upgrade --python $(PY)
	$(MAKE) test

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

# Tests run on one worker more than there are cores (pytest-xdist, TEST_WORKERS), a file's tests on one
# worker: integration tests start their own Kafka and Redis on free ports, one stack per worker, and
# spend much of their time waiting on the processes they start and on their soaks' schedules (two
# workers on two cores kept the CPUs 70-80 % busy; three took the suite from 338 s to 254 s, four to
# 245 s). Files go out in the suite's own order, longest first (tests/conftest.py), not xdist's (most
# tests first, which left the minute-long scenarios, one test a file, to run last and alone). Tests
# marked clock compare latencies or count missed deadlines: they run after the others, alone, so no
# other test's processes are their noise; only their files are collected for that run (collecting the
# whole suite takes 7 s).
CLOCK_FILES = $(shell grep -rl --include='test_*.py' 'pytest.mark.clock' tests)
test: lint typecheck
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=15 -m "not clock"
	$(PY) -m pytest -m clock -q $(CLOCK_FILES)

check: deps
	$(PY) -m pytest tests/unit -m "not models and not slow" -n auto -q

unit: deps
	$(PY) -m pytest tests/unit -n auto

stack-down:
	$(PY) -m kinfer.ops.cli stack down

clean: stack-down
	rm -rf .kinfer .pytest_cache .mypy_cache .ruff_cache
