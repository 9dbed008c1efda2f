"""How the demo evaluates one model (a committed checkpoint of a run root), on two held-out measures:

- **task success**: greedy episodes on the held-out games, by ``sapd evaluate``'s own code
  (:func:`sapd.stages.evaluate.evaluate_checkpoint`; ``evals/NNNNNN/textworld.json`` and the episodes
  beside it), read back per game;
- **action match**: the model's greedy decision on each of the clean expert's held-out decision prefixes,
  matched against the expert's action the way :func:`sapd.stages.evaluate.offline_eval` matches (the same
  parser and normalisation), kept per decision so that two models can be compared decision by decision
  (``evals/NNNNNN/heldout-decisions.json``).

and, given the teacher, a third:

- **distance to the teacher**: G samples per held-out decision at T = 1, the reverse KL(model ‖ teacher) per
  sampled token, overall and over the action tokens, and the sampled action match, by the code the
  teacher-scores stage validates every round with (:func:`sapd.stages.validation.distance_records`), kept per
  decision for paired differences (``evals/NNNNNN/heldout-distance.json``).

All are written into the run root and reused, so a rerun evaluates nothing twice.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Callable

from sapd import checkpoints, layout, storage
from sapd.data.prefixes import PrefixOptions, build_prefixes, read_prefixes
from sapd.data.validation import summarize
from sapd.demo.pools import warm_textworld
from sapd.envs.panels import PanelSpec
from sapd.envs.textworld_env import default_panel
from sapd.method.benchmarks import get_benchmark, parse_decision
from sapd.method.rules import normalize_action
from sapd.models.generation import HFGenerator, SamplingParams, stops_for
from sapd.models.loading import load_causal_lm, load_tokenizer
from sapd.models.scoring import HFScorer
from sapd.stages.evaluate import evaluate_checkpoint
from sapd.stages.validation import distance_records

Report = Callable[[str, int, int, str], None]
DECISIONS = "heldout-decisions.json"
DISTANCE = "heldout-distance.json"


def heldout_rows(pool: str | Path, out: str | Path, tokenizer, history_length: int) -> list[dict[str, Any]]:
    """The decision prefixes of an expert pool, built once into ``out`` (a committed prefix build)."""
    build_prefixes(str(pool), "native", "textworld", str(out), tokenizer,
                   opts=PrefixOptions(history_length=history_length, val_fraction=0.0),
                   log=lambda s: None, show_progress=False)
    return read_prefixes(str(out), "train").to_pylist()


def decision_outcomes(model, tokenizer, rows: list[dict[str, Any]], *, max_new_tokens: int,
                      batch: int = 16, progress: Callable[[int], None] | None = None) -> dict[str, list[int]]:
    """``{prefix_id: [match, well_formed]}``: the greedy decision on each prefix row, and whether its action
    is the recorded one (normalised as :func:`sapd.stages.evaluate.offline_eval` does)."""
    spec = get_benchmark("textworld")
    gen = HFGenerator(model, tokenizer, prompts_per_batch=8)
    params = SamplingParams(n=1, temperature=0.0, max_new_tokens=max_new_tokens, stop=stops_for(spec.decision))
    out: dict[str, list[int]] = {}
    for start in range(0, len(rows), batch):
        chunk = rows[start:start + batch]
        for r, (s,) in zip(chunk, gen.generate([r["prompt"] for r in chunk], params)):
            d = parse_decision(s.text, spec)
            match = d.valid and normalize_action(d.content) == normalize_action(r["recorded_action"])
            out[r["prefix_id"]] = [int(match), int(d.valid)]
        if progress:
            progress(len(chunk))
    return out


def evaluate_model(root: str, k: int, *, panel: PanelSpec, rows: list[dict[str, Any]], horizon: int,
                   max_new_tokens: int, env_timeout_s: float | None, report: Report) -> dict[str, Any]:
    """Checkpoint ``k`` of ``root`` on the held-out games (``panel``) and decisions (``rows``) →
    ``{success, per_game, action_match, format_valid, per_decision, games, decisions, seconds}``."""
    t0 = time.perf_counter()
    games = len(default_panel(panel.games_per_family, list(panel.families or ()), panel.seed))
    report("held-out games", 0, games, "games")
    evaluated = storage.exists(storage.join(layout.evals_dir(root, k), "textworld.json"))
    if not evaluated and env_timeout_s is not None and panel.cache_dir:
        warm_textworld(default_panel(1, list(panel.families or ()), panel.seed)[0], panel.cache_dir)
    evaluate_checkpoint(root, k, panel, horizon=horizon, max_new_tokens=max_new_tokens,
                        env_timeout_s=env_timeout_s, log=lambda s: None, show_progress=False)
    episodes = storage.read_text(storage.join(layout.evals_dir(root, k), "textworld.episodes.jsonl"))
    per_game = {ep["id"]: int(bool(ep.get("success"))) for line in episodes.splitlines() if line.strip()
                for ep in [json.loads(line)]}
    report("held-out games", len(per_game), games, "games")

    dest = storage.join(layout.evals_dir(root, k), DECISIONS)
    if storage.exists(dest):
        per_decision = storage.read_json(dest)
    else:
        done = [0]

        def step(n: int) -> None:
            done[0] += n
            report("held-out decisions", done[0], len(rows), "decisions")
        step(0)
        model = checkpoints.load_checkpoint_model(root, k)
        tokenizer = load_tokenizer(str(checkpoints.checkpoint_model_path(root, k)))
        per_decision = decision_outcomes(model, tokenizer, rows, max_new_tokens=max_new_tokens, progress=step)
        storage.write_json(dest, per_decision)
    n = len(per_decision)
    return {"success": sum(per_game.values()) / len(per_game), "per_game": per_game,
            "action_match": sum(v[0] for v in per_decision.values()) / n,
            "format_valid": sum(v[1] for v in per_decision.values()) / n,
            "per_decision": per_decision, "games": len(per_game), "decisions": n,
            "seconds": time.perf_counter() - t0}


def heldout_distance(root: str, k: int, teacher: str, rows: list[dict[str, Any]], *, max_new_tokens: int,
                     group_size: int = 4, seed: int = 0, report: Report | None = None,
                     chunk: int = 16) -> dict[str, Any]:
    """Checkpoint ``k`` of ``root``'s distance to ``teacher`` (a model folder or run root) on the held-out
    decisions ``rows`` → ``{summary, per_decision: {prefix_id: [Σ reverse KL, tokens, Σ on action tokens,
    action tokens, action matches, samples]}, group_size, seconds}``; written to ``evals/NNNNNN/`` and reused.
    Sampled ``chunk`` decisions at a time (seeded by ``seed`` and the chunk's first row)."""
    dest = storage.join(layout.evals_dir(root, k), DISTANCE)
    if storage.exists(dest):
        return storage.read_json(dest)
    t0 = time.perf_counter()
    tok = load_tokenizer(str(checkpoints.checkpoint_model_path(root, k)))
    model = checkpoints.load_checkpoint_model(root, k)
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    done = [0]

    def step(n: int) -> None:
        done[0] += n
        if report is not None:
            report("distance to the teacher", done[0], len(rows), "decisions")
    step(0)
    sampler, teacher_scorer, scorer = (HFGenerator(model, tok, prompts_per_batch=8),
                                       HFScorer(load_causal_lm(teacher), pad), HFScorer(model, pad))
    records: list[dict[str, Any]] = []
    for start in range(0, len(rows), chunk):  # a chunk at a time, so the progress line counts decisions
        params = SamplingParams(n=group_size, temperature=1.0, top_p=1.0, max_new_tokens=max_new_tokens,
                                stop=stops_for("action"), seed=seed + start)
        done_now, _ = distance_records(rows[start:start + chunk], sampler, teacher_scorer, scorer, tok, "textworld",
                                       params)
        records += done_now
        step(len(done_now))
    out = {"summary": summarize(records)["overall"], "group_size": group_size,
           "per_decision": {r["prefix_id"]: [r["reverse_kl"], r["tokens"], r["reverse_kl_action"], r["action_tokens"],
                                             r["action_match"], r["samples"]] for r in records},
           "seconds": time.perf_counter() - t0}
    storage.write_json(dest, out)
    return out
