#!/usr/bin/env bash
# The GPU proof, one short run (~12 min on one GPU, plus an estimated ~6 min for the checkpoint sections;
# no network): installs sapd (and DeepSpeed, pure Python with DS_BUILD_OPS=0) into the machine's Python
# if missing, then runs bench/gpu_check.py and
# leaves its table in bench/results/gpu_check.{md,json}: sampling/scoring/training throughput, DeepSpeed
# ZeRO-2 and ZeRO-3 (partitioned init) against the torch engine, π_old computed once per round, FLOP/s
# and MFU against the device's bf16 peak (--peak-tflops N overrides the table), HF and vLLM engine reuse
# (vLLM's native in-place weight sync and its deadline), sharded optimizer checkpoints resumed under
# another ZeRO stage and engine, and bench/checkpoint_memory.py (host memory of saving and loading a
# checkpoint, 1 vs 2 ranks), and bf16 against float32 at lr 1e-6 (the fp32 master's update on the device,
# torch engine and ZeRO-2: --only bf16_master, ~3 min at 0.5B). Pass --dry-run for the CPU check, --size 1.5b for the larger shape, --only
# SECTIONS for a subset: --only sharded_checkpoint,checkpoint_memory,vllm_engine_reuse runs the checks
# of sharded checkpoints, checkpoint memory and in-place weight sync (with the runs they need) in a few
# minutes; --only scale runs the proof of the scale issue (#37: bf16 against float32 on the device, the
# device and peak memory of 2 training ranks, the vLLM teacher's tokens per group) in about 10 minutes. vLLM is used when the image has it (its wheel is too large to carry).
# Two proofs run alone, each first whenever a GPU is lent (their results: bench/results/<name>.{md,json}):
#   bash bench/gpu_check.sh --only one-gpu   # sapd run of the alfworld starter on auto, 1.5B/3B shapes, one GPU, <= 8 min
#   bash bench/gpu_check.sh --only ranks     # the multi-rank training path as far as one GPU shows it, <= 5 min
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! $PY -c "import sapd" 2>/dev/null; then
  # --no-deps: the image's torch/transformers stay as they are; the few pure-Python needs are listed
  $PY -m pip install -q --no-deps -e . || export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
if ! $PY -c "import deepspeed" 2>/dev/null; then
  DS_BUILD_OPS=0 $PY -m pip install -q --no-deps deepspeed 2>/dev/null || echo "DeepSpeed not installable here: its section will say skipped"
fi
export PYTHONUNBUFFERED=1
exec $PY bench/gpu_check.py "$@"
