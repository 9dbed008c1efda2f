"""The online baselines of docs/SAPD.md §4 — they need the environment, by design.

An online round k: checkpoint k plays episodes in the live environment (the multi-turn agent loop,
sampling at ``sampling.temperature``), and every decision of every episode becomes one row of the
**same scored format** the teacher-scores stage writes (:mod:`sapd.data.scored`, one response per row,
G = 1), committed as ``rounds/k/scored/`` by the same writer, so :func:`sapd.stages.train.run_train_stage`
trains on it unchanged (π_old recomputed, minibatches, engine, checkpoint k+1).

- **online OPD** (``method="online_opd"``, loss variant ``opd``): the frozen teacher scores the
  sampled tokens of every turn (:func:`sapd.models.scoring.score_groups`); action masks and rule
  scores as precompute computes them; trained with the token-level loss only. With one response per
  row the step and rule advantages would be 0 anyway; the variant makes it explicit.
- **GRPO** (``method="grpo"``, loss variant ``grpo``): ``episodes_per_game`` (default
  ``sampling.group_size``) sampled episodes of the same game; the task reward Rₑ of each episode
  (won = 1, else 0; or the normalised score, or any callable) gives the group-relative advantage
  :func:`sapd.method.objective.grpo_advantages` over the game's episodes, applied to every token of every
  response of that episode (:func:`sapd.method.objective.grpo_loss`). The advantage is precomputed here and
  stored in the row's ``advantage`` column; teacher log-probs hold the sampler's (no teacher is loaded
  or used).

Each round's manifest carries the stage timings the teacher-scores stage logs — ``sample_seconds`` (environment
rollouts including generation; ``generation_seconds`` of it inside the generator), ``score_seconds``
(teacher; 0 for GRPO), ``masks_rules_seconds`` — so :func:`sapd.run.report.round_timings` compares
per-step time with SAPD side by side. The episodes are kept as native JSONL beside the round
(``rounds/k/episodes.jsonl``) with a summary (``rounds/k/online.json``: success, rewards, advantages).

Resumable like :func:`sapd.run.local.run_pipeline`: a committed checkpoint k+1 skips round k, a
committed scored round skips the rollouts, and rollouts are seeded by (seed, k), so a redone round is
the same round.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import time
from typing import Any, Callable, Literal, Sequence

import torch
from tqdm import tqdm

from sapd import checkpoints, layout, storage
from sapd.config import RunConfig, write_run_config
from sapd.data import scored
from sapd.data.prompts import PrefixOptions
from sapd.data.schema import Trajectory
from sapd.engines.base import EngineFactory
from sapd.envs.base import EpisodeSpec
from sapd.envs.loop import LoopOptions, run_episodes
from sapd.method.benchmarks import get_benchmark, noop_action
from sapd.method.objective import grpo_advantages
from sapd.method.rules import RuleWeights
from sapd.models.generation import Sample, SamplingParams, stops_for
from sapd.models.loading import check_same_tokenizer, load_tokenizer
from sapd.stages.build_prefixes import ensure_initial_checkpoint
from sapd.stages.teacher_scores import TeacherScorer, release_student, student_generator, teacher_scorer
from sapd.stages.train import run_train_stage

METHOD_VARIANT: dict[str, str] = {"online_opd": "opd", "grpo": "grpo"}
Reward = Literal["won", "score"] | Callable[[Trajectory], float]


def online_config(cfg: RunConfig, method: str) -> RunConfig:
    """The run config an online method trains with: its loss variant (``cfg.loss`` overrides kept) and
    one rollout worker."""
    if method not in METHOD_VARIANT:
        raise ValueError(f"unknown online method {method!r}; expected one of {sorted(METHOD_VARIANT)}")
    return dataclasses.replace(cfg, variant=METHOD_VARIANT[method], workers=1)


def task_reward(traj: Trajectory, reward: Reward = "won") -> float:
    """Rₑ of one episode: 1 if won else 0 (``"won"``), the final score over the max score (``"score"``),
    or ``reward(traj)``."""
    if callable(reward):
        return float(reward(traj))
    if reward == "won":
        return 1.0 if traj.success else 0.0
    if reward == "score":
        score, top = traj.metadata.get("score"), traj.metadata.get("max_score")
        if score is not None and top:
            return float(score) / float(top)
        return 1.0 if traj.success else 0.0
    raise ValueError(f"unknown reward {reward!r}; expected 'won', 'score' or a callable")


# ---------------------------------------------------------------------------------------------------
# rollouts with every sample kept


class RecordingGenerator:
    """Wraps a Generator and keeps every call's prompts and samples (token ids, sampler log-probs),
    which the agent loop's trajectories (text only) do not carry. Also times the generator."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.calls: list[tuple[list[str], list[list[Sample]]]] = []
        self.seconds = 0.0

    def generate(self, prompts: Sequence[str], params: SamplingParams, progress=None) -> list[list[Sample]]:
        t0 = time.perf_counter()
        outs = self.inner.generate(prompts, params, progress)
        self.seconds += time.perf_counter() - t0
        self.calls.append((list(prompts), outs))
        return outs


