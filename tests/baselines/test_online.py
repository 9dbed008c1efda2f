"""The online baselines (docs/SAPD.md §4): GRPO advantages and loss by hand, and online OPD / GRPO rounds on
real TextWorld games that the unchanged training stage trains into the next checkpoint."""

from __future__ import annotations

import math

import pytest
import torch

from sapd import checkpoints, layout, storage
from sapd.baselines.online import online_config, run_online, task_reward
from sapd.config import config_from_dict
from sapd.data import shards
from sapd.data.scored import read_scored
from sapd.method.objective import LossInputs, grpo_advantages, grpo_loss, loss_config_for, loss_for, sapd_loss
from sapd.run.report import read_step_log, round_timings
from tests.pipeline_util import make_models, tiny_config

QUIET = dict(log=lambda s: None, show_progress=False)


# ------------------------------------------------------------------------------------------ pure parts


def test_grpo_advantages_by_hand():
    # R = (1, 0, 0, 0): mean 1/4, population std √(1/4 · 3/4) = √3/4 → A = (3/√3, −1/√3 × 3)
    adv = grpo_advantages(torch.tensor([[1.0, 0.0, 0.0, 0.0], [3.0, 1.0, 2.0, 2.0], [5.0, 5.0, 5.0, 5.0]]), eps=1e-12)
    assert adv[0].tolist() == pytest.approx([math.sqrt(3), -1 / math.sqrt(3), -1 / math.sqrt(3), -1 / math.sqrt(3)])
    # R = (3, 1, 2, 2): mean 2, std √(2/4) → A = (√2, −√2, 0, 0)
    assert adv[1].tolist() == pytest.approx([math.sqrt(2), -math.sqrt(2), 0.0, 0.0])
    assert adv[2].tolist() == [0.0, 0.0, 0.0, 0.0]  # all-equal rewards: no signal
    assert grpo_advantages(torch.tensor([[0.0, 0.0]])).tolist() == [[0.0, 0.0]]
    # offset and scale invariant, sums to 0 per game
    r = torch.tensor([[0.3, 1.7, -2.0]])
    assert torch.allclose(grpo_advantages(r), grpo_advantages(5.0 * r + 2.0), atol=1e-5)
    assert abs(float(grpo_advantages(r).sum())) < 1e-5


def test_grpo_loss_by_hand_and_dispatch():
    torch.manual_seed(0)
    old = -torch.rand(2, 1, 3)
    new = old.clone().requires_grad_(True)
    mask = torch.tensor([[[1, 1, 0]], [[1, 1, 1]]], dtype=torch.bool)
    adv = torch.tensor([[2.0], [-1.0]])
    loss, m = grpo_loss(new, old, mask, adv)
    # at θ = θ_old every ρ = 1: L = −mean_i(Aᵢ) = −(2 − 1)/2; ∂L/∂logp_{i,k} = −Aᵢ / (Lᵢ · P)
    assert float(loss.detach()) == pytest.approx(-0.5)
    loss.backward()
    expected = torch.tensor([[[-2.0 / 4, -2.0 / 4, 0.0]], [[1.0 / 6, 1.0 / 6, 1.0 / 6]]])
    assert torch.allclose(new.grad, expected)
    assert m["clip_fraction"] == 0.0 and math.isnan(m["teacher_student_gap"])
    zero, _ = grpo_loss(new, old, mask, torch.zeros(2, 1))
    assert float(zero.detach()) == 0.0
    # the dispatcher: GRPO for objective 'grpo', the SAPD family otherwise (identical to sapd_loss)
    # GRPO reads the rows' own advantage column, never the rule scores
    teacher, action, rules = -torch.rand(2, 1, 3), mask.clone(), torch.tensor([[0.5], [-0.5]])
    episode_adv = torch.tensor([[1.5], [-0.25]])
    def inputs(advantage=None):
        return LossInputs(new, mask, old_logp_P_G_T=old, teacher_logp_P_G_T=teacher, action_mask_P_G_T=action,
                          rule_scores_P_G=rules, advantage_P_G=advantage)

    g, _ = loss_for(loss_config_for("grpo"), inputs(episode_adv))
    assert float(g.detach()) == pytest.approx(float(grpo_loss(new, old, mask, episode_adv)[0].detach()))
    with pytest.raises(ValueError, match="precomputed advantage"):
        loss_for(loss_config_for("grpo"), inputs())
    a, _ = loss_for(loss_config_for("opd"), inputs())
    b, _ = sapd_loss(new, old, teacher, mask, action, rules, loss_config_for("opd"))
    assert float(a.detach()) == float(b.detach())


