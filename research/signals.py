"""Metrics of the powered study that can separate methods:

- :func:`heldout_decisions` — per held-out decision prefix (clean expert on unseen games): the student's
  greedy action and whether it matches the expert's, the **teacher's log-likelihood of the student's
  greedy action** (scored after the prefix and the recorded, action-free thought) and the **student's
  likelihood of the expert action** (teacher-forced). :func:`summarize_decisions` aggregates them.
- :func:`signal_probe` — round 0, no training: G samples per prefix at T = 1, scored by the teacher; how
  well each step score (action-only sum or mean, thought-only sum, full-token sum) ranks correct
  actions above wrong ones within a group (AUC), its correlation with the action's length, and the
  group health figures (well-formed share, all-malformed groups, groups a malformed response would top).
- :func:`round_health` — per training round, from a run's step log and scored rounds: well-formed
  share at the sampling temperature, action-less share, all-action-less groups, the magnitude of each
  term's advantage, the clip fraction.

Every function takes loaded models and plain prefix rows (``PREFIX_SCHEMA`` dicts), so the same code
serves the tiny models and SmolLM2.
"""

from __future__ import annotations

import math
import re
import statistics
from typing import Any, Sequence

import torch

from research.stats import pearson, within_group_auc
from sapd import layout
from sapd.data import shards
from sapd.data.scored import read_scored
from sapd.method.action_mask import action_token_mask, span_token_mask, token_char_offsets
from sapd.method.benchmarks import parse_decision
from sapd.method.rules import normalize_action
from sapd.models.generation import HFGenerator, SamplingParams, stops_for
from sapd.models.scoring import response_logprobs, score_groups
from sapd.run.report import read_step_log

BENCHMARK = "textworld"
_THINK = re.compile(r"<think>(.*?)</think>", re.S)


