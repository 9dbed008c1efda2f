"""GPU proof: the product's own pipeline on one GPU, timed — student sampling and teacher scoring (HF and,
where installed, vLLM), the SAPD training stage with the torch engine and with DeepSpeed ZeRO, for a
0.5B (or 1.5B) Qwen2.5-shaped model built from its config (random weights: no network, no download;
throughput and step time do not depend on the weights' values). Prints a short table and writes
``gpu_check.json`` and ``gpu_check.md`` into ``--out``.

    python bench/gpu_check.py --out bench/results              # on the GPU machine (~10 min)
    bash bench/gpu_check.sh                                    # the same, installing what is missing
    python bench/gpu_check.py --dry-run --out /tmp/gpu-dry     # CPU, tiny shape: the test suite's check

Each section runs through the library exactly as ``sapd run`` does (``run_pipeline`` over a run root;
the timings are read back from the round manifests and step logs), so what it times is what a user
runs. A section whose dependency is missing (vLLM, DeepSpeed, CUDA) is reported as skipped with the
reason, never silently dropped. The torch and DeepSpeed runs train on the same scored round (the
DeepSpeed run root is seeded with a copy of it), so their first-step losses must agree; the table
prints the difference. ``engine_reuse`` loads new weights into the live HF student engine (as the local
pipeline does between rounds), times it against a fresh model load and checks that the tokens sampled
after it equal a freshly built engine's on the same weights and seed.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import time
import traceback
from pathlib import Path
from typing import Any, Callable

REPO = Path(__file__).resolve().parents[1]
SAMPLES = REPO / "sapd" / "sample_data"

# Qwen2.5 shapes (config.json of the released models); the vocabulary is padded to the real size so the
# embedding and the LM head cost what they cost there
SHAPES: dict[str, dict[str, int]] = {
    "0.5b": dict(hidden_size=896, layers=24, heads=14, kv_heads=2, intermediate_size=4864, vocab_size=151936),
    "1.5b": dict(hidden_size=1536, layers=28, heads=12, kv_heads=2, intermediate_size=8960, vocab_size=151936),
    "dry": dict(hidden_size=64, layers=2, heads=4, kv_heads=2, intermediate_size=128, vocab_size=4096),
}


def _section(results: dict[str, Any], name: str, fn: Callable[[], dict[str, Any]], log: Callable[[str], None]) -> None:
    t0 = time.perf_counter()
    try:
        out = fn()
        results[name] = {"status": "ok", **out, "seconds": time.perf_counter() - t0}
        log(f"[{name}] ok in {results[name]['seconds']:.1f} s")
    except _Skip as e:
        results[name] = {"status": "skipped", "reason": str(e)}
        log(f"[{name}] skipped: {e}")
    except Exception as e:  # noqa: BLE001 - one broken section must not hide the others
        results[name] = {"status": "failed", "reason": f"{type(e).__name__}: {e}",
                         "traceback": traceback.format_exc(limit=8)}
        log(f"[{name}] FAILED: {type(e).__name__}: {e}")


class _Skip(Exception):
    pass


def _importable(name: str) -> bool:
    import importlib.util
    return importlib.util.find_spec(name) is not None


def build_models(work: Path, shape: dict[str, int], dtype: str) -> tuple[str, str]:
    """A tokenizer trained on the shipped samples, a student and a teacher of ``shape`` (different seeds)."""
    import torch

    from sapd.models.byte_tokenizer import build_tokenizer
    from sapd.models.tiny import build_tiny_model
    texts = [p.read_text(encoding="utf-8") for p in sorted(SAMPLES.iterdir()) if p.suffix in (".json", ".jsonl")]
    tok = build_tokenizer(texts, work / "tokenizer", vocab_size=4096)
    paths = []
    for name, seed in (("student", 0), ("teacher", 1)):
        out = work / name
        if not (out / "config.json").is_file():
            model = build_tiny_model(tok, out, seed=seed, max_positions=8192, **shape)
            if dtype == "bfloat16":  # store what the runs load: half the bytes to write and read back
                model.to(torch.bfloat16).save_pretrained(str(out))
            del model
        paths.append(str(out))
    return paths[0], paths[1]


def run_config(root: Path, student: str, teacher: str, *, backend: str, engine: str, dry: bool,
               device: str, dtype: str, rounds: int) -> dict[str, Any]:
    G, new = (2, 16) if dry else (8, 128)
    return {
        "run_root": str(root), "variant": "sapd",
        "data": {"input": str(SAMPLES / "alfworld_eto.json"), "format": "eto", "benchmark": "alfworld",
                 "val_fraction": 0.0, "max_prompt_tokens": 4096},
        "model": {"student": student, "teacher": teacher, "device": device, "dtype": dtype},
        "sampling": {"backend": backend, "group_size": G, "max_new_tokens": new, "prompts_per_batch": 8,
                     "gpu_memory_utilization": 0.35},
        "train": {"rounds": rounds, "trajectories_per_round": 3, "minibatch_prefixes": 8,
                  "micro_batch_prefixes": 2 if dry else 4, "lr": 1e-6, "engine": engine, "zero_stage": 2,
                  "gradient_checkpointing": not dry},
    }


def summarize_run(root: str) -> dict[str, Any]:
    """Sampling / scoring throughput from the round manifests, step times from the step logs."""
    from sapd.run.report import read_step_log, round_timings
    rounds = round_timings(root)
    steps = read_step_log(root)
    tokens = sum(r.get("generated_tokens", 0) for r in rounds)
    sample_s = sum(r.get("sample_seconds", 0.0) for r in rounds)
    score_s = sum(r.get("score_seconds", 0.0) for r in rounds)
    step_s = [s["step_seconds"] for s in steps]
    # the first step of a round includes warm-up (allocator, kernels): report the median too
    med = sorted(step_s)[len(step_s) // 2] if step_s else float("nan")
    return {"rounds": len(rounds), "generated_tokens": tokens,
            "sample_tokens_per_s": tokens / sample_s if sample_s else None,
            "score_tokens_per_s": tokens / score_s if score_s else None,
            "optimizer_steps": len(steps), "step_seconds_median": med,
            "step_seconds_mean": sum(step_s) / len(step_s) if step_s else None,
            "first_loss": steps[0]["loss"] if steps else None}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny shape, short responses: checks the script")
    ap.add_argument("--size", choices=["0.5b", "1.5b"], default="0.5b")
    ap.add_argument("--out", default="bench/results", help="where gpu_check.json / gpu_check.md go")
    ap.add_argument("--work", default=None, help="scratch folder (default: OUT/gpu-check-work, removed after)")
    ap.add_argument("--keep", action="store_true", help="keep the scratch folder")
    args = ap.parse_args(argv)

    import torch

    from sapd import checkpoints
    from sapd.config import config_from_dict
    from sapd.run.local import run_pipeline

    def log(s: str) -> None:
        print(s, flush=True)

    dry = args.dry_run
    cuda = torch.cuda.is_available()
    if not dry and not cuda:
        log("no CUDA device: run with --dry-run for the CPU check")
        return 2
    device, dtype = ("cpu", "float32") if dry else ("cuda", "bfloat16")
    shape = SHAPES["dry" if dry else args.size]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(args.work) if args.work else out / "gpu-check-work"
    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)
    if dry:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    results: dict[str, Any] = {
        "mode": "dry-run (CPU)" if dry else f"GPU, Qwen2.5-{args.size} shape",
        "device": torch.cuda.get_device_name(0) if cuda and not dry else platform.processor() or "cpu",
        "torch": torch.__version__, "shape": shape, "dtype": dtype,
    }
    quiet = dict(log=lambda s: None, show_progress=False)
    t_all = time.perf_counter()
    paths: dict[str, str] = {}

    def models() -> dict[str, Any]:
        paths["student"], paths["teacher"] = build_models(work, shape, dtype)
        from sapd.models.loading import load_causal_lm
        n = sum(p.numel() for p in load_causal_lm(paths["student"], dtype=dtype).parameters())
        results["parameters"] = n
        return {"parameters": n}

    def hf_torch() -> dict[str, Any]:
        cfg = config_from_dict(run_config(work / "hf-torch", paths["student"], paths["teacher"], backend="hf",
                                          engine="torch", dry=dry, device=device, dtype=dtype, rounds=2))
        run_pipeline(cfg, **quiet)
        return summarize_run(cfg.run_root)

    def engine_reuse() -> dict[str, Any]:
        """The student engine kept across rounds: new weights loaded in place (the teacher checkpoint has
        the student's shape) against a fresh model load, and the tokens sampled after it against a
        freshly built engine's on the same weights and seed."""
        from sapd.models.generation import HFGenerator, SamplingParams
        from sapd.models.loading import load_causal_lm, load_tokenizer
        tok = load_tokenizer(paths["student"])
        live = HFGenerator(load_causal_lm(paths["student"], dtype=dtype, device=device), tok, device=device)
        t0 = time.perf_counter()
        live.load_weights(paths["teacher"])
        in_place = time.perf_counter() - t0
        t0 = time.perf_counter()
        fresh = HFGenerator(load_causal_lm(paths["teacher"], dtype=dtype, device=device), tok, device=device)
        rebuild = time.perf_counter() - t0
        params = SamplingParams(n=2, temperature=1.0, top_p=1.0, max_new_tokens=8, stop=(), seed=0)
        prompts = ["You are in a kitchen. Your task is to: heat some water.", "Find a red mug under 10 dollars."]
        a, b = live.generate(prompts, params), fresh.generate(prompts, params)
        same = [[s.token_ids for s in g] for g in a] == [[s.token_ids for s in g] for g in b]
        if not same:
            raise RuntimeError("tokens sampled after the in-place update differ from a fresh engine's")
        return {"in_place_seconds": in_place, "rebuild_seconds": rebuild, "tokens_match_fresh": same}

    def vllm_sampling() -> dict[str, Any]:
        if dry or not _importable("vllm"):
            raise _Skip("vLLM is not installed here" if not _importable("vllm") else "dry run (CPU): HF only")
        cfg = config_from_dict(run_config(work / "vllm-torch", paths["student"], paths["teacher"], backend="vllm",
                                          engine="torch", dry=dry, device=device, dtype=dtype, rounds=1))
        run_pipeline(cfg, **quiet)
        return summarize_run(cfg.run_root)

    def deepspeed_zero2() -> dict[str, Any]:
        if not _importable("deepspeed"):
            raise _Skip("DeepSpeed is not installed here (pip install deepspeed)")
        src = work / "hf-torch"
        if not checkpoints.is_committed(str(src), 1):
            raise _Skip("the hf-torch section did not finish: nothing to compare against")
        root = work / "hf-deepspeed"
        # the same prefixes, checkpoint 0 and scored round 0 as the torch run: the first losses must agree
        for part in ("prefixes", "checkpoints/000000", "rounds/000000"):
            (root / part).parent.mkdir(parents=True, exist_ok=True)
            shutil.copytree(src / part, root / part)
        cfg = config_from_dict(run_config(root, paths["student"], paths["teacher"], backend="hf",
                                          engine="deepspeed", dry=dry, device=device, dtype=dtype, rounds=1))
        run_pipeline(cfg, **quiet)
        got = summarize_run(str(root))
        for key in ("generated_tokens", "sample_tokens_per_s", "score_tokens_per_s"):
            got.pop(key)  # round 0 was sampled and scored by the torch section, not here
        ref = json.loads((src / "logs" / "round-000000.jsonl").read_text().splitlines()[0])
        got["first_loss_vs_torch"] = abs(got["first_loss"] - ref["loss"])
        return got

    _section(results, "models", models, log)
    if results["models"]["status"] == "ok":
        _section(results, "hf_torch", hf_torch, log)
        _section(results, "engine_reuse", engine_reuse, log)
        _section(results, "vllm", vllm_sampling, log)
        _section(results, "deepspeed_zero2", deepspeed_zero2, log)
        if cuda and not dry:
            results["max_memory_allocated_gib"] = torch.cuda.max_memory_allocated() / 2**30
    results["seconds"] = time.perf_counter() - t_all
    table = render_table(results)
    log("\n" + table)
    (out / "gpu_check.json").write_text(json.dumps(results, indent=2, default=str) + "\n")
    (out / "gpu_check.md").write_text(f"# GPU check ({results['mode']})\n\n{table}\n")
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    failed = [k for k, v in results.items() if isinstance(v, dict) and v.get("status") == "failed"]
    return 1 if failed else 0


def render_table(results: dict[str, Any]) -> str:
    def f(x: Any, fmt: str) -> str:
        return "—" if x is None else format(x, fmt)

    lines = [f"mode: {results['mode']}; device: {results['device']}; torch {results['torch']}; "
             f"dtype {results['dtype']}; parameters: {f(results.get('parameters'), ',')}",
             "",
             "| section | status | sample tok/s | score tok/s | step s (median) | first-loss Δ vs torch |",
             "|---|---|---|---|---|---|"]
    for name in ("hf_torch", "vllm", "deepspeed_zero2"):
        r = results.get(name)
        if r is None:
            continue
        if r["status"] != "ok":
            lines.append(f"| {name} | {r['status']}: {r['reason'].splitlines()[0][:80]} | | | | |")
            continue
        lines.append(f"| {name} | ok | {f(r.get('sample_tokens_per_s'), '.0f')} "
                     f"| {f(r.get('score_tokens_per_s'), '.0f')} | {f(r.get('step_seconds_median'), '.3f')} "
                     f"| {f(r.get('first_loss_vs_torch'), '.2e')} |")
    reuse = results.get("engine_reuse")
    if reuse is not None:
        lines.append(f"\nstudent engine reuse: {reuse['status']}" + (
            f"; in-place weight load {reuse['in_place_seconds']:.2f} s vs rebuild {reuse['rebuild_seconds']:.2f} s; "
            f"tokens match a fresh engine: {reuse['tokens_match_fresh']}" if reuse["status"] == "ok"
            else f": {reuse['reason'].splitlines()[0][:80]}"))
    if "max_memory_allocated_gib" in results:
        lines.append(f"\npeak GPU memory allocated: {results['max_memory_allocated_gib']:.1f} GiB")
    lines.append(f"\ntotal {results['seconds']:.0f} s")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
