"""``sapd report RUN``: loss terms, advantage statistics, stage timings and the size of each update (in the
weights the optimizer keeps) of a run, and each validated checkpoint's distance to the teacher on held-out
prefixes (:mod:`sapd.data.validation`), as PNG plots and a small JSON summary, from the per-step logs, the
round manifests and the validation results in the run root. Every ``loss`` and ``loss_*`` key the
objective logged is plotted (a new objective's terms need no edit here); the summary names the series of
each panel (``plotted``)."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

from sapd import layout, storage
from sapd.data import shards, validation


def read_step_log(root: str) -> list[dict[str, Any]]:
    records: list[dict[str, Any]] = []
    for uri in storage.list_files(storage.join(root, "logs")):
        if uri.endswith(".jsonl"):
            records.extend(json.loads(line) for line in storage.read_text(uri).splitlines() if line.strip())
    return sorted(records, key=lambda r: r["step"])


def round_timings(root: str) -> list[dict[str, Any]]:
    out = []
    for k in range(10**6):
        if not storage.exists(layout.checkpoint_marker(root, k + 1)):
            break
        m = shards.read_manifest(layout.scored_dir(root, k)) or {}
        out.append({"round": k, **m.get("timings", {}), "generated_tokens": m.get("generated_tokens", 0)})
    return out


VALIDATION_FIGURES = ("reverse_kl_per_token", "recorded_logratio_per_token", "action_match", "teacher_action_match",
                      "format_valid")


def validation_curve(root: str) -> list[dict[str, Any]]:
    """Per validated checkpoint: its headline figures (``{value, ci}``), the prefixes, and the seconds it took."""
    return [{"checkpoint": r["checkpoint"], "prefixes": r["prefixes"], "seconds": r.get("seconds", 0.0),
             **{key: r["overall"][key] for key in VALIDATION_FIGURES if key in r["overall"]}}
            for r in validation.committed(root)]


def _plot_band(ax, xs: list[int], figures: list[dict[str, Any]], label: str) -> None:
    """A figure's values against ``xs``, with its 95 % interval as a band where there is one."""
    pts = [(x, f["value"], f["ci"]) for x, f in zip(xs, figures) if f["value"] is not None]
    if not pts:
        return
    ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
    band = [p for p in pts if p[2][0] is not None]
    if band:
        ax.fill_between([p[0] for p in band], [p[2][0] for p in band], [p[2][1] for p in band], alpha=0.2)
def loss_keys(steps: list[dict[str, Any]]) -> list[str]:
    """``loss`` and every ``loss_*`` key of the step records, in the order first logged (a term a round
    added later, e.g. a regulariser turned on, is kept too).

    >>> loss_keys([{"loss": 1.0, "loss_tok": 0.5, "lr": 1e-6}, {"loss": 0.9, "loss_kl": 0.1}])
    ['loss', 'loss_tok', 'loss_kl']
    """
    keys: dict[str, None] = {}
    for rec in steps:
        for key, value in rec.items():
            if (key == "loss" or key.startswith("loss_")) and isinstance(value, (int, float)):
                keys.setdefault(key)
    return list(keys)


