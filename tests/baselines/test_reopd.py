"""ReOPD: the step-decaying prefix sampler (exact single-draw law, empirical turn distribution ∝ κ^t,
κ = 1 uniform, determinism, no replacement), its round batch, and teacher-generated pools."""

import doctest
import math
from collections import Counter

import pyarrow as pa
import pytest

import sapd.baselines.reopd as reopd
from sapd.data.batches import prefixes_per_round, reopd_probabilities, reopd_sample


def rows(n_traj=3, turns=5):
    return [{"prefix_id": f"t{i}#{t}", "trajectory_id": f"t{i}", "turn_index": t}
            for i in range(n_traj) for t in range(turns)]


def test_doctests():
    assert doctest.testmod(reopd).failed == 0


def test_single_draw_probabilities_are_kappa_powers():
    p = reopd_probabilities(rows(1, 4), kappa=0.6)
    z = 1 + 0.6 + 0.36 + 0.216
    assert p == pytest.approx([1 / z, 0.6 / z, 0.36 / z, 0.216 / z])
    assert reopd_probabilities(rows(2, 3), kappa=1.0) == pytest.approx([1 / 6] * 6)
    # long trajectories never underflow to 0/0
    deep = [{"prefix_id": f"x#{t}", "turn_index": t} for t in (0, 5000)]
    assert reopd_probabilities(deep, 0.6) == pytest.approx([1.0, 0.0])


@pytest.mark.parametrize("kappa", [0.6, 1.0])
def test_empirical_turn_distribution_follows_kappa_t(kappa):
    data, turns, draws = rows(3, 5), 5, 6000
    counts = Counter(reopd_sample(data, 1, kappa, seed=s)[0]["turn_index"] for s in range(draws))
    z = sum(kappa ** t for t in range(turns))
    expected = [draws * kappa ** t / z for t in range(turns)]
    chi2 = sum((counts[t] - e) ** 2 / e for t, e in enumerate(expected))
    assert chi2 < 18.47  # χ²(4 dof) at p = 0.001: a fixed-seed check, not flaky
    if kappa == 1.0:
        assert all(abs(counts[t] / draws - 0.2) < 0.03 for t in range(turns))  # uniform


def test_without_replacement_deterministic_and_order_free():
    data = rows(4, 6)
    a = reopd_sample(data, 10, 0.6, seed=3)
    assert len(a) == 10 and len({r["prefix_id"] for r in a}) == 10
    assert a == reopd_sample(list(reversed(data)), 10, 0.6, seed=3)  # input order never matters
    assert a != reopd_sample(data, 10, 0.6, seed=4)
    assert len(reopd_sample(data, 100, 0.6, seed=0)) == len(data)  # n larger than the pool: all of it
    # early turns dominate: in 10 of 24 draws at κ=0.6, turn 0 is (almost) always present
    assert sum(r["turn_index"] == 0 for r in a) >= sum(r["turn_index"] == 5 for r in a)
    with pytest.raises(ValueError, match="kappa"):
        reopd_sample(data, 1, 0.0)


def test_inclusion_frequency_matches_sequential_sampling_exactly():
    # two prefixes per trajectory... small case: 3 prefixes at turns 0,1,2, draw 2; P(turn 2 excluded)
    data = rows(1, 3)
    w = [1.0, 0.6, 0.36]
    z = sum(w)
    # P(exclude i) = Σ_{j≠i} P(first j) P(second ≠ i | first j) = Σ_{j≠i} w_j/z · w_k/(z-w_j), k the third
    def p_excl(i):
        return sum(w[j] / z * w[3 - i - j] / (z - w[j]) for j in range(3) if j != i)
    draws = 6000
    excluded = Counter()
    for s in range(draws):
        chosen = {r["turn_index"] for r in reopd_sample(data, 2, 0.6, seed=s)}
        excluded[({0, 1, 2} - chosen).pop()] += 1
    for i in range(3):
        assert abs(excluded[i] / draws - p_excl(i)) < 4 * math.sqrt(p_excl(i) * (1 - p_excl(i)) / draws)


def test_table_in_table_out():
    table = pa.Table.from_pylist(rows(2, 4))
    out = reopd_sample(table, 3, seed=1)
    assert isinstance(out, pa.Table) and out.num_rows == 3
    assert out.to_pylist() == reopd_sample(rows(2, 4), 3, seed=1)
    assert prefixes_per_round(table, 1) == 4 and prefixes_per_round(table, 16) == 8


@pytest.mark.slow
def test_teacher_pool_builds_prefixes_and_a_reopd_round(tmp_path):
    from types import SimpleNamespace

    from sapd import layout
    from sapd.baselines.reopd import teacher_pool
    from sapd.data.batches import reopd_round_batch
    from sapd.data.loaders import LoadOptions, load_trajectories
    from sapd.data.prefixes import PrefixOptions, build_prefixes
    from sapd.envs.panels import textworld_specs
    from sapd.models.loading import load_tokenizer
    from tests.pipeline_util import make_models

    _, teacher = make_models(tmp_path / "models")
    specs = textworld_specs(["simple"], 1, 0, tmp_path / "games")
    out = tmp_path / "pool.jsonl"
    kw = dict(samples_per_spec=2, seed=5, max_new_tokens=16, horizon=3)
    trajs = teacher_pool(teacher, specs, str(out), **kw)
    assert [t.id for t in trajs] == [f"{specs[0].id}/sample-0", f"{specs[0].id}/sample-1"]
    assert all(t.metadata["policy"] == "teacher" and 1 <= len(t.turns) <= 3 for t in trajs)
    again = teacher_pool(teacher, specs, None, **kw)
    assert [t.to_dict() for t in again] == [t.to_dict() for t in trajs]  # seeded
    loaded = load_trajectories(str(out), "native", LoadOptions("textworld")).trajectories
    assert len(loaded) == 2
    root = tmp_path / "run"
    build_prefixes(str(out), "native", "textworld", layout.prefixes_dir(str(root)), load_tokenizer(teacher),
                   opts=PrefixOptions(val_fraction=0.0, max_prompt_tokens=None), log=lambda s: None,
                   show_progress=False)
    cfg = SimpleNamespace(run_root=str(root), data=SimpleNamespace(reopd_kappa=0.6),
                          train=SimpleNamespace(seed=0, trajectories_per_round=1))
    from sapd.data.prefixes import read_prefixes
    full = read_prefixes(layout.prefixes_dir(str(root)), "train")
    b0 = reopd_round_batch(cfg, 0)
    assert b0.num_rows == prefixes_per_round(full, 1) == round(full.num_rows / 2)
    assert set(b0.column("prefix_id").to_pylist()) <= set(full.column("prefix_id").to_pylist())
    assert reopd_round_batch(cfg, 0).to_pylist() == b0.to_pylist()  # a rerun of round 0 draws the same batch