def _ids(tokenizer, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def with_action(recorded_response: str, action: str) -> str:
    """The recorded response with its action replaced by ``action`` (the thought kept): the canonical
    context in which the teacher scores another action for the same prefix."""
    d = parse_decision(recorded_response, BENCHMARK)
    if d.span is None:
        raise ValueError(f"recorded response has no action block: {recorded_response[:80]!r}")
    a, b = d.span
    return recorded_response[:a] + action + recorded_response[b:]


@torch.no_grad()
def _action_logprobs(model, tokenizer, prompts: list[list[int]], responses: list[list[int]],
                     batch: int = 8) -> list[tuple[float, int]]:
    """(Σ log π over the action tokens, number of action tokens) per (prompt, response)."""
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    out: list[tuple[float, int]] = []
    for s in range(0, len(prompts), batch):
        logp, _ = response_logprobs(model, prompts[s:s + batch], responses[s:s + batch], pad)
        for i, r in enumerate(responses[s:s + batch]):
            mask = action_token_mask(tokenizer, r, BENCHMARK)
            vals = [float(logp[i, k]) for k, m in enumerate(mask) if m]
            out.append((sum(vals), len(vals)))
    return out


def heldout_decisions(student, teacher, tokenizer, rows: Sequence[dict[str, Any]], *, max_new_tokens: int = 64,
                      prompts_per_batch: int = 8, device: str = "cpu", generator: Any = None) -> list[dict[str, Any]]:
    """One record per held-out prefix row: ``prefix_id``, ``category``, ``valid`` (the greedy response
    is well-formed), ``match`` (its action is the expert's), ``tll`` / ``tll_tokens`` (teacher
    log-likelihood of the greedy action, None when there is none), ``sll_expert`` / ``sll_tokens``
    (the student's log-likelihood of the expert action). ``generator`` replaces the student's greedy
    decoding (tests)."""
    student.eval()
    teacher.eval()
    gen = generator or HFGenerator(student, tokenizer, prompts_per_batch=prompts_per_batch, device=device)
    samples = gen.generate([r["prompt"] for r in rows], SamplingParams(
        n=1, temperature=0.0, max_new_tokens=max_new_tokens, stop=stops_for("action")))
    prompts = [_ids(tokenizer, r["prompt"]) for r in rows]
    expert = [_ids(tokenizer, r["recorded_response"]) for r in rows]
    sll = _action_logprobs(student, tokenizer, prompts, expert)
    out: list[dict[str, Any]] = []
    scored_idx, scored_resp = [], []
    for i, (r, (s,)) in enumerate(zip(rows, samples)):
        d = parse_decision(s.text, BENCHMARK)
        action = s.text[d.span[0]:d.span[1]].strip() if d.valid and d.span is not None else None
        out.append({"prefix_id": r["prefix_id"], "category": r.get("category"), "valid": bool(d.valid),
                    "action": action, "expert_action": r["recorded_action"],
                    "match": bool(action is not None
                                  and normalize_action(action) == normalize_action(r["recorded_action"])),
                    "tll": None, "tll_tokens": 0, "sll_expert": sll[i][0], "sll_tokens": sll[i][1]})
        if action:
            scored_idx.append(i)
            scored_resp.append(_ids(tokenizer, with_action(r["recorded_response"], action)))
    tll = _action_logprobs(teacher, tokenizer, [prompts[i] for i in scored_idx], scored_resp)
    for i, (v, n) in zip(scored_idx, tll):
        out[i]["tll"], out[i]["tll_tokens"] = v, n
    return out


def summarize_decisions(records: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Aggregate :func:`heldout_decisions`: action match, format validity, mean TLL (sum and per token,
    over greedy responses that have an action), mean student log-likelihood of the expert action."""
    n = len(records)
    if not n:
        raise ValueError("no held-out decisions")
    with_tll = [r for r in records if r["tll"] is not None and r["tll_tokens"]]
    return {
        "decisions": n,
        "action_match": sum(r["match"] for r in records) / n,
        "format_valid": sum(r["valid"] for r in records) / n,
        "tll_sum": statistics.fmean(r["tll"] for r in with_tll) if with_tll else float("nan"),
        "tll_per_token": statistics.fmean(r["tll"] / r["tll_tokens"] for r in with_tll) if with_tll else float("nan"),
        "sll_expert": statistics.fmean(r["sll_expert"] for r in records),
        "sll_expert_per_token": statistics.fmean(r["sll_expert"] / max(r["sll_tokens"], 1) for r in records),
    }


# ---------------------------------------------------------------------------------------------------
# the round-0 signal probe

SCORE_KINDS = ("action_sum", "action_mean", "thought_sum", "full_sum")


def _think_mask(tokenizer, token_ids: Sequence[int]) -> list[bool]:
    text, offsets = token_char_offsets(tokenizer, token_ids)
    m = _THINK.search(text)
    return span_token_mask(offsets, (m.start(1), m.end(1)) if m else None)


def probe_summary(groups: Sequence[Sequence[dict[str, Any]]]) -> dict[str, Any]:
    """The probe's figures from its groups of response records, each ``{"d": [..], "action": [bool],
    "think": [bool], "correct": bool, "finish_reason": str}`` (``d`` and the masks per response token).
    Pure, so a test can check it by hand (:func:`signal_probe` documents the figures)."""
    kinds: dict[str, list[list[tuple[float, bool]]]] = {k: [] for k in SCORE_KINDS}
    lengths, action_sums = [], []
    n_resp = n_valid = n_length = all_bad = top_bad = mixed = 0
    for group in groups:
        per_kind: dict[str, list[tuple[float, bool]]] = {k: [] for k in SCORE_KINDS}
        valid_scores, any_bad = [], False
        for rec in group:
            n_resp += 1
            n_length += rec["finish_reason"] == "length"
            d, act, think = rec["d"], rec["action"], rec["think"]
            if not any(act):
                any_bad = True
                continue
            n_valid += 1
            a_vals = [x for x, m in zip(d, act) if m]
            score = {"action_sum": sum(a_vals), "action_mean": sum(a_vals) / len(a_vals),
                     "thought_sum": sum(x for x, m in zip(d, think) if m), "full_sum": sum(d)}
            for k in SCORE_KINDS:
                per_kind[k].append((score[k], bool(rec["correct"])))
            lengths.append(len(a_vals))
            action_sums.append(score["action_sum"])
            valid_scores.append(score["action_sum"])
        for k in SCORE_KINDS:
            kinds[k].append(per_kind[k])
        if not valid_scores:
            all_bad += 1
        elif any_bad:
            mixed += 1
            top_bad += max(valid_scores) < 0.0
    n_groups = max(len(groups), 1)
    out: dict[str, Any] = {"prefixes": len(groups), "responses": n_resp, "well_formed": n_valid / max(n_resp, 1),
                           "finish_length": n_length / max(n_resp, 1), "all_malformed_groups": all_bad / n_groups,
                           "malformed_tops_group": top_bad / n_groups, "mixed_groups": mixed / n_groups,
                           "mean_r_well_formed": statistics.fmean(action_sums) if action_sums else float("nan"),
                           "len_corr": pearson(lengths, action_sums)}
    for k in SCORE_KINDS:
        auc = within_group_auc(kinds[k])
        out[f"auc_{k}"], out[f"auc_{k}_ci"] = auc["auc"], auc["ci"]
        out["auc_pairs"], out["auc_groups"] = auc["pairs"], auc["groups"]
    return out


@torch.no_grad()
def signal_probe(student, teacher, tokenizer, rows: Sequence[dict[str, Any]], *, group_size: int = 8,
                 temperature: float = 1.0, max_new_tokens: int = 64, seed: int = 0, prompts_per_batch: int = 4,
                 device: str = "cpu", generator: Any = None) -> dict[str, Any]:
    """SAPD's premise, tested before any training: does the teacher's step score rank the student's
    correct actions (= the expert's action for the prefix) above its wrong ones within a group?

    G samples per prefix from ``student`` (or ``generator``) at ``temperature``; d = log π_T − log π_S per
    token (the sampler's own T = 1 log-probs as π_old, as in round 0 of a run). Scores per response: the
    action-only sum (Eq. 6) and mean, the thought-only sum and the full-token sum (Table 7). AUCs are
    over well-formed responses (a response without an action is neither correct nor wrong);
    ``len_corr`` is corr(action-only sum, action length) over them (the length bias). Health: the
    well-formed share, the share ending at the token budget, all-malformed groups, E[r | well-formed],
    and the share of groups in which a malformed response (r = 0, Eq. 6 as written) would hold the top
    step score."""
    teacher.eval()
    if generator is None:
        student.eval()
        generator = HFGenerator(student, tokenizer, prompts_per_batch=prompts_per_batch, device=device)
    params = SamplingParams(n=group_size, temperature=temperature, top_p=1.0, max_new_tokens=max_new_tokens,
                            stop=stops_for("action"), seed=seed)
    samples = generator.generate([r["prompt"] for r in rows], params)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    groups = []
    for r, group in zip(rows, samples):
        prompt = _ids(tokenizer, r["prompt"])
        teacher_lp = score_groups(teacher, [(r["prefix_id"], prompt, [s.token_ids for s in group])], pad_id=pad)[0]
        recs = []
        for s, t_lp in zip(group, teacher_lp):
            parsed = parse_decision(s.text, BENCHMARK)
            action = (parsed.content or "") if parsed.valid else ""
            correct = bool(action) and normalize_action(action) == normalize_action(r["recorded_action"])
            recs.append({"d": [a - b for a, b in zip(t_lp, s.logprobs)],
                         "action": action_token_mask(tokenizer, s.token_ids, BENCHMARK),
                         "think": _think_mask(tokenizer, s.token_ids), "finish_reason": s.finish_reason,
                         "correct": correct})
        groups.append(recs)
    return {**probe_summary(groups), "group_size": group_size, "temperature": temperature}


# ---------------------------------------------------------------------------------------------------
# health per round

HEALTH_KEYS = ("no_action_fraction", "all_no_action_groups", "step_adv_abs_mean", "rule_adv_abs_mean",
               "tok_adv_abs_mean", "clip_fraction", "teacher_student_gap", "loss_kl", "loss_entropy")


def round_health(root: str) -> list[dict[str, Any]]:
    """Per round of a run: the mean of each health figure over its optimizer steps, plus from its scored
    round the well-formed share of the samples (format rule satisfied), the action-less share and the
    share of samples that hit the token budget (``finish_length``)."""
    by_round: dict[int, list[dict[str, Any]]] = {}
    for s in read_step_log(root):
        by_round.setdefault(int(s["round"]), []).append(s)
    out = []
    for k in sorted(by_round):
        steps = by_round[k]
        rec: dict[str, Any] = {"round": k}
        for key in HEALTH_KEYS:
            vals = [float(s[key]) for s in steps if key in s and s[key] is not None and not math.isnan(float(s[key]))]
            if vals:
                rec[key] = statistics.fmean(vals)
        if shards.read_manifest(layout.scored_dir(root, k)) is not None:
            rows = read_scored(root, k).to_pylist()
            fmt = [f for row in rows for f in row["format_score"]]
            fin = [f for row in rows for f in row["finish_reason"]]
            masks = [m for row in rows for m in row["action_mask"]]
            rec["well_formed"] = sum(f == 0 for f in fmt) / max(len(fmt), 1)
            rec["action_less"] = sum(not any(m) for m in masks) / max(len(masks), 1)
            rec["finish_length"] = sum(f == "length" for f in fin) / max(len(fin), 1)
        out.append(rec)
    return out
