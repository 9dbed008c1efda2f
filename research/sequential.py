"""Sequential training across benchmarks or environment families (the paper's Table 3).

Stage i trains on task i with :func:`sapd.run.local.run_pipeline` in its own run root
``<root>/stage-<i>-<name>``, starting from stage i−1's final checkpoint (its model folder becomes the
stage's ``model.student``, i.e. checkpoint 0). After each stage its final checkpoint is evaluated on
every task learned so far (greedy, each task's fixed panel), which fills the lower-triangular
forgetting matrix ``matrix[stage][task]`` (task success; absent above the diagonal).

Everything is committed piece by piece: a stage whose run is complete is not retrained (the pipeline
resumes), an evaluation already written is reused, so an interrupted sequence resumes where it
stopped. The matrix is written as ``<root>/sequential.json`` and ``<root>/forgetting.md``.
"""

from __future__ import annotations

import copy
import re
import time
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Callable, Sequence

from sapd import layout, storage
from sapd.config import ConfigError, RunConfig, apply_overlay, config_from_dict, load_config, read_yaml_mapping
from sapd.envs.loop import summarize
from sapd.envs.panels import PanelSpec, episode_specs
from sapd.run.local import run_pipeline
from sapd.stages.evaluate import run_checkpoint_episodes, write_eval


@dataclass
class Stage:
    """One task of the sequence: ``data`` overlays the base config's ``data`` section (the task's
    trajectory pool, benchmark …), ``overlay`` any other section; ``eval_specs()`` returns the task's
    evaluation panel (:class:`~sapd.envs.base.EpisodeSpec` list) on ``eval_benchmark`` (default: the
    stage's ``data.benchmark``)."""

    name: str
    data: dict[str, Any]
    eval_specs: Callable[[], Sequence[Any]]
    eval_benchmark: str | None = None
    overlay: dict[str, Any] = field(default_factory=dict)


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict) and k != "loss":
            out[k] = _merge(out[k], v)
        else:
            out[k] = copy.deepcopy(v)
    return out


def _slug(name: str) -> str:
    s = re.sub(r"[^A-Za-z0-9._-]+", "-", name).strip("-")
    if not s:
        raise ValueError(f"stage name {name!r} has no usable characters")
    return s


def stage_root(root: str, i: int, name: str) -> str:
    return storage.join(root, f"stage-{i}-{_slug(name)}")


def stage_config(base: dict[str, Any] | RunConfig, stages: Sequence[Stage], i: int, root: str,
                 variant: str | None = None) -> RunConfig:
    """The resolved config of stage i (its student: stage i−1's final checkpoint)."""
    base_d = base.to_dict() if isinstance(base, RunConfig) else base
    st = stages[i]
    d = _merge(base_d, st.overlay)
    d = _merge(d, {"data": st.data, "run_root": stage_root(root, i, st.name)})
    if variant is not None:
        d["variant"] = variant
    if i > 0:
        prev = stage_root(root, i - 1, stages[i - 1].name)
        committed = layout.committed_checkpoints(prev)
        if not committed:
            raise RuntimeError(f"{prev}: stage {i - 1} has no committed checkpoint to start stage {i} from")
        d = _merge(d, {"model": {"student": layout.checkpoint_model_dir(prev, committed[-1])}})
    return config_from_dict(d)