def round_updates(steps: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each round's update of the weights the optimizer keeps (the round's last step record carries it;
    logs written before sapd measured it have none): ‖Δw‖/‖w‖ and the share of the computed update applied."""
    return [{"round": r["round"], "step": r["step"], "update_rel": r["round_update_rel"],
             "applied_ratio": r["round_update_applied_ratio"]} for r in steps if "round_update_rel" in r]


def write_report(root: str, out: str | None = None) -> list[str]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = read_step_log(root)
    if not steps:
        raise FileNotFoundError(f"{root}: no training logs yet (logs/round-*.jsonl)")
    rounds = round_timings(root)
    for rec in steps:
        rec.setdefault("old_logp_seconds", 0.0)
    x = [r["step"] for r in steps]
    plotted: dict[str, list[str]] = {"loss terms": loss_keys(steps), "signals": []}
    curve = validation_curve(root)
    fig, axes = plt.subplots(4 if curve else 3, 2, figsize=(11, 14 if curve else 10.5))
    ax = axes[0][0]
    for key in plotted["loss terms"]:
        ax.plot(x, [r.get(key, float("nan")) for r in steps], label=key)
    ax.set_title("loss terms")
    ax.set_xlabel("optimizer step")
    ax.legend()
    ax = axes[0][1]
    for key in ("teacher_student_gap", "step_adv_abs_mean", "clip_fraction"):
        if key in steps[0]:
            ax.plot(x, [r[key] for r in steps], label=key)
            plotted["signals"].append(key)
    ax.set_title("signals")
    ax.set_xlabel("optimizer step")
    ax.legend()
    ax = axes[1][0]
    ax.plot(x, [r["step_seconds"] for r in steps], label="train step")
    ax.set_title("optimizer step time (s)")
    ax.set_xlabel("optimizer step")
    ax = axes[1][1]
    if rounds:
        rx = [r["round"] for r in rounds]
        bottom = [0.0] * len(rounds)
        for key in ("sample_seconds", "score_seconds", "masks_rules_seconds"):
            vals = [r.get(key, 0.0) for r in rounds]
            ax.bar(rx, vals, bottom=bottom, label=key.replace("_seconds", ""))
            bottom = [b + v for b, v in zip(bottom, vals)]
        train_per_round: dict[int, float] = {}
        for r in steps:
            seconds = r["step_seconds"] + r["old_logp_seconds"]
            train_per_round[r["round"]] = train_per_round.get(r["round"], 0.0) + seconds
        vals = [train_per_round.get(k, 0.0) for k in rx]
        ax.bar(rx, vals, bottom=bottom, label="train")
        ax.set_xticks(rx)
        ax.legend()
    ax.set_title("stage time per round (s)")
    ax.set_xlabel("round")
    # the update, in the weights the optimizer keeps (the fp32 master in bf16): a run whose weights do not
    # move shows here although its losses and gradient norms look normal
    updates = round_updates(steps)
    measured = [r for r in steps if "update_rel" in r]
    plotted["update"] = ["update_rel", "update_applied_ratio"] if measured else []
    ax = axes[2][0]
    if measured:
        ax.plot([r["step"] for r in measured], [r["update_rel"] for r in measured], label="per step")
        ax.plot([u["step"] for u in updates], [u["update_rel"] for u in updates], "o", label="per round")
        ax.set_yscale("log")
        ax.legend()
    ax.set_title("‖Δw‖/‖w‖ of the kept weights")
    ax.set_xlabel("optimizer step")
    ax = axes[2][1]
    if measured:
        ax.plot([r["step"] for r in measured], [r["update_applied_ratio"] for r in measured], label="per step")
        ax.plot([u["step"] for u in updates], [u["applied_ratio"] for u in updates], "o", label="per round")
        ax.axhline(0.5, color="grey", linestyle=":", label="warning below")
        ax.set_ylim(0, max(1.1, max(r["update_applied_ratio"] for r in measured) * 1.05))
        ax.legend()
    ax.set_title("update applied / update computed")
    ax.set_xlabel("optimizer step")
    if curve:  # a last row: the distance the loss terms are meant to shrink, on held-out prefixes
        xs = [c["checkpoint"] for c in curve]
        ax = axes[3][0]
        for key, label in (("reverse_kl_per_token", "reverse KL(student ‖ teacher) / sampled token"),
                           ("recorded_logratio_per_token", "log π_T − log π_S / recorded token")):
            _plot_band(ax, xs, [c[key] for c in curve], label)
        ax.axhline(0.0, color="grey", lw=0.5)
        ax.set_title(f"distance to the teacher, held-out prefixes (n={curve[-1]['prefixes']}; 95 % bands)")
        ax.set_xlabel("checkpoint (= rounds trained)")
        ax.set_ylabel("nats")
        ax.legend(fontsize=8)
        ax = axes[3][1]
        for key, label in (("action_match", "student"), ("teacher_action_match", "teacher")):
            if all(key in c for c in curve):
                _plot_band(ax, xs, [c[key] for c in curve], label)
        ax.set_title("sampled action match (T = 1), held-out prefixes")
        ax.set_xlabel("checkpoint (= rounds trained)")
        ax.set_ylim(0, 1.05)
        ax.legend(fontsize=8)
    fig.tight_layout()
    summary = {"steps": len(steps), "rounds": len(rounds), "final": {k: v for k, v in steps[-1].items()
                                                                      if isinstance(v, (int, float))},
               "round_timings": rounds, "round_updates": updates, "plotted": plotted, "validation": curve}
    dest = out or storage.join(root, "report")
    with tempfile.TemporaryDirectory() as tmp:
        png = Path(tmp) / "training.png"
        fig.savefig(png, dpi=110)
        plt.close(fig)
        storage.write_file_from(png, storage.join(dest, "training.png"))
    storage.write_json(storage.join(dest, "summary.json"), summary)
    return [storage.join(dest, "training.png"), storage.join(dest, "summary.json")]
