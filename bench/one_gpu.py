"""The one-GPU proof: ``sapd run`` of the ``sapd init --benchmark alfworld`` starter with ``model.device``,
``model.dtype`` and ``sampling.backend`` left on ``auto``, for 2 rounds, at Qwen2.5-1.5B (student) and
Qwen2.5-3B (teacher) shapes built here from their config.json (random weights: nothing downloaded or shipped;
the Qwen2.5 tokenizer from tests/assets). It records, and checks:

* per phase (sample + score, train), the GPU's peak memory (device-wide: every process on it, polled) against
  the plan ``sapd check --gpu-memory`` prints for this GPU (its phases' sums, without the headroom): within 15 %;
* each round's time by phase, and the hand-offs' share of it (the engines releasing and taking back the GPU, the
  trainer moving to host memory and back): at most 5 %;
* the update guard: each round's applied / computed update of the weights the optimizer keeps: at least 0.9;
* the teacher's scoring: the tokens it computed per group against each prompt once (P + G·R) and each response
  with its own prompt (G·(P + R)): with vLLM, prompt-once; where vLLM is not installed ``auto`` chose HF, whose
  shared-prefix scorer computes each prompt once too (the table says which backend ran).

Deviations from the starter, to fit the proof in ≤ 8 minutes: 2 rounds, 2 trajectories per round (the shipped
sample holds 6), validation on at most 8 held-out prefixes. The rest is the starter's (G = 8, 512 new tokens,
minibatches of 16 prefixes in micro-batches of 1, lr 1e-6, gradient checkpointing auto).

    bash bench/gpu_check.sh --only one-gpu              # on the GPU machine: bench/results/one_gpu.{md,json}
    python bench/one_gpu.py --dry-run --out /tmp/one    # CPU, tiny shapes: the test suite's check of the script

The run is ``sapd run``'s own code (:func:`sapd.run.local.run_pipeline`) in this process, as the command runs
it; its hand-off records (``Engines.handoffs``) mark the phases.
"""

from __future__ import annotations

import argparse
import json
import lzma
import re
import shutil
import sys
import threading
import time
from pathlib import Path
from typing import Any

from proof_util import folders

REPO = Path(__file__).resolve().parents[1]
QWEN_TOKENIZER = REPO / "tests" / "assets" / "qwen2.5-tokenizer"  # data files only: nothing of tests/ is imported
DRY_SHAPE = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4}
LIMITS = {"memory_within": 0.15, "handoff_share": 0.05, "applied_ratio": 0.9, "minutes": 8.0}


def qwen_tokenizer(out: Path):
    from sapd.models.loading import load_tokenizer
    out.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(QWEN_TOKENIZER / name, out / name)
    (out / "tokenizer.json").write_bytes(lzma.decompress((QWEN_TOKENIZER / "tokenizer.json.xz").read_bytes()))
    return load_tokenizer(str(out))