def samples_per_turn(trajs: Sequence[Trajectory], calls: list[tuple[list[str], list[list[Sample]]]]
                     ) -> list[list[tuple[str, Sample]]]:
    """(prompt, sample) of every turn of every episode. The agent loop makes call s over the episodes
    still live at step s, in order, and each of them then records turn s — so the episodes live at
    call s are exactly those with more than s turns. Checked against the recorded response texts."""
    out: list[list[tuple[str, Sample]]] = [[] for _ in trajs]
    for s, (prompts, samples) in enumerate(calls):
        live = [i for i, t in enumerate(trajs) if len(t.turns) > s]
        if len(live) != len(prompts):
            raise RuntimeError(f"generator call {s}: {len(prompts)} prompts for {len(live)} episodes with a turn {s}")
        for i, prompt, group in zip(live, prompts, samples):
            if group[0].text != trajs[i].turns[s].response:
                raise RuntimeError(f"episode {trajs[i].id} turn {s}: recorded response differs from the sample")
            out[i].append((prompt, group[0]))
    if any(len(o) != len(t.turns) for o, t in zip(out, trajs)):
        raise RuntimeError("some recorded turns have no generator sample")
    return out


def _seed(seed: int, k: int) -> int:
    return int.from_bytes(hashlib.sha256(f"online:{seed}:{k}".encode()).digest()[:4], "little")


def _episode_specs(games: Sequence[EpisodeSpec], k: int, per_game: int) -> list[EpisodeSpec]:
    return [EpisodeSpec(f"{g.id}@r{k}e{j}", g.make_env, seed=g.seed, category=g.category, prepare=g.prepare)
            for g in games for j in range(per_game)]


