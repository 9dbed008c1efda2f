"""Offline validation on held-out prefixes (the paper's 5 % split): no environment, so it measures
what can be checked from the recorded history alone — whether a greedy response is well-formed
(the format rule), whether it repeats the previous action, and whether its action equals the one the
recorded agent took. Task success needs an environment (``sapd evaluate``, a later stage).
"""

from __future__ import annotations

from typing import Any

import pyarrow as pa

from sapd.benchmarks import get_benchmark, parse_decision
from sapd.models.generation import HFGenerator, SamplingParams, stops_for
from sapd.rules import normalize_action


def offline_eval(model, tokenizer, prefixes: pa.Table, benchmark: str, *, max_new_tokens: int = 64,
                 prompts_per_batch: int = 8, device: str = "cpu") -> dict[str, Any]:
    """Greedy decision per prefix → rates of valid format, repeated action and recorded-action match."""
    spec = get_benchmark(benchmark)
    rows = prefixes.to_pylist()
    if not rows:
        raise ValueError("no prefixes to evaluate")
    gen = HFGenerator(model, tokenizer, prompts_per_batch=prompts_per_batch, device=device)
    samples = gen.generate([r["prompt"] for r in rows], SamplingParams(
        n=1, temperature=0.0, max_new_tokens=max_new_tokens, stop=stops_for(spec.decision)))
    valid = match = repeated = 0
    by_category: dict[str, list[int]] = {}
    for r, (s,) in zip(rows, samples):
        d = parse_decision(s.text, spec)
        ok = int(d.valid)
        hit = int(d.valid and normalize_action(d.content) == normalize_action(r["recorded_action"]))
        rep = int(bool(d.content) and r["previous_action"] is not None
                  and normalize_action(d.content) == normalize_action(r["previous_action"]))
        valid, match, repeated = valid + ok, match + hit, repeated + rep
        by_category.setdefault(r["category"] or "-", []).append(hit)
    n = len(rows)
    return {"prefixes": n, "format_valid": valid / n, "action_match": match / n, "repeated_action": repeated / n,
            "action_match_by_category": {k: sum(v) / len(v) for k, v in sorted(by_category.items())}}