def build_model(tok, out: Path, config: dict[str, Any], seed: int, device: str) -> None:
    """A random model of ``config`` (a config.json mapping), built on ``device`` in bfloat16 there (float32 on
    the CPU), saved with the tokenizer."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    skip = ("architectures", "transformers_version")
    cfg = AutoConfig.for_model(**{k: v for k, v in config.items() if k not in skip})
    dtype = torch.bfloat16 if device != "cpu" else torch.float32
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    model.save_pretrained(str(out))
    tok.save_pretrained(str(out))
    del model
    if device != "cpu":
        torch.cuda.empty_cache()


class MemoryPoll:
    """The GPU's used memory (device-wide, every process: total − free), every ``every`` seconds, stamped."""

    def __init__(self, every: float = 0.02):
        import torch
        self.torch, self.every = torch, every
        self.samples: list[tuple[float, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="gpu-memory-poll")

    def _run(self) -> None:
        while not self._stop.is_set():
            free, total = self.torch.cuda.mem_get_info()
            self.samples.append((time.time(), int(total - free)))
            time.sleep(self.every)

    def __enter__(self) -> MemoryPoll:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def peak(self, start: float, end: float) -> int | None:
        inside = [used for t, used in self.samples if start <= t <= end]
        return max(inside) if inside else None


def phase_windows(handoffs: list[Any], started: float, ended: float) -> dict[int, dict[str, tuple[float, float]]]:
    """Round → phase → (start, end) wall-clock window, from the hand-off records of ``sapd run``: a round's
    sampling and scoring run from the previous round's trainer going to host memory (the run's start for round 0)
    to the student engine releasing the GPU; its training from the teacher engine releasing it (the trainer is
    loaded or brought back inside the window) to the trainer going to host memory."""
    by: dict[int, dict[str, Any]] = {}
    for h in handoffs:
        by.setdefault(h.round, {})[h.what] = h
    out: dict[int, dict[str, tuple[float, float]]] = {}
    previous_end = started
    for k in sorted(by):
        hs = by[k]
        if "student engine releases the device" not in hs or "trainer to host memory" not in hs:
            continue  # the last checkpoint's validation-only step
        release, teacher = hs["student engine releases the device"], hs["teacher engine releases the device"]
        offload = hs["trainer to host memory"]
        out[k] = {"sample + score": (previous_end, release.started_at),
                  "train": (teacher.started_at + teacher.seconds, offload.started_at),
                  "round": (previous_end, offload.started_at + offload.seconds)}
        previous_end = offload.started_at + offload.seconds
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes, short responses: checks the script")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--work", default=None, help="scratch folder (default: OUT/one-gpu-work, removed after)")
    ap.add_argument("--keep", action="store_true")
    args = ap.parse_args(argv)

    import torch

    from sapd import layout
    from sapd.config import load_config
    from sapd.data.prefix_table import longest_prompt
    from sapd.models.memory import GIB, gpu_plan, shape_from_config
    from sapd.models.tiny import QWEN2_5
    from sapd.run.local import run_pipeline
    from sapd.run.report import read_step_log
    from sapd.run.starter import starter_config

    t_all = time.perf_counter()
    dry = args.dry_run
    cuda = torch.cuda.is_available() and not dry
    made = folders(args.out, args.work, "one-gpu-work", dry=dry, cuda=cuda)
    if made is None:
        return 2
    out, work = made
    lines: list[str] = []

    def log(line: str) -> None:
        lines.append(line)
        print(line, flush=True)

    # the models: Qwen2.5-1.5B and -3B shapes (the dry run: the same configs at a tiny width)
    t0 = time.perf_counter()
    configs = {"student": dict(QWEN2_5["1.5b"]), "teacher": dict(QWEN2_5["3b"])}
    if dry:  # the sample-trained byte tokenizer (4k entries): a 152k vocabulary alone would take minutes on a CPU
        from sapd.models.byte_tokenizer import build_sample_tokenizer
        tok = build_sample_tokenizer(work / "tokenizer")
        configs = {who: {**c, **DRY_SHAPE, "vocab_size": len(tok), "bos_token_id": tok.bos_token_id,
                         "eos_token_id": tok.eos_token_id} for who, c in configs.items()}
    else:
        tok = qwen_tokenizer(work / "tokenizer")
    for seed, (who, config) in enumerate(configs.items()):
        build_model(tok, work / who, config, seed, "cuda" if cuda else "cpu")
    build_seconds = time.perf_counter() - t0

    # the starter, filled in; everything else on auto
    text = starter_config("alfworld")
    text = text.replace("PATH/TO/student-model", str(work / "student")).replace("PATH/TO/teacher-model",
                                                                                 str(work / "teacher"))
    text = text.replace("PATH/TO/alfworld_expert.jsonl", str(REPO / "sapd" / "sample_data" / "alfworld_eto.json"))
    text = text.replace("run_root: runs/alfworld", f"run_root: {work / 'run'}")
    (work / "alfworld.yaml").write_text(text)
    over = {"train": {"rounds": args.rounds, "trajectories_per_round": 2}, "validation": {"max_prefixes": 8}}
    if dry:
        over["sampling"] = {"group_size": 2, "max_new_tokens": 8}
        over["train"]["trajectories_per_round"] = 1
        over["validation"] = {"max_prefixes": 2, "group_size": 2}
    cfg = load_config(work / "alfworld.yaml", overrides=over)
    for line in cfg.auto_lines():
        log(f"config: {line}")

    poll = MemoryPoll() if cuda else None
    started = time.time()
    if poll is not None:
        with poll:
            result = run_pipeline(cfg, log=log, show_progress=False)
    else:
        result = run_pipeline(cfg, log=log, show_progress=False)
    ended = time.time()
    root = cfg.run_root

    results: dict[str, Any] = {
        "mode": "dry-run (CPU, tiny shapes)" if dry else "GPU, Qwen2.5-1.5B student / 3B teacher shapes",
        "device": torch.cuda.get_device_name(0) if cuda else "cpu", "torch": torch.__version__,
        "auto": {key: value for key, (value, _) in cfg.resolved_auto.items()},
        "model_build_seconds": build_seconds, "checkpoints": result["checkpoints"]}
    checks: dict[str, bool] = {"trained every round": result["checkpoints"] == list(range(args.rounds + 1))}

    # the plan for this GPU, at the build's longest prompt
    student, teacher = shape_from_config(configs["student"]), shape_from_config(configs["teacher"])
    prompt = longest_prompt(layout.prefixes_dir(root))
    windows = phase_windows(result["handoffs"], started, ended)
    if cuda and poll is not None:
        total = torch.cuda.mem_get_info()[1]
        plan = gpu_plan(cfg, student, teacher, float(total), gpus=1, prompt_tokens=prompt)
        planned = {p.name: sum(h.bytes for h in p.holds) for p in plan.phases}
        memory = []
        for k, phases in windows.items():
            for name in ("sample + score", "train"):
                peak = poll.peak(*phases[name])
                ratio = peak / planned[name] if peak else None
                memory.append({"round": k, "phase": name, "peak_gib": peak / GIB if peak else None,
                               "plan_gib": planned[name] / GIB, "peak_over_plan": ratio})
        results["memory"] = memory
        results["plan"] = plan.lines()
        checks["memory within 15 % of the plan"] = all(
            m["peak_over_plan"] is not None and abs(m["peak_over_plan"] - 1) <= LIMITS["memory_within"] for m in memory)
    else:
        results["memory"] = "not measured: no GPU (the dry run)"

    # each round's time by phase, and the hand-offs' share
    rounds = []
    for k, phases in windows.items():
        handoff = sum(h.seconds for h in result["handoffs"] if h.round == k)
        length = phases["round"][1] - phases["round"][0]
        rounds.append({"round": k, "seconds": length, "handoff_seconds": handoff,
                       "handoff_share": handoff / length if length else None,
                       **{f"{name}_seconds": end - start for name, (start, end) in phases.items() if name != "round"},
                       "handoffs": [{"what": h.what, "seconds": h.seconds, "moved": h.moved}
                                    for h in result["handoffs"] if h.round == k]})
    results["rounds"] = rounds
    checks["hand-offs at most 5 % of a round"] = bool(rounds) and all(
        r["handoff_share"] is not None and r["handoff_share"] <= LIMITS["handoff_share"] for r in rounds)
    moved = [h.moved for h in result["handoffs"]]
    checks["the device changed hands (a GPU)" if cuda else "hand-offs recorded (nothing moves on a CPU)"] = (
        all(moved) if cuda else bool(moved))

    # the update guard
    steps = read_step_log(root)
    applied = {r["round"]: r["round_update_applied_ratio"] for r in steps if "round_update_applied_ratio" in r}
    results["update_applied_ratio"] = applied
    checks["update guard: applied / computed ≥ 0.9 every round"] = (
        len(applied) == args.rounds and all(v >= LIMITS["applied_ratio"] for v in applied.values()))

    # the teacher's tokens per group
    scoring = [line for line in lines if "teacher computed" in line]
    results["teacher_scoring"] = scoring
    results["backend"] = cfg.sampling.backend
    once = []
    for line in scoring:
        m = re.search(r"teacher computed (\d+) tokens per group \(each prompt once: (\d+); each response with its "
                      r"own prompt: (\d+)\)", line)
        if m:
            computed, shared, naive = map(int, m.groups())
            once.append(computed <= shared * 1.02 and computed < naive)
    checks[f"teacher ({cfg.sampling.backend}) computes each prompt once"] = bool(once) and all(once)

    results["seconds"] = time.perf_counter() - t_all
    if not dry:
        checks["at most 8 minutes"] = results["seconds"] <= LIMITS["minutes"] * 60
    results["checks"] = checks
    table = render(results)
    print("\n" + table, flush=True)
    (out / "one_gpu.json").write_text(json.dumps(results, indent=2, default=str) + "\n")
    (out / "one_gpu.md").write_text(f"# One GPU: sapd run of the alfworld starter on auto ({results['mode']})\n\n"
                                    f"{table}\n")
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    return 0 if all(checks.values()) else 1


