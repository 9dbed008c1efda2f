"""The powered study's report (``docs/results/POWERED.md`` and its figures) from the committed ledger
(``experiments/powered/``) — only from units that finished; what is still to run is listed as such.

    python -m research powered report
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from research.powered import PoweredStudy
from research.stats import mde, paired_bootstrap


def _f(x: Any, nd: int = 3) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "–"
    return f"{x:.{nd}f}" if isinstance(x, float) else str(x)


def _plt():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def _save(plt, fig, path: Path) -> str:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path.name


def _band(ax, xs: list[int], per_x: list[list[float]], label: str, alpha: float = 0.2):
    """The mean over seeds as a line and their min–max as a band (one list of seed values per x)."""
    line, = ax.plot(xs, [sum(v) / len(v) for v in per_x], lw=1, label=label)
    ax.fill_between(xs, [min(v) for v in per_x], [max(v) for v in per_x], alpha=alpha, color=line.get_color())
    return line


def probe_figure(probes: dict[str, dict[str, Any]], dest: Path) -> str:
    plt = _plt()
    kinds = ["auc_action_sum", "auc_action_mean", "auc_thought_sum", "auc_full_sum"]
    fig, ax = plt.subplots(figsize=(6, 3.2))
    width = 0.8 / max(len(probes), 1)
    for i, (name, p) in enumerate(probes.items()):
        vals = [p.get(k, float("nan")) for k in kinds]
        cis = [p.get(f"{k}_ci") or [v, v] for k, v in zip(kinds, vals)]
        ax.bar([j + i * width for j in range(len(kinds))], vals, width, label=name,
               yerr=[[v - c[0] for v, c in zip(vals, cis)], [c[1] - v for v, c in zip(vals, cis)]], capsize=3)
    ax.axhline(0.5, color="grey", lw=0.8, ls="--")
    ax.set_xticks([j + width * (len(probes) - 1) / 2 for j in range(len(kinds))])
    ax.set_xticklabels(["action sum", "action mean", "thought sum", "full-token sum"])
    ax.set_ylim(0, 1)
    ax.set_ylabel("within-group AUC")
    ax.set_title("Round 0: does the step score rank correct actions first? (95 % CI)", fontsize=9)
    ax.legend(fontsize=8)
    return _save(plt, fig, dest / "powered_probe_auc.png")


def health_figure(units: dict[str, dict[str, Any]], dest: Path) -> str:
    plt = _plt()
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.4), sharex=True)
    for name, u in sorted(units.items()):
        h = u.get("health") or []
        rounds = [r["round"] for r in h]
        axes[0].plot(rounds, [r.get("well_formed", float("nan")) for r in h], label=name, lw=1)
        axes[1].plot(rounds, [r.get("all_no_action_groups", float("nan")) for r in h], lw=1)
    axes[0].set_title("well-formed share of T = 1 samples")
    axes[1].set_title("share of groups with no action at all")
    for ax in axes:
        ax.set_xlabel("round")
        ax.set_ylim(-0.02, 1.02)
    axes[0].legend(fontsize=6, ncol=2)
    return _save(plt, fig, dest / "powered_health.png")


def curves_figure(finals: dict[str, list[dict[str, Any]]], dest: Path) -> str:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6, 3.4))
    for arm, runs in sorted(finals.items()):
        curves = [r["curve"] for r in runs if r.get("curve")]
        if not curves:
            continue
        rounds = [p["round"] for p in curves[0]]
        _band(ax, rounds, [[c[i]["action_match"] for c in curves] for i in range(len(rounds))],
              f"{arm} ({len(curves)} seeds)")
    ax.set_xlabel("round")
    ax.set_ylabel("validation action match")
    ax.set_title("Learning curves (band: min–max over seeds)")
    ax.legend(fontsize=7)
    return _save(plt, fig, dest / "powered_curves.png")


def _outcomes(runs: list[dict[str, Any]], key: str, index: int = 0) -> dict[int, dict[str, float]]:
    """{seed: {unit: value}} of the final runs: per decision (match: index 0, TLL: index 1; decisions
    without a value are left out) or per game (won)."""
    def value(v: Any) -> float | None:
        x = v[index] if isinstance(v, list) else v
        return None if x is None or (isinstance(x, float) and math.isnan(x)) else float(x)
    return {r["seed"]: {k: x for k, v in r["eval"][key].items() if (x := value(v)) is not None} for r in runs}


def _mean_sd(xs: list[float]) -> tuple[float, float]:
    m = sum(xs) / len(xs)
    return m, (math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1)) if len(xs) > 1 else float("nan"))


# the pre-registered contrasts (ANALYSIS_PLAN.md §6): (a, b, question)
CONTRASTS = [("sapd", "opd_rule", "C1: SAPD (chosen treatment) − OPD+Rule"),
             ("sapd", "sapd_paper", "no-action treatment: chosen − Eq. 6 as written"),
             ("sapd", "wo_rule", "C2: SAPD − w/o Rule"),
             ("sapd", "full_token", "C3: action-only − full-token scoring"),
             ("sft", "opd_rule", "SFT on the logs − OPD+Rule"),
             ("opd", "opd_rule", "OPD − OPD+Rule")]


def contrast(finals: dict[str, list[dict[str, Any]]], a: str, b: str) -> dict[str, dict[str, float]] | None:
    """a − b on the test panel: action match and TLL paired by decision, success paired by game."""
    if not finals.get(a) or not finals.get(b):
        return None
    return {"match": paired_bootstrap(_outcomes(finals[a], "per_decision"), _outcomes(finals[b], "per_decision")),
            "tll": paired_bootstrap(_outcomes(finals[a], "per_decision", 1), _outcomes(finals[b], "per_decision", 1)),
            "success": paired_bootstrap(_outcomes(finals[a], "per_game"), _outcomes(finals[b], "per_game"))}


def c1_reading(c: dict[str, dict[str, float]], mde: float) -> str:
    """ANALYSIS_PLAN.md §6, fixed before the test evaluation."""
    m, t, s = c["match"], c["tll"], c["success"]
    if m["diff"] > mde and m["lo"] > 0 and t["lo"] > 0 and s["hi"] >= 0:
        return "**C1 supported**"
    if m["hi"] < mde:
        return f"**C1 refuted at this scale** (the action-match interval lies below the MDE, {mde:.3f})"
    return "**not separable at this power**"


def default_reading(c: dict[str, dict[str, float]], paper_collapsed: bool) -> str:
    """ANALYSIS_PLAN.md §6: the product default changes to the chosen treatment only if it is not worse
    than Eq. 6 as written on action match and either that collapses or the chosen one is better."""
    m = c["match"]
    change = m["hi"] >= 0 and (paper_collapsed or m["lo"] > 0)
    return ("change the default to the chosen treatment" if change else "keep `no_action_step: zero`")


# the paper's claims (docs/SAPD.md §7) and the pre-registered contrast that tests each: (claim, paper's
# numbers, a, b, sign): the claim says sign · (a − b) > 0
CLAIMS = [("SAPD beats OPD+Rule", "success +2.6 to +6.5 points (ALFWorld, WebShop), +0.2 to +0.3 (search)",
           "sapd", "opd_rule", 1),
          ("the rule term matters: SAPD beats w/o Rule", "ALFWorld 69.3 vs 62.0 (GRPO teacher)", "sapd", "wo_rule", 1),
          ("action-only step scoring is at least as good as full-token", "96.6/59.4/38.8 vs 95.9/50.0/38.6 (Table 7)",
           "sapd", "full_token", 1),
          ("distilling from the teacher beats imitating the logs (OPD+Rule vs SFT)", "SFT below OPD+Rule in Table 1",
           "sft", "opd_rule", -1),
          ("the rule helps OPD (OPD+Rule vs OPD)", "OPD below OPD+Rule in Table 1", "opd", "opd_rule", -1)]


def claim_reading(c: dict[str, dict[str, float]], sign: int) -> str:
    """The primary endpoint (action match, paired by decision) in the claim's direction: *agrees* if its
    interval is on the claimed side of 0, *contradicts* if on the other side, else not separable."""
    m = c["match"]
    lo, hi = (m["lo"], m["hi"]) if sign > 0 else (-m["hi"], -m["lo"])
    if lo > 0:
        return "agrees"
    if hi < 0:
        return "**contradicts**"
    return "not separable at this power"


def claims_lines(finals: dict[str, list[dict[str, Any]]], probes: dict[str, dict[str, Any]], n_seeds: int,
                 mde: float) -> tuple[list[str], list[str]]:
    """The paper's claims against the test panel: the measured difference with its interval and the
    reading → (the section's lines, one short bullet per measured claim for the summary)."""
    short: list[str] = []
    lines = ["## The paper's claims against the test panel", "",
             "Each claim is read on the primary endpoint, action match on the held-out decisions (a − b with its "
             "two-level bootstrap 95 % interval, in the claim's direction): *agrees* when the interval is on the "
             "claimed side of 0, *contradicts* when it is on the other side, otherwise *not separable at this "
             f"power* (the study resolves about {100 * mde:.1f} points of action match). TLL and success are "
             "given beside it. C1 (the first row) is also read by the plan's stricter rule above. A row with "
             f"fewer than {n_seeds} seeds in either arm is provisional.", "",
             "| paper's claim | paper | a − b | Δ action match | Δ TLL | Δ success | reading |",
             "|---|---|---|---|---|---|---|"]
    for claim, paper, a, b, sign in CLAIMS:
        c = contrast(finals, a, b)
        if c is None:
            lines.append(f"| {claim} | {paper} | {a} − {b} | – | – | – | not run yet |")
            continue
        cells = [f"{d['diff'] * 100:+.1f} [{d['lo'] * 100:+.1f}, {d['hi'] * 100:+.1f}] pts"
                 for d in (c["match"], c["success"])]
        t = c["tll"]
        partial = min(c["match"]["seeds_a"], c["match"]["seeds_b"]) < n_seeds
        reading = f"{claim_reading(c, sign)}{' (provisional)' if partial else ''}"
        lines.append(f"| {claim} | {paper} | {a} − {b} | {cells[0]} | {t['diff']:+.3f} [{t['lo']:+.3f}, "
                     f"{t['hi']:+.3f}] | {cells[1]} | {reading} |")
        short.append(f"{claim}: {reading} ({a} − {b}: action match {cells[0]}, success {cells[1]})")
    tiny = next((p for n, p in probes.items() if n.startswith("tiny")), None)
    if tiny is not None and tiny.get("auc_action_sum_ci"):
        lo, hi = tiny["auc_action_sum_ci"]
        fl, fh = tiny.get("auc_full_sum_ci") or [float("nan")] * 2
        held = "holds" if lo > 0.5 else "is not shown"
        lines += ["", f"SAPD's premise (round 0, no training): the action-only step score ranks the expert's action "
                  f"above wrong ones within a group with AUC {tiny['auc_action_sum']:.3f} [{lo:.3f}, {hi:.3f}]: "
                  f"the premise {held} by the plan's rule (interval above 0.5). Full-token scoring: "
                  f"{tiny['auc_full_sum']:.3f} [{fl:.3f}, {fh:.3f}]; "
                  "the thought-only score, which carries no decision here, sits at "
                  f"{tiny['auc_thought_sum']:.3f}."]
        real = probes.get("SmolLM2-135M")
        also = ""
        if real is not None and real.get("auc_action_sum_ci"):
            rlo, rhi = real["auc_action_sum_ci"]
            also = (f"; with the real SmolLM2-135M (after a few SFT rounds, no SAPD training) "
                    f"{real['auc_action_sum']:.3f} [{rlo:.3f}, {rhi:.3f}]")
        short.insert(0, f"SAPD's premise at round 0 {held}: action-only AUC {tiny['auc_action_sum']:.3f} "
                        f"[{lo:.3f}, {hi:.3f}]{also}")
    return lines + [""], short


def power_check_lines(finals: dict[str, list[dict[str, Any]]], plan: Any, n_seeds: int) -> list[str]:
    """The power calculation's assumptions against what the final runs show: the between-seed standard
    deviation of each endpoint (pooled over arms with ≥ 2 seeds) and the MDE recomputed with it."""
    rows = []
    for key, label, sigma, base, rho in (("success", "success", plan.success_sigma_seed, plan.success_base,
                                          plan.success_rho),
                                         ("action_match", "action match", plan.match_sigma_seed, plan.match_base, 0.0)):
        variances, values, units = [], [], []
        for runs in finals.values():
            xs = [float(r["eval"][key]) for r in runs]
            values += xs
            units += [len(r["eval"]["per_game" if key == "success" else "per_decision"]) for r in runs]
            if len(xs) >= 2:
                variances.append(_mean_sd(xs)[1] ** 2)
        if not variances:
            continue
        sd = math.sqrt(sum(variances) / len(variances))
        p = sum(values) / len(values)
        n = min(units)
        planned = mde(base, n, n_seeds, sigma, rho)
        observed = mde(p, n, n_seeds, sd, rho)
        rows.append(f"| {label} | {sigma:.3f} | {sd:.3f} ({len(variances)} arms) | {base:.2f} | {p:.2f} | "
                    f"{100 * planned:.1f} | {100 * observed:.1f} |")
    if not rows:
        return []
    return ["Power check (after the fact, descriptive): the plan's between-seed standard deviation and base rate "
            "against those of the final runs, and the minimum detectable difference (80 % power, α = 0.05, "
            f"{n_seeds} seeds, paired units) with each.", "",
            "| endpoint | planned seed sd | observed seed sd | planned base | observed mean | planned MDE (pts) | "
            "MDE with the observed sd (pts) |", "|---|---|---|---|---|---|---|", *rows, ""]


def forest_figure(rows: list[tuple[str, dict[str, dict[str, float]]]], dest: Path) -> str:
    plt = _plt()
    fig, axes = plt.subplots(1, 3, figsize=(11, 0.5 * len(rows) + 1.6), sharey=True)
    for ax, key, title in zip(axes, ("match", "tll", "success"),
                              ("Δ action match", "Δ TLL (nats)", "Δ success")):
        for i, (_, c) in enumerate(rows):
            d = c[key]
            ax.errorbar([d["diff"]], [i], xerr=[[d["diff"] - d["lo"]], [d["hi"] - d["diff"]]], fmt="o", capsize=3)
        ax.axvline(0, color="grey", lw=0.8, ls="--")
        ax.set_title(title, fontsize=9)
    axes[0].set_yticks(range(len(rows)), [q for q, _ in rows], fontsize=7)
    axes[0].invert_yaxis()
    fig.suptitle("Test panel: pre-registered differences, 95 % two-level bootstrap", fontsize=10)
    return _save(plt, fig, dest / "powered_differences.png")


def final_health_figure(finals: dict[str, list[dict[str, Any]]], dest: Path) -> str:
    plt = _plt()
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.4), sharex=True)
    keys = (("well_formed", "well-formed share (T = 1 samples)"), ("action_less", "action-less share"),
            ("all_no_action_groups", "groups with no action at all"))
    for arm, runs in sorted(finals.items()):
        hs = [r.get("health") or [] for r in runs]
        if not hs or not hs[0]:
            continue
        rounds = [h["round"] for h in hs[0]]
        for ax, (key, title) in zip(axes, keys):
            _band(ax, rounds, [[h[i].get(key, float("nan")) for h in hs if i < len(h)] for i in range(len(rounds))],
                  arm, alpha=0.15)
            ax.set_title(title, fontsize=9)
            ax.set_ylim(-0.02, 1.02)
            ax.set_xlabel("round")
    axes[0].legend(fontsize=7)
    fig.suptitle("Health per round of the final runs (band: min–max over seeds)", fontsize=10)
    return _save(plt, fig, dest / "powered_final_health.png")


