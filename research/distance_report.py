"""The distance study's report (``docs/results/DISTANCE.md``, ``distance.json`` and its figures) from the
committed ledger (``experiments/distance/``), only from finished units:

    python -m research distance report

Every figure is the product's reverse KL(student ‖ teacher) per sampled token (:mod:`sapd.data.validation`).
Across seeds: the mean and the sample standard deviation; a knob's effect is its paired difference to the
base setting seed by seed (the same seed, the same data order), with a t-interval over the seeds — "within
noise" when that interval holds 0.
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path
from typing import Any

from research.distance import PANELS, DistanceStudy
from sapd.data.validation import paired_ratio_difference

T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571}  # t quantiles, by degrees of freedom
LABELS = {"opd_rule": "OPD+Rule", "sapd": "SAPD"}
SETTING_TEXT = {"base": "the demo's (constant lr, G = 8, 4 trajectories per round, λ_tok·β = 0.015)",
                "cosine": "cosine-decaying learning rate", "g16": "G = 16",
                "traj8": "8 trajectories per round (twice the demo's)",
                "lr_x10": "each arm's learning rate × 10 (not one of the issue's knobs: the step budget)",
                "tok_x10": "λ_tok·β × 10 (λ_tok = 1)", "tok_x67": "λ_tok·β × 67 (λ_tok = β = 1)"}


def _f(x: Any, nd: int = 3) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "–"
    return f"{x:.{nd}f}" if isinstance(x, float) else str(x)


def _ms(values: list[Any], nd: int = 3) -> str:
    xs = [float(x) for x in values if x is not None]
    if not xs:
        return "–"
    if len(xs) == 1:
        return f"{xs[0]:.{nd}f}"
    return f"{statistics.fmean(xs):.{nd}f} ± {statistics.stdev(xs):.{nd}f}"


def _t_interval(ds: list[float]) -> tuple[float, float, float]:
    """(mean, lo, hi) of per-seed paired differences; lo = hi = mean with one seed."""
    m = statistics.fmean(ds)
    if len(ds) < 2:
        return m, m, m
    half = T975.get(len(ds) - 1, 1.96) * statistics.stdev(ds) / math.sqrt(len(ds))
    return m, m - half, m + half


def _kl(point: dict[str, Any], panel: str, key: str = "reverse_kl_per_token") -> Any:
    """A figure of one measured checkpoint on one panel; None where that panel was not measured (the
    validation panel is measured on the first and the last checkpoint only)."""
    return point[panel]["overall"][key]["value"] if panel in point else None


def _plt():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def collect(study: DistanceStudy) -> dict[str, Any]:
    """Every finished run unit, by (method, setting) → {seed: unit}."""
    out: dict[tuple[str, str], dict[int, dict[str, Any]]] = {}
    for unit, method, setting, seed in study.units():
        rec = study.ledger.get(unit)
        if rec is not None:
            out.setdefault((method, setting), {})[seed] = rec
    return {"runs": out, "setup": study.ledger.get("setup"), "mismatch": study.ledger.get("mismatch"),
            "cost": study.ledger.get("cost")}


def _final(rec: dict[str, Any]) -> dict[str, Any]:
    return rec["curve"][-1]


def curves_figure(data: dict[str, Any], dest: Path) -> str:
    plt = _plt()
    fig, axes = plt.subplots(1, 3, figsize=(14, 3.8))
    setup = data["setup"]
    for ax, panel in zip(axes, ("test", "val", "train")):
        for method in ("opd_rule", "sapd"):
            seeds = data["runs"].get((method, "base"), {})
            if not seeds:
                continue
            all_x = [p["checkpoint"] for p in next(iter(seeds.values()))["curve"]]
            measured = [(x, [v for r in seeds.values() if (v := _kl(r["curve"][i], panel)) is not None])
                        for i, x in enumerate(all_x)]
            xs = [x for x, v in measured if v]
            per_x = [v for _, v in measured if v]
            line, = ax.plot(xs, [statistics.fmean(v) for v in per_x], marker="o", label=LABELS[method])
            ax.fill_between(xs, [min(v) for v in per_x], [max(v) for v in per_x], alpha=0.2, color=line.get_color())
        ax.axhline(setup["student"][panel]["overall"]["reverse_kl_per_token"]["value"], color="grey", lw=0.8, ls="--")
        ax.set_title(f"{panel} prefixes: reverse KL / sampled token", fontsize=9)
        ax.set_xlabel("checkpoint (rounds trained)")
        ax.set_ylim(bottom=0)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(dest, dpi=110)
    plt.close(fig)
    return dest.name


def knobs_figure(data: dict[str, Any], settings: list[str], dest: Path) -> str:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(10, 3.8))
    width = 0.38
    for j, method in enumerate(("opd_rule", "sapd")):
        for i, s in enumerate(settings):
            seeds = data["runs"].get((method, s), {})
            vals = [_kl(_final(r), "test") for r in seeds.values()]
            if not vals:
                continue
            x = i + (j - 0.5) * width
            ax.bar(x, statistics.fmean(vals), width, color=f"C{j}", alpha=0.6, label=LABELS[method] if i == 0 else None)
            ax.scatter([x] * len(vals), vals, color="k", s=8, zorder=3)
    ax.axhline(data["setup"]["student"]["test"]["overall"]["reverse_kl_per_token"]["value"], color="grey", lw=0.8,
               ls="--", label="student before")
    ax.set_xticks(range(len(settings)), settings)
    ax.set_ylabel("reverse KL / sampled token")
    ax.set_title("held-out (test) decisions, last checkpoint: mean over seeds (bars), each seed (dots)", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(dest, dpi=110)
    plt.close(fig)
    return dest.name


def _paired_seed_effect(a: dict[int, dict[str, Any]], b: dict[int, dict[str, Any]], panel: str,
                        key: str = "reverse_kl_per_token") -> dict[str, Any] | None:
    seeds = sorted(set(a) & set(b))
    if not seeds:
        return None
    ds = [_final(a[s])[panel]["overall"][key]["value"] - _final(b[s])[panel]["overall"][key]["value"] for s in seeds]
    m, lo, hi = _t_interval(ds)
    if len(seeds) < 2:  # one seed: no spread to judge by (the decisions' interval is reported beside it)
        return {"diff": m, "lo": None, "hi": None, "per_seed": ds, "seeds": seeds, "within_noise": None}
    return {"diff": m, "lo": lo, "hi": hi, "per_seed": ds, "seeds": seeds, "within_noise": lo <= 0 <= hi}


def _prefix_diff(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """Two measurements' KL per token on the same prefixes, paired over the prefixes (one seed's own noise)."""
    ids = sorted(set(a["per_prefix"]) & set(b["per_prefix"]))
    pa, pb = a["per_prefix"], b["per_prefix"]
    return paired_ratio_difference([pa[i][0] for i in ids], [pa[i][1] for i in ids], [pb[i][0] for i in ids],
                                   [pb[i][1] for i in ids])


def render_distance(study: DistanceStudy, results: str | Path) -> str:
    results = Path(results)
    results.mkdir(parents=True, exist_ok=True)
    data = collect(study)
    setup = data["setup"]
    if setup is None:
        raise RuntimeError("run `python -m research distance setup` first")
    cfg = study.cfg
    settings = list(cfg.settings)
    runs = data["runs"]
    md: list[str] = ["# Why the distance to the teacher stalls (issue 36)", "",
                     "Generated by `python -m research distance report` from the units recorded under "
                     "`experiments/distance/` (config `experiments/distance.yaml`, harness `research/distance.py`). "
                     "Only finished units appear.", ""]
    summary: dict[str, Any] = {"config": setup["config"], "student": {}, "teacher": {}, "base": {}, "knobs": {},
                               "mismatch": data["mismatch"], "cost": data["cost"]}
    n_runs = sum(len(v) for v in runs.values())
    wall = study.spent_seconds()
    md += ["## In short", "", "@@SHORT@@", ""]

    # --- set-up
    st, te = setup["student"], setup["teacher"]
    md += ["## Setting", "",
           f"The demo's models and logs (`sapd demo`, its default setting: a 128×2 student SFT'd on `coin_near`, the "
           f"teacher = the student SFT'd further on the clean expert's play of the training games, the ε = 0.25 noisy "
           f"expert's logs of those games), OPD+Rule (lr 3e-4) and SAPD (`no_action_step: penalty`, lr 1e-4) from "
           f"the student as the demo runs them, {cfg.rounds} rounds, training seeds {cfg.seeds} planned "
           f"({_seeds_run(runs)} recorded). Checkpoints "
           f"{cfg.curve} of every run are measured with the product's validation code (`distance_records`): "
           f"{cfg.group_size} samples per prefix at T = 1, the same sampling seed for every checkpoint, on three "
           "sets of prefixes:", "",
           "| set | what | prefixes | student: KL / token [95 % CI] | on action tokens | student's sampled match "
           "| teacher's |", "|---|---|---|---|---|---|---|"]
    what = {"val": f"the clean expert on {cfg.val_games} validation games per family (seed {cfg.val_seed}): "
                   "choosing only",
            "test": "the demo's 135 held-out decisions (the clean expert on its held-out games): reported",
            "train": f"{cfg.train_sample} of the noisy logs' own prefixes (what the arms train on)"}
    for p in PANELS:
        o = st[p]["overall"]
        kl = o["reverse_kl_per_token"]
        md.append(f"| {p} | {what[p]} | {st[p]['prefixes']} | {_f(kl['value'])} [{_f(kl['ci'][0])}, {_f(kl['ci'][1])}] "
                  f"| {_f(o['reverse_kl_per_action_token']['value'])} | {_f(o['action_match']['value'])} "
                  f"| {_f(te[p].get('teacher_action_match', {}).get('value'))} |")
        summary["student"][p] = {k: o[k] for k in ("reverse_kl_per_token", "reverse_kl_per_action_token",
                                                    "action_match", "recorded_logratio_per_token")}
        summary["teacher"][p] = te[p].get("teacher_action_match")
    md += ["", f"Weights: student `{setup['weights']['student']}`, teacher `{setup['weights']['teacher']}` "
           "(sha256 of the safetensors, first 16 hex digits).", ""]

    # --- 1. against rounds
    md += ["## 1. Distance against rounds (the demo's setting)", "",
           "Reverse KL per sampled token, mean ± sd over seeds; the training log's own gap is the mean of "
           "log π_S − log π_T over the round's own sampled tokens (`teacher_student_gap`, sign flipped), the round "
           "that trained from that checkpoint.", "",
           "| method | checkpoint | test | val | train | test, action tokens | test: sampled match "
           "| training-log gap |", "|---|---|---|---|---|---|---|---|"]
    short: list[str] = []
    for method in cfg.methods:
        seeds = runs.get((method, "base"), {})
        if not seeds:
            continue
        recs = list(seeds.values())
        for i, point in enumerate(recs[0]["curve"]):
            k = point["checkpoint"]
            gaps = [-r["training_gap"][str(k)] for r in recs if str(k) in r["training_gap"]]
            cells = " | ".join(_ms([_kl(r["curve"][i], p) for r in recs]) for p in ("test", "val", "train"))
            md.append(f"| {LABELS[method]} | {k} | {cells}"
                      f" | {_ms([_kl(r['curve'][i], 'test', 'reverse_kl_per_action_token') for r in recs])}"
                      f" | {_ms([_kl(r['curve'][i], 'test', 'action_match') for r in recs])} | {_ms(gaps)} |")
        k0 = _kl(recs[0]["curve"][0], "test")
        finals = [_kl(_final(r), "test") for r in recs]
        mids = {p["checkpoint"]: [_kl(r["curve"][j], "test") for r in recs] for j, p in enumerate(recs[0]["curve"])}
        summary["base"][method] = {"test_by_checkpoint": {k: statistics.fmean(v) for k, v in mids.items()},
                                   "final_over_start": statistics.fmean(finals) / k0}
        half = sorted(mids)[len(mids) // 2]
        short.append(f"{LABELS[method]} (the demo's setting, {_n_seeds(len(recs))}): held-out KL {k0:.3f} → "
                     f"{statistics.fmean(mids[half]):.3f} at checkpoint {half} → {statistics.fmean(finals):.3f} at "
                     f"{cfg.rounds} ({statistics.fmean(finals) / k0:.0%} of the start)")
    md += ["", "![distance against rounds](distance_curves.png)", "", *_notes(cfg, "curves")]
    if runs:
        curves_figure(data, results / "distance_curves.png")

    # --- 2. held-out against training prefixes
    md += ["## 2. Held-out against training prefixes", ""]
    noise = setup.get("train_noise", {})
    rows = ["| method | set | start | last | last / start | last − start, first seed: decisions' 95 % CI |",
            "|---|---|---|---|---|---|"]
    split_rows = []
    for method in cfg.methods:
        seeds = runs.get((method, "base"), {})
        if not seeds:
            continue
        for p in PANELS:
            start = st[p]["overall"]["reverse_kl_per_token"]["value"]
            lasts = [_kl(_final(r), p) for r in seeds.values()]
            rel = statistics.fmean(lasts) / start
            last0 = _final(seeds[min(seeds)])[p]
            moved = (_prefix_diff(last0, st[p]) if "per_prefix" in last0 and "per_prefix" in st[p] else None)
            moved_cell = "–" if moved is None or moved["diff"] is None else (
                f"{moved['diff']:+.3f} [{moved['ci'][0]:+.3f}, {moved['ci'][1]:+.3f}]")
            rows.append(f"| {LABELS[method]} | {p} | {_f(start)} | {_ms(lasts)} | {rel:.0%} | {moved_cell} |")
            summary.setdefault("moved", {})[f"{method}.{p}"] = moved
        if noise:  # the train panel split by the history the prefix carries
            for label, pick in (("clean history", lambda n: not n[0] and not n[1]),
                                ("noise in the history", lambda n: not n[0] and n[1]),
                                ("recorded action is the noise", lambda n: n[0])):
                ids = [i for i, n in noise.items() if pick(n)]
                if not ids:
                    continue

                start = _kl_on(st["train"]["per_prefix"], ids)
                lasts = [_kl_on(_final(r)["train"]["per_prefix"], ids) for r in seeds.values()]
                split_rows.append(f"| {LABELS[method]} | {label} | {len(ids)} | {start:.3f} | {_ms(lasts)} |")
    md += rows + [""]
    heldout_notes = _notes(cfg, "heldout")
    if split_rows:
        md += ["The training prefixes by what their history holds (the noisy expert re-plans after a noisy action, "
               "so a prefix after one is a state the clean expert — and the teacher — never visited):", "",
               "| method | train prefixes | n | start | last |", "|---|---|---|---|---|", *split_rows, ""]
    md += heldout_notes

    # --- 3. knobs
    md += ["## 3. What each knob changes", "",
           "Last checkpoint, held-out (test) decisions: reverse KL per sampled token (mean ± sd over seeds), its "
           "difference to the base setting paired by seed (mean [95 % t-interval over seeds]; *within noise* when "
           "the interval holds 0), the same difference for seed 0 with the interval its 135 decisions give (the "
           "measurement's own noise, paired by decision), the difference on the validation panel (what a choice "
           "would be made on), the sampled action match, and the optimizer steps per run (wall time on the shared "
           "cores says more about the other jobs than about the setting).", "",
           "| method | setting | test KL | Δ vs base (test) | seed 0: Δ, decisions' 95 % CI | Δ vs base (val) "
           "| test: sampled match | optimizer steps |", "|---|---|---|---|---|---|---|---|"]
    for method in cfg.methods:
        base = runs.get((method, "base"), {})
        for s in settings:
            seeds = runs.get((method, s), {})
            if not seeds:
                md.append(f"| {LABELS[method]} | {s} | (not run) | | | | | |")
                continue
            finals = [_kl(_final(r), "test") for r in seeds.values()]
            eff = {p: _paired_seed_effect(seeds, base, p) if s != "base" else None for p in ("test", "val")}
            cell = {p: _effect_cell(e) for p, e in eff.items()}
            first = min(set(seeds) & set(base)) if set(seeds) & set(base) else None
            within = (None if s == "base" or first is None or "per_prefix" not in _final(seeds[first])["test"]
                      else _prefix_diff(_final(seeds[first])["test"], _final(base[first])["test"]))
            within_cell = "–" if within is None or within["diff"] is None else (
                f"{within['diff']:+.3f} [{within['ci'][0]:+.3f}, {within['ci'][1]:+.3f}]")
            md.append(f"| {LABELS[method]} | {s} | {_ms(finals)} | {cell['test']} | {within_cell} | {cell['val']} "
                      f"| {_ms([_kl(_final(r), 'test', 'action_match') for r in seeds.values()])} "
                      f"| {_ms([r['optimizer_steps'] for r in seeds.values()], 0)} |")
            summary["knobs"][f"{method}.{s}"] = {"test_kl": finals, "effect": eff, "seed0_decisions": within,
                                                 "seeds": sorted(seeds),
                                                 "optimizer_steps": [r["optimizer_steps"] for r in seeds.values()],
                                                 "train_seconds": [r["train_seconds"] for r in seeds.values()]}
    md += ["", "Settings: " + "; ".join(f"`{s}`: {SETTING_TEXT.get(s, cfg.settings[s])}" for s in settings) + ".",
           "", "![knobs](distance_knobs.png)", "", *_notes(cfg, "knobs"), *_notes(cfg, "demo")]
    if runs:
        knobs_figure(data, settings, results / "distance_knobs.png")

    # --- 4. the teacher's feedback on the logs' prefixes
    mm = data["mismatch"]
    md += ["## 4. Is the teacher's feedback reliable on the noisy logs' prefixes?", ""]
    if mm is None:
        md += ["(not run yet: `python -m research distance mismatch`)", ""]
    else:
        md += [f"Every prefix of the noisy logs ({mm['prefixes']}), {mm['group_size']} samples each from the student "
               "and from the teacher at T = 1. Match: the sampled action is the recorded one (on prefixes whose "
               "recorded action is not the noise, the clean expert's re-planned action). AUC: the teacher's "
               "action-only step score ranks the student's matching samples above its others within a prefix "
               "(`research.signals.signal_probe`; pairs pooled, 95 % bootstrap over prefixes).", "",
               "| prefixes | n | teacher's match | student's match | reverse KL / token | step-score AUC (pairs) |",
               "|---|---|---|---|---|---|"]
        for name, g in mm["groups"].items():
            auc = g.get("auc_action_sum")
            ci = g.get("auc_action_sum_ci") or [None, None]
            auc_cell = f"{_f(auc)} [{_f(ci[0])}, {_f(ci[1])}] ({_f(g.get('auc_pairs'), 0)})" if auc is not None else "–"
            md.append(f"| {name} | {g['prefixes']} | {_fig(g.get('teacher_action_match'))} "
                      f"| {_fig(g.get('action_match'))} | {_fig(g.get('reverse_kl_per_token'))} | {auc_cell} |")
        md.append("")
        md += _notes(cfg, "mismatch")

    # --- 5. cost
    cost = data["cost"]
    md += ["## 5. What the per-round validation costs", ""]
    if cost is None:
        md += ["(not run yet: `python -m research distance cost`)", ""]
    else:
        md += [f"`sapd run` with the product's default validation ({cost['settings']['max_prefixes']} prefixes × "
               f"{cost['settings']['group_size']} samples, every round) on the demo's SAPD arm, with a validation pool "
               f"(`data.val_fraction` 0.3), HF on one CPU thread, {cost['rounds']} rounds:", "",
               "| checkpoint | prefixes | validation s (sample / teacher / recorded / teacher's samples) "
               "| round: samples | sample s | score s | train s |", "|---|---|---|---|---|---|---|"]
        for r in cost["per_round"]:
            t = r["validation_timings"]
            md.append(f"| {r['checkpoint']} | {r['prefixes']} | {r['validation_seconds']:.1f} "
                      f"({t.get('sample_seconds', 0):.1f} / "
                      f"{t.get('score_seconds', 0):.1f} / {t.get('recorded_seconds', 0):.1f} / "
                      f"{t.get('teacher_sample_seconds', 0):.1f}) | {_f(r['round_samples'], 0)} "
                      f"| {_f(r['round_sample_seconds'], 1)} "
                      f"| {_f(r['round_score_seconds'], 1)} | {_f(r['round_train_seconds'], 1)} |")
        md.append("")
        md += _notes(cfg, "cost")
    # --- 6. the issue's starting distance
    older = study.ledger.get("older-teacher")
    md += ["## 6. Why the issue's starting distance was smaller", ""]
    if older is None:
        md += ["(not run yet: `python -m research distance older-teacher`)", ""]
    else:
        o, t = older["student"]["overall"], older["teacher"]
        kl = o["reverse_kl_per_token"]
        st_kl = setup["student"]["test"]["overall"]["reverse_kl_per_token"]
        md += [f"The demo's teacher as it was built when the issue was measured ({older['epochs']:g} epochs at "
               f"{older['lr']:g} over the clean play, {older['rounds']} rounds, instead of "
               f"{study.demo_cfg.teacher_epochs:g} at {study.demo_cfg.teacher_lr:g}), SFT'd here from the same student "
               f"with the same recipe otherwise (weights `{older['weights']}`); the student's distance to each teacher "
               "on the 135 held-out decisions, measured the same way:", "",
               "| teacher | student's reverse KL / token [95 % CI] | the teacher's own sampled action match |",
               "|---|---|---|",
               f"| the demo's ({study.demo_cfg.teacher_epochs:g} epochs at {study.demo_cfg.teacher_lr:g}) "
               f"| {_f(st_kl['value'])} [{_f(st_kl['ci'][0])}, {_f(st_kl['ci'][1])}] "
               f"| {_fig(setup['teacher']['test'].get('teacher_action_match'))} |",
               f"| the older ({older['epochs']:g} epochs at {older['lr']:g}) | {_f(kl['value'])} [{_f(kl['ci'][0])}, "
               f"{_f(kl['ci'][1])}] | {_fig(t.get('teacher_action_match'))} |", ""]
        summary["older_teacher"] = {"reverse_kl_per_token": kl, "teacher_action_match": t.get("teacher_action_match")}
        md += _notes(cfg, "older")
    md += ["## Cost of this study", "",
           f"{n_runs} runs recorded; {wall / 3600:.1f} h of recorded compute (training, measuring, set-up, the demo "
           "it starts from), each process with one torch thread under `nice`, one to four at a time, on the project's "
           "2 cores.", ""]
    summary["runs"] = n_runs
    summary["recorded_hours"] = wall / 3600
    short_text = "\n".join(f"- {x}." for x in short) or "- (no run finished yet)"
    text = "\n".join(md).replace("@@SHORT@@", short_text + ("\n\n" + cfg.notes["short"].strip()
                                                           if cfg.notes.get("short") else ""))
    (results / "DISTANCE.md").write_text(text, encoding="utf-8")
    (results / "distance.json").write_text(json.dumps(summary, indent=1, default=float, sort_keys=True) + "\n")
    return str(results / "DISTANCE.md")


def _notes(cfg: Any, section: str) -> list[str]:
    """The author's notes for a section (``notes:`` in the study's config), as report lines."""
    text = cfg.notes.get(section, "").strip()
    return [text, ""] if text else []


def _seeds_run(runs: dict[Any, dict[int, Any]]) -> str:
    """Which training seeds the recorded units hold, e.g. ``seed 0 only``."""
    seeds = sorted({seed for by_seed in runs.values() for seed in by_seed})
    if not seeds:
        return "none"
    return f"seed {seeds[0]} only" if len(seeds) == 1 else "seeds " + ", ".join(map(str, seeds))


def _n_seeds(n: int) -> str:
    return "1 seed" if n == 1 else f"{n} seeds"


def _effect_cell(e: dict[str, Any] | None) -> str:
    """A knob's paired seed difference: mean [t-interval] and whether it is within noise; one seed: no interval."""
    if e is None:
        return "–"
    if e["lo"] is None:
        return f"{e['diff']:+.3f} (one seed)"
    return f"{e['diff']:+.3f} [{e['lo']:+.3f}, {e['hi']:+.3f}]" + (" *within noise*" if e["within_noise"] else "")


def _kl_on(per: dict[str, list[float]], ids: list[str]) -> float:
    """KL per token over the prefixes ``ids`` of per-prefix [Σ KL, tokens, …] figures."""
    return sum(per[i][0] for i in ids) / max(sum(per[i][1] for i in ids), 1)


def _fig(f: dict[str, Any] | None) -> str:
    if not f or f.get("value") is None:
        return "–"
    lo, hi = f["ci"]
    return f"{f['value']:.3f}" + (f" [{lo:.3f}, {hi:.3f}]" if lo is not None else "")