def render(results: dict[str, Any]) -> str:
    out = [f"device: {results['device']}; torch {results['torch']}; auto chose: "
           + ", ".join(f"{k} {v}" for k, v in results["auto"].items())
           + f"; {results['seconds']:.0f} s in all ({results['model_build_seconds']:.0f} s building the models)", ""]
    if isinstance(results["memory"], list):
        out += ["| round | phase | peak GiB (the GPU, every process) | plan GiB | peak / plan |",
                "|---|---|---|---|---|"]
        out += [f"| {m['round']} | {m['phase']} | {m['peak_gib']:.2f} | {m['plan_gib']:.2f} "
                f"| {m['peak_over_plan']:.2f} |"
                for m in results["memory"] if m["peak_gib"] is not None]
        out.append("")
    else:
        out += [f"memory: {results['memory']}", ""]
    out += ["| round | seconds | sample + score s | train s | hand-offs s | hand-off share | applied / computed |",
            "|---|---|---|---|---|---|---|"]
    for r in results["rounds"]:
        out.append(f"| {r['round']} | {r['seconds']:.1f} | {r['sample + score_seconds']:.1f} "
                   f"| {r['train_seconds']:.1f} "
                   f"| {r['handoff_seconds']:.2f} | {r['handoff_share']:.1%} "
                   f"| {results['update_applied_ratio'].get(r['round'], float('nan')):.3f} |")
    out += ["", f"teacher scoring ({results['backend']}):"] + [f"- {line}" for line in results["teacher_scoring"]]
    out += ["", "checks:"] + [f"- {'ok' if ok else 'FAILED'}: {name}" for name, ok in results["checks"].items()]
    return "\n".join(out)


if __name__ == "__main__":
    sys.exit(main())