def selection_lines(study: PoweredStudy, done: dict[str, dict[str, Any]]) -> list[str]:
    """The pre-registered choice per arm (highest validation action match) beside the lr that had the
    highest validation success, so a reader sees where the two endpoints disagree."""
    sel = study.selection()
    if sel is None:
        return []
    lines = ["Selection (pre-registered: the highest validation action match, ties by TLL) and, beside it, the "
             "run of the same arm with the highest validation success:", "",
             "| arm | chosen run | its match / success | highest-success run | its match / success |",
             "|---|---|---|---|---|"]
    disagree, lower = [], True
    for arm, ch in sel["arms"].items():
        chosen = ch["unit"].removeprefix("sweep/")
        label = chosen.rsplit("-lr", 1)[0]
        runs = {u: r for u, r in done.items() if u.rsplit("-lr", 1)[0] == label}
        top = max(runs, key=lambda u: runs[u]["eval"]["success"])
        c, t = runs[chosen]["eval"], runs[top]["eval"]
        if t["success"] > c["success"]:
            disagree.append(arm)
            lower &= float(top.rsplit("-lr", 1)[1]) < float(chosen.rsplit("-lr", 1)[1])
        lines.append(f"| {arm} | {chosen} | {c['action_match']:.3f} / {c['success']:.3f} | {top} | "
                     f"{t['action_match']:.3f} / {t['success']:.3f} |")
    lines += ["", (f"On validation, action match and success chose different learning rates for {len(disagree)} of "
                   f"{len(sel['arms'])} arms ({', '.join(disagree)})"
                   + (": in each, the higher learning rate raised the match and lowered the success." if lower
                      else ".") + " The selection stays the pre-registered one (action match, the primary "
                   "endpoint); the test panel reports both." if disagree else
                   "Action match and success chose the same learning rate for every arm."), ""]
    return lines


