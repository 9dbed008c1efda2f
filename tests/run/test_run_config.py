"""The run root's committed config: a resume with a different config is refused naming the differing keys;
the number of teacher-scores workers may change between rounds (a round commits parts of one split only)."""

from __future__ import annotations

import pytest

from sapd import layout, storage
from sapd.config import ConfigError, config_from_dict, write_run_config
from sapd.data import scored


def _cfg(root, **over):
    base = {"run_root": str(root), "data": {"input": "x.jsonl"}, "train": {"lr": 1e-3, "rounds": 2}}
    for k, v in over.items():
        base[k] = {**base.get(k, {}), **v} if isinstance(v, dict) else v
    return config_from_dict(base)


def test_different_config_names_the_keys(tmp_path):
    write_run_config(_cfg(tmp_path))
    write_run_config(_cfg(tmp_path))  # the same: fine
    write_run_config(_cfg(tmp_path, workers=4))  # workers may change
    with pytest.raises(ConfigError, match=r"config\.yaml holds a different resolved config: train\.lr \(0\.001 there, "
                                          r"0\.5 here\), variant \('sapd' there, 'opd' here\); resume"):
        write_run_config(_cfg(tmp_path, train={"lr": 0.5}, variant="opd"))
    # the first config stays
    assert "lr: 0.001" in storage.read_text(layout.config_uri(str(tmp_path)))


def test_worker_parts_of_another_split_do_not_count(tmp_path):
    cfg2, cfg3 = _cfg(tmp_path, workers=2), _cfg(tmp_path, workers=3)
    out = layout.scored_dir(cfg2.run_root, 0)
    for w in range(2):
        scored.write_worker_part(out, w, [], {"sample_seconds": 1.0}, 0, workers=2)
    assert scored.workers_done(cfg2, 0) == [0, 1] and scored.workers_done(cfg3, 0) == []
    with pytest.raises(Exception, match="worker 0 of 3 has not finished"):
        scored.commit_round(cfg3, 0)
    assert scored.commit_round(cfg2, 0)["workers"] == 2


def test_rounds_may_change_under_a_constant_learning_rate(tmp_path):
    """`config.train.rounds` grows between two Helm revisions (or two `sapd run`s): the run goes on, and the
    run root's config says how many rounds it now has; every other key still may not change."""
    from sapd.config import committed_config, committed_config_problem
    write_run_config(_cfg(tmp_path))
    longer = _cfg(tmp_path, train={"rounds": 5})
    assert committed_config_problem(longer) is None
    from sapd.run.check import check_run_root  # what `sapd check` and every stage's preflight say
    assert check_run_root(longer) == ("the committed config is this one; train.rounds 2 there, 5 here: the run "
                                      "now has 5 rounds")
    write_run_config(longer)
    assert committed_config(longer).train.rounds == 5 and committed_config(longer).train.lr == 1e-3
    write_run_config(_cfg(tmp_path, train={"rounds": 5}, workers=3))  # workers still may change, too
    with pytest.raises(ConfigError, match=r"train\.lr \(0\.001 there, 0\.002 here\)"):
        write_run_config(_cfg(tmp_path, train={"rounds": 6, "lr": 2e-3}))
    assert committed_config(longer).train.rounds == 5  # a refused config writes nothing


def test_rounds_may_not_change_under_a_decaying_learning_rate(tmp_path):
    """A linear or cosine decay spans train.rounds: another count changes the rate of every round left."""
    write_run_config(_cfg(tmp_path, train={"lr_schedule": "cosine"}))
    with pytest.raises(ConfigError, match=r"train\.rounds \(2 there, 4 here\) \(train\.rounds may change only with "
                                          r"train\.lr_schedule constant: a cosine decay spans the rounds\); resume"):
        write_run_config(_cfg(tmp_path, train={"lr_schedule": "cosine", "rounds": 4}))


def test_a_local_run_extended_by_a_round_equals_an_uninterrupted_run(tmp_path):
    """`sapd run` with train.rounds 1, then again with 2: the second run continues from checkpoint 1, to the
    weights of a run that had 2 rounds from the start."""
    import torch

    from sapd import checkpoints
    from sapd.run.local import run_pipeline
    from tests.pipeline_util import make_models, tiny_config
    models = make_models(tmp_path / "models")
    quiet = dict(log=lambda s: None, show_progress=False)
    short, straight = str(tmp_path / "extended"), str(tmp_path / "straight")
    assert run_pipeline(config_from_dict(tiny_config(short, *models, train={"rounds": 1})), **quiet)["checkpoints"] == [0, 1]
    marker = checkpoints.read_marker(short, 1)
    assert run_pipeline(config_from_dict(tiny_config(short, *models)), **quiet)["checkpoints"] == [0, 1, 2]
    assert checkpoints.read_marker(short, 1) == marker  # round 0 was not redone
    assert run_pipeline(config_from_dict(tiny_config(straight, *models)), **quiet)["checkpoints"] == [0, 1, 2]
    a, b = checkpoints.load_checkpoint_model(short, 2), checkpoints.load_checkpoint_model(straight, 2)
    for (name, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters()):
        torch.testing.assert_close(pa, pb, rtol=0, atol=1e-6, msg=name)
    assert checkpoints.load_trainer_state(short, 2)["global_step"] == checkpoints.load_trainer_state(straight, 2)["global_step"]