def online_round(cfg: RunConfig, k: int, games: Sequence[EpisodeSpec], method: str, tokenizer, *,
                 generator=None, teacher: TeacherScorer | None = None, episodes_per_game: int | None = None,
                 horizon: int | None = None, reward: Reward = "won", env_timeout_s: float | None = None,
                 log: Callable[[str], None] = print, show_progress: bool = True) -> dict[str, Any]:
    """Roll out checkpoint k on ``games``, turn every decision into a scored row, commit round k.
    ``cfg`` is the :func:`online_config` one. Returns the round's summary (also ``rounds/k/online.json``)."""
    out_dir = layout.scored_dir(cfg.run_root, k)
    summary_uri = storage.join(layout.round_dir(cfg.run_root, k), "online.json")
    if scored.is_committed(cfg.run_root, k):
        log(f"online round {k}: already committed")
        return storage.read_json(summary_uri)
    if storage.exists(scored.worker_done_marker(out_dir, 0)):
        scored.commit_round(cfg, k)
        return storage.read_json(summary_uri)
    spec = get_benchmark(cfg.data.benchmark)
    per_game = episodes_per_game or (cfg.sampling.group_size if method == "grpo" else 1)
    if method == "grpo" and per_game < 2:
        raise ValueError("GRPO needs at least 2 episodes per game (its advantages are group-relative)")
    if method == "online_opd" and teacher is None:
        raise ValueError("online OPD needs a teacher scorer")
    episode_specs = _episode_specs(games, k, per_game)
    d = cfg.data
    opts = LoopOptions(prompt=PrefixOptions(history_length=d.history_length, full_history=d.full_history,
                                            prompt_style=d.prompt_style), horizon=horizon,
                       invalid_action=noop_action(spec.name), env_timeout_s=env_timeout_s,
                       max_live_episodes=None)  # all at once: samples_per_turn relies on it
    params = SamplingParams(n=1, temperature=cfg.sampling.temperature, top_p=cfg.sampling.top_p,
                            max_new_tokens=cfg.sampling.max_new_tokens, stop=stops_for(spec.decision),
                            seed=_seed(cfg.train.seed, k))
    recorder = RecordingGenerator(generator if generator is not None else student_generator(cfg, k, tokenizer))
    timings: dict[str, float] = {}
    log(f"online round {k} ({method}): {len(games)} games × {per_game} episodes")
    t0 = time.perf_counter()
    with tqdm(total=len(episode_specs), desc=f"round {k} rollouts", unit="episode",
              disable=None if show_progress else True, leave=False) as bar:
        trajs = run_episodes(episode_specs, recorder, tokenizer, spec, params, opts, progress=bar.update)
    timings["sample_seconds"] = time.perf_counter() - t0
    timings["generation_seconds"] = recorder.seconds
    per_turn = samples_per_turn(trajs, recorder.calls)

    rewards = [task_reward(t, reward) for t in trajs]
    advantages = [0.0] * len(trajs)
    if method == "grpo":
        adv_P_G = grpo_advantages(torch.tensor(rewards).view(len(games), per_game), eps=cfg.loss_cfg.eps)
        advantages = adv_P_G.view(-1).tolist()

    # rows: one per decision; prompts over the length filter are dropped (counted), as the prefix builder does
    limit = cfg.data.max_prompt_tokens
    items, dropped = [], 0
    for e, turns in enumerate(per_turn):
        for t, (prompt, sample) in enumerate(turns):
            pids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
            if (limit is not None and len(pids) > limit) or not sample.token_ids:
                dropped += 1
                continue
            items.append((e, t, pids, sample))

    t0 = time.perf_counter()
    if method == "online_opd":
        assert teacher is not None
        groups = [(f"{trajs[e].id}/{t}", pids, [s.token_ids]) for e, t, pids, s in items]
        with tqdm(total=len(groups), desc=f"round {k} teacher", unit="turn",
                  disable=None if show_progress else True, leave=False) as bar:
            teacher_logp = teacher(groups, progress=bar.update)
    else:
        teacher_logp = [[s.logprobs] for _, _, _, s in items]  # unused by the GRPO loss
    timings["score_seconds"] = time.perf_counter() - t0 if method == "online_opd" else 0.0

    t0 = time.perf_counter()
    weights = RuleWeights(cfg.rules.format_weight, cfg.rules.repetition_weight)
    rows = []
    for (e, t, pids, s), t_logp in zip(items, teacher_logp):
        traj = trajs[e]
        prefix = {"prefix_id": f"{traj.id}/{t}", "trajectory_id": traj.id, "turn_index": t, "benchmark": spec.name,
                  "category": traj.category, "previous_action": traj.turns[t - 1].action if t > 0 else None,
                  "recorded_action": traj.turns[t].action}
        rows.append(scored.scored_row(prefix, pids, [s], t_logp, tokenizer, spec, weights,
                                      [advantages[e]] if method == "grpo" else None))
    timings["masks_rules_seconds"] = time.perf_counter() - t0

    round_dir = layout.round_dir(cfg.run_root, k)
    storage.write_text(storage.join(round_dir, "episodes.jsonl"),
                       "".join(json.dumps(tr.to_dict(), sort_keys=True) + "\n" for tr in trajs))
    n_tokens = sum(len(r["response_token_ids"][0]) for r in rows)
    summary = {"round": k, "method": method, "games": [g.id for g in games], "episodes_per_game": per_game,
               "episodes": len(trajs), "success": sum(bool(tr.success) for tr in trajs) / max(len(trajs), 1),
               "rewards": rewards, "advantages": advantages, "rows": len(rows), "dropped_turns": dropped,
               "mean_steps": sum(len(tr.turns) for tr in trajs) / max(len(trajs), 1),
               "invalid_steps": sum(int(tr.metadata.get("invalid_steps", 0)) for tr in trajs),
               "timings": timings, "generated_tokens": n_tokens}
    storage.write_json(summary_uri, summary)
    scored.write_worker_part(out_dir, 0, rows, timings, n_tokens)
    scored.commit_round(cfg, k)
    log(f"online round {k} ({method}): {len(trajs)} episodes, success {summary['success']:.2f}, "
        f"{len(rows)} rows ({dropped} dropped), rollouts {timings['sample_seconds']:.1f}s "
        f"(generation {timings['generation_seconds']:.1f}s), teacher {timings['score_seconds']:.1f}s")
    if not rows:
        log(f"online round {k}: no rows to train on (every turn dropped)")
    return summary


