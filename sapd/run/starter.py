"""``sapd init --benchmark NAME``: a commented starter run config for bringing your own data. Every key
it does not list keeps the paper's default; the ``PATH/TO/…`` values are the ones to fill in, and
``sapd check`` names each one still left (then checks the rest without training). What differs per benchmark
(the usual input format, an example file, what to do first, the round size) is its spec's ``starter``
(:class:`sapd.method.benchmarks.Starter`)."""

from __future__ import annotations

from sapd.config import PLACEHOLDER
from sapd.data.loaders import AUTO, REGISTRY
from sapd.method.benchmarks import BENCHMARKS, get_benchmark


def benchmarks() -> list[str]:
    return sorted(BENCHMARKS)


def starter_config(benchmark: str) -> str:
    """The text of the starter config for ``benchmark`` (its spec's :class:`~sapd.method.benchmarks.Starter`)."""
    if benchmark not in BENCHMARKS:
        raise ValueError(f"--benchmark {benchmark!r}: expected one of {', '.join(benchmarks())}")
    spec = get_benchmark(benchmark)
    fmt, example, what = spec.starter.format, spec.starter.example, spec.starter.what
    if fmt not in REGISTRY and fmt != AUTO:
        raise ValueError(f"benchmark {benchmark!r}: its starter's format {fmt!r} is not one of "
                         f"{' | '.join([*sorted(REGISTRY), AUTO])}")
    per_round = spec.starter.trajectories_per_round
    return f"""\
# sapd run config: a starter for {benchmark} (written by `sapd init --benchmark {benchmark}`).
# Fill in the three {PLACEHOLDER}… values, then
#   sapd check THIS.yaml    checks it without training: data, models, tokenizers, storage, memory
#                           (--gpu-memory 80: what each phase needs of an 80 GiB GPU you do not have yet)
#   sapd run THIS.yaml      runs it (resumable: run it again after an interruption)
# Keys not listed keep the paper's defaults (docs/SAPD.md §5). Numbers follow YAML 1.2 (1e-6 is a float).
{spec.starter.before}
# everything of the run is written here: a local folder or s3://bucket/prefix
run_root: runs/{benchmark}

# a named setting of the objective: sapd (the paper's) | opd | opd_rule | wo_opd | wo_rule | full_token |
# std_norm | sapd_exclude | sft (docs/SAPD.md §4)
variant: sapd

data:
  # FILL IN: your recorded trajectories, {what}: a file or a folder of them, local or s3://
  input: {PLACEHOLDER}{example}
  # their layout: {' | '.join([*sorted(REGISTRY), AUTO])} (docs/FORMATS.md);
  # `sapd convert --format auto` tells you which one a file is
  format: {fmt}
  benchmark: {benchmark}
  # history_length: {spec.history_length}     # recent (observation, action) pairs per prompt (the benchmark's default)
  # max_prompt_tokens: 4096  # prefixes longer than this are dropped
  # skip_invalid: false      # true: skip (and count) invalid records instead of stopping at the first

model:
  # FILL IN: the student to train and the frozen teacher, Hugging Face model folders (config, weights,
  # tokenizer with a chat template) or s3:// prefixes. They must share one tokenizer.
  student: {PLACEHOLDER}student-model
  teacher: {PLACEHOLDER}teacher-model
  # device: auto             # auto (default: cuda where torch sees a GPU, else cpu) | cpu | cuda | cuda:N
  # dtype: auto              # auto (default: bfloat16 on a GPU, trained on an fp32 master; float32 on a CPU)
  #                          #   | float32 | bfloat16 | float16; `sapd check` says what auto chose and why

sampling:
  group_size: 8              # G responses sampled per prefix
  max_new_tokens: 512        # each round logs the share of responses cut at it
  # backend: auto            # auto (default: vllm where it is installed and the device is a GPU, else hf)
  #                          #   | hf | vllm

train:
  rounds: 100                # rollout batches, each followed by its optimizer steps
  trajectories_per_round: {per_round}
  lr: 1e-6
  # micro_batch_prefixes: 1  # prefixes per forward/backward (1 fits a 1.5B student on 80 GB: `sapd check`)
  # gradient_checkpointing: auto   # auto: on for a cuda device | true | false
  # engine: deepspeed        # several GPUs: torchrun (docs/guides/scaling.md)
"""