def test_online_config_and_rewards(tmp_path):
    from sapd.data.schema import Trajectory
    cfg = config_from_dict({"run_root": str(tmp_path), "data": {"benchmark": "textworld"}})
    assert online_config(cfg, "online_opd").variant == "opd"
    assert online_config(cfg, "grpo").loss_cfg.objective == "grpo"
    with pytest.raises(ValueError, match="unknown online method"):
        online_config(cfg, "ppo")
    won = Trajectory("a", "textworld", "x", [], success=True, metadata={"score": 1, "max_score": 4})
    lost = Trajectory("b", "textworld", "x", [], success=False, metadata={"score": 2, "max_score": 4})
    assert (task_reward(won), task_reward(lost)) == (1.0, 0.0)
    assert (task_reward(won, "score"), task_reward(lost, "score")) == (0.25, 0.5)
    assert task_reward(lost, lambda t: 7) == 7.0


def test_samples_are_matched_to_their_turns_when_episodes_end_early(tmp_path):
    from sapd.baselines.online import RecordingGenerator, samples_per_turn
    from sapd.data.schema import Trajectory, Turn
    from sapd.envs.base import ReplayEnv
    from sapd.envs.loop import EpisodeSpec, LoopOptions, run_episodes
    from sapd.models.generation import Sample
    from tests.tokenizer_util import build_test_tokenizer

    tok = build_test_tokenizer(tmp_path / "tok")
    recorded = [Trajectory(f"t{i}", "textworld", f"task {i}", [Turn(f"obs {i}.{j}", "", "look") for j in range(n)],
                           success=True) for i, n in enumerate([1, 3, 2])]

    class Counting:  # sample n gets token id n
        n = 0

        def generate(self, prompts, params, progress=None):
            out = []
            for _ in prompts:
                Counting.n += 1
                out.append([Sample([Counting.n], [-0.5], f"<think>{Counting.n}</think><action>look</action>", "stop")])
            return out

    rec = RecordingGenerator(Counting())
    trajs = run_episodes([EpisodeSpec(t.id, (lambda t=t: ReplayEnv(t))) for t in recorded], rec, tok, "textworld",
                         opts=LoopOptions(horizon=10))
    assert [len(t.turns) for t in trajs] == [1, 3, 2]
    per = samples_per_turn(trajs, rec.calls)
    # call 0 → samples 1, 2, 3 for t0, t1, t2; call 1 → 4, 5 for t1, t2; call 2 → 6 for t1
    assert [[s.token_ids[0] for _, s in turns] for turns in per] == [[1], [2, 4, 6], [3, 5]]
    assert all(f"task {i}" in prompt for i, turns in enumerate(per) for prompt, _ in turns)
    assert rec.seconds >= 0.0


# ------------------------------------------------------------------------------- real TextWorld rounds


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from sapd.envs.panels import textworld_specs
    tmp = tmp_path_factory.mktemp("online")
    student, teacher = make_models(tmp / "models")
    games = textworld_specs(["simple"], 2, seed=0, cache_dir=tmp / "games")
    return tmp, student, teacher, games


def _cfg(root, student, teacher):
    return config_from_dict(tiny_config(str(root), student, teacher, data={"benchmark": "textworld"},
                                        train={"rounds": 1}))


def _weights(root, k):
    model = checkpoints.load_checkpoint_model(root, k)
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _check_round(root, expected_rows):
    manifest = shards.read_manifest(layout.scored_dir(root, 0))
    assert manifest is not None and manifest["rows"] == expected_rows and manifest["rows"] > 0
    table = read_scored(root, 0)
    for r in table.to_pylist():  # one response per row, every per-token field aligned with it
        assert len(r["response_token_ids"]) == 1
        n = len(r["response_token_ids"][0])
        assert n > 0 and len(r["sampler_logprobs"][0]) == len(r["teacher_logprobs"][0]) == len(r["action_mask"][0]) == n
    assert checkpoints.is_committed(root, 1)
    steps = read_step_log(root)
    assert steps and all(math.isfinite(s["loss"]) and math.isfinite(s["grad_norm"]) for s in steps)
    timings = round_timings(root)
    assert len(timings) == 1 and timings[0]["sample_seconds"] > 0 and "score_seconds" in timings[0]
    return table, steps, timings[0]


