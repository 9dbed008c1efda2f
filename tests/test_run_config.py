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