def evaluate_task(run_root: str, k: int, task: str, specs: Sequence[Any], benchmark: str, *,
                  horizon: int | None = None, max_new_tokens: int = 128, device: str = "cpu",
                  env_timeout_s: float | None = None, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Greedy evaluation of checkpoint k of ``run_root`` on one task's panel, written to
    ``evals/NNNNNN/sequential-<task>.json`` (reused when there)."""

    name = f"sequential-{_slug(task)}"
    dest = storage.join(layout.evals_dir(run_root, k), f"{name}.json")
    if storage.exists(dest):
        return storage.read_json(dest)
    t0 = time.perf_counter()
    trajs, used_horizon = run_checkpoint_episodes(run_root, k, list(specs), benchmark, horizon=horizon,
                                                  max_new_tokens=max_new_tokens, device=device,
                                                  env_timeout_s=env_timeout_s)
    result = {"checkpoint": k, "task": task, "benchmark": benchmark, "episodes_ids": [t.id for t in trajs],
              "horizon": used_horizon, **summarize(trajs), "seconds": time.perf_counter() - t0}
    write_eval(run_root, k, name, result, trajs)
    log(f"{run_root} checkpoint {k}: {task} success {result['overall']['success']:.3f}")
    return result


def run_sequential(base_cfg: dict[str, Any] | RunConfig, stages: Sequence[Stage], root: str, *,
                   variant: str | None = None, horizon: int | None = None, max_new_tokens: int = 128,
                   device: str = "cpu", env_timeout_s: float | None = None, log: Callable[[str], None] = print,
                   show_progress: bool = True, engine_factory: Callable | None = None) -> dict[str, Any]:
    """Train the stages in order and fill the forgetting matrix. Returns
    ``{"variant", "stages", "tasks", "matrix": {stage: {task: success}}, "runs": {stage: {...}}}``."""

    if not stages:
        raise ValueError("run_sequential needs at least one stage")
    names = [s.name for s in stages]
    if len(set(names)) != len(names):
        raise ValueError(f"stage names must be distinct: {names}")
    matrix: dict[str, dict[str, float]] = {}
    runs: dict[str, dict[str, Any]] = {}
    panels: dict[str, Sequence[Any]] = {}
    used_variant = None
    for i, st in enumerate(stages):
        cfg = stage_config(base_cfg, stages, i, root, variant)
        used_variant = cfg.variant
        log(f"stage {i} ({st.name}): {cfg.variant} from {cfg.model.student} → {cfg.run_root}")
        t0 = time.perf_counter()
        run_pipeline(cfg, log=log, show_progress=show_progress, engine_factory=engine_factory)
        final = layout.committed_checkpoints(cfg.run_root)[-1]
        runs[st.name] = {"run_root": cfg.run_root, "final_checkpoint": final, "student": cfg.model.student,
                         "train_seconds": time.perf_counter() - t0}
        matrix[st.name] = {}
        for j in range(i + 1):
            task = stages[j]
            if task.name not in panels:
                panels[task.name] = list(task.eval_specs())
            bench = task.eval_benchmark or task.data.get("benchmark") or cfg.data.benchmark
            res = evaluate_task(cfg.run_root, final, task.name, panels[task.name], bench, horizon=horizon,
                                max_new_tokens=max_new_tokens, device=device, env_timeout_s=env_timeout_s,
                                log=log)
            matrix[st.name][task.name] = res["overall"]["success"]
    out = {"variant": used_variant, "stages": names, "tasks": names, "matrix": matrix, "runs": runs}
    storage.write_json(storage.join(root, "sequential.json"), out)
    storage.write_text(storage.join(root, "forgetting.md"), forgetting_markdown(out))
    return out


def forgetting_markdown(result: dict[str, Any]) -> str:
    """The lower-triangular matrix as a Markdown table (rows: after stage i; columns: tasks), plus each
    task's forgetting (success right after learning it minus after the last stage)."""
    tasks, stages, m = result["tasks"], result["stages"], result["matrix"]
    head = f"| after stage ({result.get('variant') or '?'}) | " + " | ".join(tasks) + " |"
    lines = [head, "|" + "---|" * (len(tasks) + 1)]
    for s in stages:
        cells = [f"{m[s][t]:.3f}" if t in m.get(s, {}) else "" for t in tasks]
        lines.append(f"| {s} | " + " | ".join(cells) + " |")
    last = stages[-1]
    forget = [f"{m[t][t] - m[last][t]:+.3f}" if t in m.get(t, {}) and t in m.get(last, {}) else ""
              for t in tasks]
    lines.append("| forgetting | " + " | ".join(forget) + " |")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------------
# a sequence described in YAML (`python -m research sequential SPEC.yaml`)

_SPEC_KEYS = {"root", "base", "variant", "horizon", "max_new_tokens", "env_timeout_s", "stages"}
_STAGE_KEYS = {"name", "data", "overlay", "eval"}


def load_sequence(path: str) -> dict[str, Any]:
    """Read a sequence file::

        root: runs/seq                    # stage runs, sequential.json and forgetting.md go here
        base: [base.yaml]                 # config overlays every stage starts from (or a mapping)
        variant: sapd                     # optional: the variant of every stage (sapd, sft, …)
        horizon: 20                       # optional: evaluation horizon (default: the benchmark's)
        max_new_tokens: 64                # optional: evaluation response cap
        env_timeout_s: 300                # optional: environment calls that hang longer are killed
        stages:
          - name: coin
            data: {input: pools/coin.jsonl, format: native, benchmark: textworld}
            overlay: {model: {teacher: teachers/coin}}      # optional: any other config section
            eval: {benchmark: textworld, families: [coin_near], games_per_family: 8, seed: 1000}

    Relative paths in ``base`` are read from the file's folder. ``eval`` takes the fields of
    :class:`sapd.envs.panels.PanelSpec`. Every unknown key is an error naming the file and the key.
    Returns ``{"base": dict, "stages": [Stage], "root", "variant", "horizon", "max_new_tokens",
    "env_timeout_s"}``."""
    p = Path(path)
    spec = read_yaml_mapping(p)
    unknown = set(spec) - _SPEC_KEYS
    if unknown:
        raise ConfigError(f"{p}: unknown key(s) {sorted(unknown)}; expected some of {sorted(_SPEC_KEYS)}")
    for key in ("root", "stages"):
        if key not in spec:
            raise ConfigError(f"{p}: missing '{key}'")
    base = spec.get("base") or {}
    if isinstance(base, str):
        base = [base]
    if isinstance(base, list):
        paths = [str(p.parent / b) if (p.parent / b).is_file() else b for b in base]
        try:
            base = load_config(*paths).to_dict()
        except ConfigError as e:
            raise ConfigError(f"{p}: base: {e}") from None
    elif not isinstance(base, dict):
        raise ConfigError(f"{p}: base: expected a list of config files or a mapping")
    stages = []
    if not isinstance(spec["stages"], list) or not spec["stages"]:
        raise ConfigError(f"{p}: stages: expected a non-empty list")
    for i, st in enumerate(spec["stages"]):
        where = f"{p}: stages[{i}]"
        if not isinstance(st, dict):
            raise ConfigError(f"{where}: expected a mapping")
        if set(st) - _STAGE_KEYS:
            raise ConfigError(f"{where}: unknown key(s) {sorted(set(st) - _STAGE_KEYS)}; expected some of "
                              f"{sorted(_STAGE_KEYS)}")
        for key in ("name", "data", "eval"):
            if key not in st:
                raise ConfigError(f"{where}: missing '{key}'")
        ev = dict(st["eval"])
        bench = ev.pop("benchmark", None) or st["data"].get("benchmark") or base.get("data", {}).get("benchmark")
        panel = PanelSpec(benchmark=bench)
        try:
            apply_overlay(panel, ev, "eval.")
        except ConfigError as e:
            raise ConfigError(f"{where}.{e}") from None
        stages.append(Stage(str(st["name"]), dict(st["data"]),
                            eval_specs=partial(episode_specs, panel),
                            eval_benchmark=bench, overlay=dict(st.get("overlay") or {})))
    return {"base": base, "stages": stages, "root": str(spec["root"]), "variant": spec.get("variant"),
            "horizon": spec.get("horizon"), "max_new_tokens": int(spec.get("max_new_tokens", 128)),
            "env_timeout_s": spec.get("env_timeout_s")}