@pytest.mark.slow
def test_online_opd_round_trains_the_next_checkpoint(setup):
    tmp, student, teacher, games = setup
    cfg = _cfg(tmp / "opd", student, teacher)
    root = cfg.run_root
    out = run_online(cfg, lambda k: games, "online_opd", horizon=3, **QUIET)
    assert out["checkpoints"] == [0, 1]
    summary = out["rounds"][0]
    assert summary["episodes"] == 2 and summary["episodes_per_game"] == 1
    episodes = storage.read_text(storage.join(layout.round_dir(root, 0), "episodes.jsonl")).splitlines()
    assert len(episodes) == 2
    table, steps, timing = _check_round(root, summary["rows"])
    assert summary["rows"] + summary["dropped_turns"] == summary["mean_steps"] * 2  # every decision is a row
    assert timing["score_seconds"] > 0 and timing["generation_seconds"] > 0
    # the teacher's log-probs, not the sampler's: a different model
    row = table.to_pylist()[0]
    assert row["teacher_logprobs"][0] != pytest.approx(row["sampler_logprobs"][0], abs=1e-3)
    assert all(s["variant"] == "opd" and s["loss_step"] == 0.0 and s["loss_rule"] == 0.0 for s in steps)
    before, after = _weights(root, 0), _weights(root, 1)
    assert any(not torch.equal(before[n], after[n]) for n in before)
    # resumable: a second run finds everything committed and changes nothing
    marker = storage.read_json(layout.checkpoint_marker(root, 1))
    again = run_online(cfg, lambda k: games, "online_opd", horizon=3, **QUIET)
    assert again["rounds"] == [] and storage.read_json(layout.checkpoint_marker(root, 1)) == marker


@pytest.mark.slow
def test_grpo_round_with_equal_rewards_makes_no_update(setup):
    tmp, student, teacher, games = setup
    cfg = _cfg(tmp / "grpo-equal", student, teacher)
    out = run_online(cfg, lambda k: games, "grpo", horizon=3, **QUIET)  # won = 1 / 0: a random model never wins
    summary = out["rounds"][0]
    assert summary["episodes"] == 4 and summary["episodes_per_game"] == 2  # G = sampling.group_size
    assert set(summary["rewards"]) == {0.0} and set(summary["advantages"]) == {0.0}
    table, steps, timing = _check_round(cfg.run_root, summary["rows"])
    assert timing["score_seconds"] == 0.0  # no teacher
    assert all(s["loss"] == 0.0 for s in steps)
    before, after = _weights(cfg.run_root, 0), _weights(cfg.run_root, 1)
    assert all(torch.equal(before[n], after[n]) for n in before)


@pytest.mark.slow
def test_grpo_round_with_different_rewards_updates(setup):
    tmp, student, teacher, games = setup
    cfg = _cfg(tmp / "grpo", student, teacher)
    length = lambda t: float(sum(len(turn.response) for turn in t.turns))  # noqa: E731 - differs per episode
    out = run_online(cfg, lambda k: games, "grpo", horizon=3, reward=length, **QUIET)
    summary = out["rounds"][0]
    adv = torch.tensor(summary["advantages"]).view(2, 2)
    assert torch.allclose(adv, grpo_advantages(torch.tensor(summary["rewards"]).view(2, 2)))
    assert adv.abs().sum() > 0
    table, steps, _ = _check_round(cfg.run_root, summary["rows"])
    # every row of an episode carries that episode's advantage, in its own column (rule scores stay rule scores)
    by_episode = {}
    for r in table.to_pylist():
        by_episode.setdefault(r["trajectory_id"], set()).add(round(r["advantage"][0], 5))
        assert r["rule_score"][0] in (0.0, -1.0, -2.0)
    assert all(len(v) == 1 for v in by_episode.values())
    assert sorted(v.pop() for v in by_episode.values()) == sorted(round(a, 5) for a in adv.view(-1).tolist())
    assert any(s["loss"] != 0.0 for s in steps)
    before, after = _weights(cfg.run_root, 0), _weights(cfg.run_root, 1)
    assert any(not torch.equal(before[n], after[n]) for n in before)


def test_offline_pipeline_refuses_grpo(tmp_path):
    from sapd.config import ConfigError
    from sapd.run.local import run_pipeline
    cfg = config_from_dict({"run_root": str(tmp_path / "r"), "variant": "grpo"})
    with pytest.raises(ConfigError, match="needs the environment"):
        run_pipeline(cfg, log=lambda s: None, show_progress=False)


@pytest.mark.slow
def test_sapd_online_command(setup, tmp_path):
    import subprocess
    import sys

    import yaml
    tmp, student, teacher, _ = setup
    cfg = tmp_path / "online.yaml"
    cfg.write_text(yaml.safe_dump(tiny_config(str(tmp_path / "run"), student, teacher, data={"benchmark": "textworld"},
                                              train={"rounds": 1})))
    res = subprocess.run([sys.executable, "-m", "sapd.cli", "online", str(cfg), "--method", "online_opd",
                          "--families", "simple", "--games-per-family", "1", "--horizon", "2",
                          "--cache", str(tmp / "games"), "--no-progress"],
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    assert checkpoints.is_committed(str(tmp_path / "run"), 1)
    assert '"method": "online_opd"' in res.stdout