def render_powered(study: PoweredStudy, dest: str | Path) -> Path:
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    led = study.ledger
    lines = ["# The powered study (issue 15): what has been measured",
             "",
             "Generated by `python -m research powered report` from the units recorded under "
             "`experiments/powered/`; the design and the reading rules are "
             "[ANALYSIS_PLAN.md](ANALYSIS_PLAN.md). Only finished units appear; everything else is listed "
             "as still to run. Tiny from-scratch models on TextWorld coin routes (2 CPU cores).", ""]
    pilot = led.get("pilot")
    if pilot:
        lines += ["## Set-up (unit `pilot`)", "", "| pool | games | won | decisions | noisy decisions |",
                  "|---|---|---|---|---|"]
        for name, p in pilot["pools"].items():
            lines.append(f"| {name} | {p['games']} | {p['won']} | {p['decisions']} | {p['noisy_decisions']} |")
        lines += ["", f"Measured: games {pilot['games_seconds']:.0f} s, pools {pilot['pools_seconds']:.0f} s, "
                      f"tokenizer + student + teacher SFT {pilot['models_seconds']:.0f} s, one SAPD round "
                      f"(G = {study.cfg.group_size}) {pilot['sapd_round_seconds']:.1f} s — on a machine shared "
                      "with other jobs.", ""]
    gate = led.get("gate")
    if gate:
        sv, tv = gate["student_val"], gate["teacher_val"]
        lines += ["## Gates (unit `gate`)", "",
                  "| | well-formed at T = 1 | greedy action match | TLL | success |", "|---|---|---|---|---|",
                  f"| student | {_f(gate['student_well_formed_T1'])} | {_f(sv['action_match'])} | "
                  f"{_f(sv['tll_sum'])} | {_f(sv['success'])} |",
                  f"| teacher | – | {_f(tv['action_match'])} | {_f(tv['tll_sum'])} | {_f(tv['success'])} |", "",
                  "Passed: " + ", ".join(f"{k} {'yes' if v else '**no**'}" for k, v in gate["passed"].items()), ""]
    probes: dict[str, dict[str, Any]] = {}
    st_, te_ = study.cfg.student_shape, study.cfg.teacher_shape
    tiny = f"tiny ({st_.hidden_size}×{st_.layers} / {te_.hidden_size}×{te_.layers})"
    for n, u in ((tiny, "probe-round0"), ("SmolLM2-135M", "probe-smollm2")):
        if (p := led.get(u)) is not None:
            probes[n] = p
    figures = []
    if probes:
        lines += ["## Round-0 signal probe (no training)", "",
                  "| models | well-formed | AUC action sum | AUC action mean | AUC thought sum | AUC full-token | "
                  "corr(r, action length) | E[r \\| well-formed] | groups a malformed response tops | pairs |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        def auc(p: dict[str, Any], k: str) -> str:
            ci = p.get(f"auc_{k}_ci")
            return _f(p[f"auc_{k}"]) + (f" [{_f(ci[0])}, {_f(ci[1])}]" if ci else "")

        for n, p in probes.items():
            lines.append(f"| {n} | {_f(p['well_formed'])} | {auc(p, 'action_sum')} | {auc(p, 'action_mean')} | "
                         f"{auc(p, 'thought_sum')} | {auc(p, 'full_sum')} | {_f(p['len_corr'])} | "
                         f"{_f(p['mean_r_well_formed'])} | {_f(p['malformed_tops_group'])} | {int(p['auc_pairs'])} |")
        figures.append(probe_figure(probes, dest))
        lines += ["", "AUC: within-group, over (correct, wrong) pairs of well-formed responses; in brackets the "
                  "95 % bootstrap interval over prefixes (groups with both kinds resampled).", "",
                  f"![AUC]({figures[-1]})", ""]
    sweep = {u: led.get(u) for u, *_ in study.sweep_units()}
    done: dict[str, dict[str, Any]] = {u.removeprefix("sweep/"): r for u, r in sweep.items() if r is not None}
    lines += [f"## Validation sweep ({len(done)} of {study.sweep_size()} runs finished)", ""]
    if done:
        lines += ["| run | val action match | TLL | success | well-formed (last round) | train s | eval s |",
                  "|---|---|---|---|---|---|---|"]
        for u, r in done.items():
            ev, h = r["eval"], (r["health"] or [{}])[-1]
            lines.append(f"| {u} | {_f(ev['action_match'])} | {_f(ev['tll_sum'])} | {_f(ev['success'])} | "
                         f"{_f(h.get('well_formed'))} | {r['train_seconds']:.0f} | {ev['seconds']:.0f} |")
        figures.append(health_figure(done, dest))
        lines += ["", f"![health]({figures[-1]})", ""]
        lines += selection_lines(study, done)
    missing = [u for u, r in sweep.items() if not r]
    if missing:
        lines += ["Still to run: " + ", ".join(f"`{u}`" for u in missing) + "."
                  + (" The arms that use the chosen treatment are added once it is chosen." if
                     len(sweep) < study.sweep_size() else ""), ""]
    finals: dict[str, list[dict[str, Any]]] = {}
    for arm in study.cfg.arms:
        finals[arm] = [run for s in study.cfg.final_seeds if (run := led.get(f"final/{arm}-s{s}")) is not None]
    n_final = sum(len(v) for v in finals.values())
    n_planned = len(study.cfg.arms) * len(study.cfg.final_seeds)
    complete = n_final >= n_planned
    lines += [f"## Test panel ({n_final} of {n_planned} final runs finished)", ""]
    refs = {who: ru for who in study.REFERENCES if (ru := led.get(f"final/reference-{who}")) is not None}
    arm_stats: dict[str, dict[str, tuple[float, float]]] = {}  # arm → endpoint → (mean, sd) over its seeds
    if n_final or refs:
        lines += ["Each arm at its chosen lr (unit `selection`), mean over its seeds (± the standard deviation "
                  "between seeds); the reference rows are the student before any round and the teacher.", "",
                  "| arm | seeds | action match | TLL | success | student LL of the expert action | well-formed "
                  "(greedy) | last-round well-formed (T = 1) |", "|---|---|---|---|---|---|---|---|"]
        for who, ru in refs.items():
            ev = ru["eval"]
            lines.append(f"| *{who} (reference)* | – | {_f(ev['action_match'])} | {_f(ev['tll_sum'])} | "
                         f"{_f(ev['success'])} | {_f(ev['sll_expert'])} | {_f(ev['format_valid'])} | – |")
        for arm, runs in finals.items():
            if not runs:
                continue
            arm_stats[arm] = {key: _mean_sd([float(r["eval"][key]) for r in runs])
                              for key in ("action_match", "tll_sum", "success", "sll_expert", "format_valid")}
            cells = [f"{m:.3f} ± {sd:.3f}" if sd == sd else f"{m:.3f}" for m, sd in arm_stats[arm].values()]
            last = [h[-1].get("well_formed", float("nan")) for r in runs if (h := r.get("health"))]
            cells.append(_f(sum(last) / len(last)) if last else "–")
            lines.append(f"| {arm} | {len(runs)} | " + " | ".join(cells) + " |")
        lines.append("")
    if n_final:
        lines += power_check_lines(finals, study.cfg.power, len(study.cfg.final_seeds))
    summary: list[str] = []
    contrasts = [(q, c) for a, b, q in CONTRASTS if (c := contrast(finals, a, b)) is not None]
    if contrasts:
        lines += ["Pre-registered differences (a − b), two-level bootstrap 95 % intervals: seeds resampled within "
                  "each arm, then decisions (action match, TLL) or games (success) resampled once for both arms.",
                  "", "| contrast | seeds a / b | Δ action match | Δ TLL | Δ success |", "|---|---|---|---|---|"]
        for q, c in contrasts:
            seeds = f"{c['match']['seeds_a']} / {c['match']['seeds_b']}"
            cells = [f"{d['diff']:+.3f} [{d['lo']:+.3f}, {d['hi']:+.3f}]" for d in (c["match"], c["tll"], c["success"])]
            lines.append(f"| {q} | {seeds} | " + " | ".join(cells) + " |")
        lines.append("")
        full = {a: len(finals.get(a) or []) == len(study.cfg.final_seeds) for a in study.cfg.arms}
        c1 = contrast(finals, "sapd", "opd_rule")
        if c1 is not None:
            partial_note = "" if full["sapd"] and full["opd_rule"] else " (provisional: not every seed has finished)"
            c1_line = f"Reading of C1 by the plan's rule{partial_note}: {c1_reading(c1, study.cfg.power.match_mde)}"
            lines += [f"- {c1_line}.", ""]
            summary.insert(0, c1_line)
        cp = contrast(finals, "sapd", "sapd_paper")
        if cp is not None:
            paper_last = [h[-1].get("well_formed", 1.0) for r in finals["sapd_paper"] if (h := r.get("health"))]
            collapsed = bool(paper_last) and max(paper_last) < 0.9
            partial_note = "" if full["sapd"] and full["sapd_paper"] else " (provisional)"
            default_line = (f"The product default by the plan's rule{partial_note}: `sapd_paper` "
                            f"{'collapsed' if collapsed else 'did not collapse'} (last-round well-formed share "
                            f"{', '.join(f'{x:.2f}' for x in paper_last)}); so: {default_reading(cp, collapsed)}")
            lines += [f"- {default_line}.", ""]
            summary.append(default_line)
        figures.append(forest_figure(contrasts, dest))
        lines += [f"![differences]({figures[-1]})", ""]
    if contrasts:
        claim_section, claim_short = claims_lines(finals, probes, len(study.cfg.final_seeds),
                                                  study.cfg.power.match_mde)
        lines += claim_section
        summary += [*claim_short]
    if n_final:
        figures.append(curves_figure(finals, dest))
        lines += [f"![curves]({figures[-1]})", ""]
        figures.append(final_health_figure(finals, dest))
        lines += [f"![final health]({figures[-1]})", ""]
    else:
        lines += ["No test-panel result yet: the final runs start once the sweep is complete.", ""]
    st = study.status()
    lines += ["## Cost and what remains", "",
              f"Sweep {st['sweep']}, final {st['final']}. "
              + ("Mean recorded cost " + ", ".join(f"per {what} run {v:.0f} s" for what, v in (
                  ("sweep", st["seconds_per_run"]), ("final", st["seconds_per_final_run"])) if v)
                 + " (single-thread workers, two at a time); "
                 + ("nothing remains to run." if complete else
                    f"the remaining runs need about {st['remaining_cpu_hours']:.1f} core-hours on this machine.")
                 if st["remaining_cpu_hours"] is not None else "No run has finished yet, so no measured per-run cost."),
              "",
              f"**Measured cost{' in all' if complete else ' so far'}: {st['spent_hours']:.1f} h** "
              "— the sum of the wall times every recorded "
              "unit reports (game generation, expert pools, student and teacher SFT, the failed gate attempts, "
              "probes, every run's training and evaluation). Units ran on one or both of the machine's two "
              "cores (parallel workers used one thread each), so this is close to core-hours. It does not count "
              "rebuilding a lost cache (`.cache/powered/`, about 1 h on this machine each time)"
              + (f", nor the learning-curve evaluations of the {n_nocurve} final runs recorded before their time was "
                 "(about 6 min each per the workers' logs)" if (n_nocurve := sum(
                     1 for runs in finals.values() for r in runs if "curve_seconds" not in r)) else "") + ".", ""]
    if summary and "student" in refs:
        means = {a: (st_["action_match"][0], st_["success"][0]) for a, st_ in arm_stats.items()}
        ev0 = refs["student"]["eval"]
        summary.append(f"Descriptive, not a pre-registered comparison: the student before any round has action "
                       f"match {ev0['action_match']:.3f} and success {ev0['success']:.3f}; the arms"
                       f"{'' if complete else ' so far'} end at "
                       f"{min(m for m, _ in means.values()):.3f}–{max(m for m, _ in means.values()):.3f} match and "
                       f"{min(x for _, x in means.values()):.3f}–{max(x for _, x in means.values()):.3f} success "
                       f"(means over seeds; {sum(x > ev0['success'] for _, x in means.values())} of {len(means)} "
                       "arms above the student's success)")
    if summary:
        head = ["## In short", "",
                (f"All {n_planned} final runs are in." if complete else
                 f"{n_final} of {n_planned} final runs are in; a reading marked provisional may change as the "
                 "rest land."),
                "", *[f"- {x}." for x in summary], ""]
        at = lines.index("## Set-up (unit `pilot`)") if "## Set-up (unit `pilot`)" in lines else len(lines)
        lines[at:at] = head
    path = dest / "POWERED.md"
    path.write_text("\n".join(lines))
    return path
