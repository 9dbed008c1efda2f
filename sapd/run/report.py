"""``sapd report RUN``: loss terms, advantage statistics and stage timings of a run, and each validated
checkpoint's distance to the teacher on held-out prefixes (:mod:`sapd.data.validation`), as PNG plots and a
small JSON summary, from the per-step logs, the round manifests and the validation results in the run root."""

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
    curve = validation_curve(root)
    fig, axes = plt.subplots(3 if curve else 2, 2, figsize=(11, 10.5 if curve else 7))
    ax = axes[0][0]
    for key in ("loss", "loss_tok", "loss_step", "loss_rule", "loss_sft"):
        if key in steps[0]:
            ax.plot(x, [r[key] for r in steps], label=key)
    ax.set_title("loss terms")
    ax.set_xlabel("optimizer step")
    ax.legend()
    ax = axes[0][1]
    for key in ("teacher_student_gap", "step_adv_abs_mean", "clip_fraction"):
        if key in steps[0]:
            ax.plot(x, [r[key] for r in steps], label=key)
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
    if curve:  # beside the loss terms: the distance they are meant to shrink, on held-out prefixes
        xs = [c["checkpoint"] for c in curve]
        ax = axes[2][0]
        for key, label in (("reverse_kl_per_token", "reverse KL(student ‖ teacher) / sampled token"),
                           ("recorded_logratio_per_token", "log π_T − log π_S / recorded token")):
            _plot_band(ax, xs, [c[key] for c in curve], label)
        ax.axhline(0.0, color="grey", lw=0.5)
        ax.set_title(f"distance to the teacher, held-out prefixes (n={curve[-1]['prefixes']}; 95 % bands)")
        ax.set_xlabel("checkpoint (= rounds trained)")
        ax.set_ylabel("nats")
        ax.legend(fontsize=8)
        ax = axes[2][1]
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
               "round_timings": rounds, "validation": curve}
    dest = out or storage.join(root, "report")
    with tempfile.TemporaryDirectory() as tmp:
        png = Path(tmp) / "training.png"
        fig.savefig(png, dpi=110)
        plt.close(fig)
        storage.write_file_from(png, storage.join(dest, "training.png"))
    storage.write_json(storage.join(dest, "summary.json"), summary)
    return [storage.join(dest, "training.png"), storage.join(dest, "summary.json")]