# ---------------------------------------------------------------------------------------------------
# the run


def cycling_games(panel: Sequence[EpisodeSpec], games_per_round: int) -> Callable[[int], list[EpisodeSpec]]:
    """A ``specs_factory``: round k plays the next ``games_per_round`` games of ``panel``, wrapping around.

    >>> f = cycling_games(["a", "b", "c"], 2)
    >>> [f(k) for k in range(3)]
    [['a', 'b'], ['c', 'a'], ['b', 'c']]
    """
    if not panel or games_per_round < 1:
        raise ValueError("cycling_games needs a non-empty panel and games_per_round >= 1")
    return lambda k: [panel[(k * games_per_round + i) % len(panel)] for i in range(games_per_round)]


def run_online(cfg: RunConfig, specs_factory: Callable[[int], Sequence[EpisodeSpec]], method: str,
               rounds: int | None = None, *, episodes_per_game: int | None = None, horizon: int | None = None,
               reward: Reward = "won", engine_factory: EngineFactory | None = None,
               env_timeout_s: float | None = None,
               log: Callable[[str], None] = print, show_progress: bool = True) -> dict[str, Any]:
    """Run (or resume) ``rounds`` (default ``train.rounds``) online rounds of rollout → train.
    ``specs_factory(k)`` gives the games of round k (e.g. a slice of the TextWorld panel)."""
    cfg = online_config(cfg, method)
    root = cfg.run_root
    write_run_config(cfg)
    tokenizer = load_tokenizer(cfg.model.student)
    if method == "online_opd":
        check_same_tokenizer(tokenizer, load_tokenizer(cfg.model.teacher))
    ensure_initial_checkpoint(cfg, log)
    scorer = None
    student = None  # one student engine for the whole run, new weights in place each round
    summaries = []
    for k in range(cfg.train.rounds if rounds is None else rounds):
        if checkpoints.is_committed(root, k + 1):
            continue
        if not scored.is_committed(root, k):
            if method == "online_opd" and scorer is None:
                scorer = teacher_scorer(cfg, tokenizer)
            student = student_generator(cfg, k, tokenizer, reuse=student)
            summaries.append(online_round(cfg, k, list(specs_factory(k)), method, tokenizer, generator=student,
                                          teacher=scorer,
                                          episodes_per_game=episodes_per_game, horizon=horizon, reward=reward,
                                          env_timeout_s=env_timeout_s, log=log, show_progress=show_progress))
            release_student(student)  # the engine stays up; training gets the device
        run_train_stage(cfg, k, engine_factory=engine_factory, log=log, show_progress=show_progress)
        log(f"online round {k}: checkpoint {k + 1} committed")
    return {"run_root": root, "method": method, "checkpoints": layout.committed_checkpoints(root),
            "rounds": summaries}
