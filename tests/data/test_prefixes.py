"""Prefix building (Eq. 3): what a prompt holds and never holds, filtering, split, batches, commit."""

import json

import pytest

from sapd import storage
from sapd.data import shards
from sapd.data.batches import prefix_batches, trajectory_batches
from sapd.data.prefixes import (
    PrefixOptions,
    build_prefix_rows,
    build_prefixes,
    read_prefixes,
    validation_ids,
)
from sapd.data.prompts import render_messages
from sapd.data.schema import Trajectory, Turn
from sapd.method.benchmarks import get_benchmark
from tests.tokenizer_util import SAMPLE_DATA, build_test_tokenizer


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return build_test_tokenizer(tmp_path_factory.mktemp("tok"))


def marked(n=6, tid="T", bench="alfworld"):
    """A trajectory whose every observation/action is a unique marker string, so leaks are detectable."""
    turns = [Turn(observation=f"OBS_{t}_MARK", response=f"<think>THINK_{t}</think>\n<action>ACT_{t}_MARK</action>",
                  action=f"ACT_{t}_MARK") for t in range(n)]
    return Trajectory(id=tid, benchmark=bench, task="TASK_MARK", turns=turns, final_observation="FINAL_MARK",
                      category="Pick", success=True)


@pytest.mark.parametrize("style", ["step", "chat"])
@pytest.mark.parametrize("history", [None, 0, 2])
def test_prompt_holds_history_and_never_the_decision_or_the_future(tokenizer, style, history):
    traj = marked()
    spec = get_benchmark("alfworld")
    opts = PrefixOptions(history_length=history, full_history=history is None, prompt_style=style, val_fraction=0)
    rows, stats = build_prefix_rows([traj], spec, tokenizer, opts)
    assert len(rows) == len(traj.turns) == stats.kept
    for row in rows:
        t = row["turn_index"]
        prompt = row["prompt"]
        assert "TASK_MARK" in prompt and f"OBS_{t}_MARK" in prompt
        assert prompt.endswith("<|im_start|>assistant\n")  # generation prompt from the chat template
        shown = range(t) if history is None else range(max(0, t - history), t)
        for j in range(len(traj.turns)):
            assert (f"ACT_{j}_MARK" in prompt) == (j in shown), (t, j)
            if j > t:
                assert f"OBS_{j}_MARK" not in prompt
        assert "FINAL_MARK" not in prompt and f"THINK_{t}" not in prompt
        assert row["recorded_action"] == f"ACT_{t}_MARK"
        assert row["previous_action"] == (f"ACT_{t - 1}_MARK" if t else None)
        assert row["prompt_tokens"] == len(tokenizer(prompt, add_special_tokens=False)["input_ids"])
        messages = json.loads(row["messages"])
        assert messages[-1]["role"] == "user"
        if style == "chat":  # earlier recorded responses appear as assistant turns, in order
            assert [m["role"] for m in messages] == ["user", "assistant"] * len(shown) + ["user"]


def test_step_prompt_text_matches_the_verl_agent_contract():
    traj = marked(3)
    traj.turns[2].admissible_actions = ["look", "go to desk 1"]
    (msg,) = render_messages(traj, 2, get_benchmark("alfworld"), history_length=2)
    assert msg["role"] == "user"
    assert msg["content"] == (
        "You are an expert agent operating in the ALFRED Embodied Environment. Your task is to: TASK_MARK\n"
        "Prior to this step, you have already taken 2 step(s). Below are the most recent 2 observations and the "
        "corresponding actions you took: [Observation 1: 'OBS_0_MARK', Action 1: 'ACT_0_MARK']\n"
        "[Observation 2: 'OBS_1_MARK', Action 2: 'ACT_1_MARK']\n"
        "You are now at step 3 and your current observation is: OBS_2_MARK\n"
        "Your admissible actions of the current situation are: ['look', 'go to desk 1'].\n"
        "\nNow it's your turn to take an action.\n"
        "You should first reason step-by-step about the current situation. This reasoning process MUST be "
        "enclosed within <think> </think> tags.\n"
        "Once you've finished your reasoning, you should choose an admissible action for current step and "
        "present it within <action> </action> tags.")


def test_search_prompt_shows_queries_and_their_information():
    turns = [Turn("", "<think>a</think><search> Q0 </search>", "Q0"),
             Turn("INFO_0", "<think>b</think><search> Q1 </search>", "Q1"),
             Turn("INFO_1", "<think>c</think><answer> A </answer>", "A")]
    traj = Trajectory("s", "searchqa", "QUESTION", turns)
    (msg,) = render_messages(traj, 2, get_benchmark("searchqa"), history_length=4)
    c = msg["content"]
    assert "Question: QUESTION" in c and "[Search 1: 'Q0', Information 1: INFO_0]" in c
    assert "[Search 2: 'Q1', Information 2: INFO_1]" in c and "<answer> A" not in c
    with pytest.raises(IndexError):
        render_messages(traj, 3, get_benchmark("searchqa"), 4)


def test_length_filter_counts(tokenizer):
    traj = marked(5)
    spec = get_benchmark("alfworld")
    rows, stats = build_prefix_rows([traj], spec, tokenizer, PrefixOptions(full_history=True, val_fraction=0))
    lengths = sorted(r["prompt_tokens"] for r in rows)
    limit = lengths[2]
    kept, st = build_prefix_rows([traj], spec, tokenizer,
                                 PrefixOptions(full_history=True, val_fraction=0, max_prompt_tokens=limit))
    assert st.filtered_too_long == 2 and st.kept == 3 and st.prefixes_built == 5
    assert all(r["prompt_tokens"] <= limit for r in kept)


def test_split_is_deterministic_by_trajectory():
    ids = [f"traj-{i}" for i in range(100)]
    val = validation_ids(ids, 0.05, seed=0)
    assert len(val) == 5
    assert validation_ids(list(reversed(ids)), 0.05, seed=0) == val  # input order never matters
    assert validation_ids(ids, 0.05, seed=1) != val
    assert validation_ids(ids[:1], 0.05) == set() and len(validation_ids(ids[:10], 0.05)) == 1


def test_all_prefixes_of_a_trajectory_share_its_split(tokenizer):
    trajs = [marked(3, tid=f"T{i}") for i in range(40)]
    rows, stats = build_prefix_rows(trajs, get_benchmark("alfworld"), tokenizer, PrefixOptions())
    split_of = {}
    for r in rows:
        assert split_of.setdefault(r["trajectory_id"], r["split"]) == r["split"]
    assert sum(s == "val" for s in split_of.values()) == 2 == stats.val_trajectories
    assert stats.val == 6 and stats.train == 114


def test_batches_hold_every_prefix_of_their_trajectories(tokenizer):
    import pyarrow as pa

    from sapd.data.prefixes import PREFIX_SCHEMA
    trajs = [marked(n, tid=f"T{n}") for n in range(1, 8)]
    rows, _ = build_prefix_rows(trajs, get_benchmark("alfworld"), tokenizer, PrefixOptions(val_fraction=0))
    table = pa.Table.from_pylist(rows, schema=PREFIX_SCHEMA)
    batches = prefix_batches(table, trajectories_per_batch=3, seed=0)
    assert [len(set(b.column("trajectory_id").to_pylist())) for b in batches] == [3, 3, 1]
    seen = []
    for b in batches:
        for tid in set(b.column("trajectory_id").to_pylist()):
            turns = [r["turn_index"] for r in b.to_pylist() if r["trajectory_id"] == tid]
            assert turns == list(range(int(tid[1:])))  # all of them, in order
            seen.append(tid)
    assert sorted(seen) == sorted(t.id for t in trajs)
    again = prefix_batches(table, 3, seed=0)
    assert [b.column("prefix_id").to_pylist() for b in again] == [b.column("prefix_id").to_pylist() for b in batches]
    assert trajectory_batches([t.id for t in trajs], 3, 0, epoch=1) != trajectory_batches([t.id for t in trajs], 3, 0)
    with pytest.raises(ValueError):
        trajectory_batches(["a"], 0, 0)


# --------------------------------------------------------------------------------- the committed build


def _build(out, tokenizer, **kw):
    kw.setdefault("show_progress", False)
    kw.setdefault("log", lambda s: None)
    return build_prefixes(str(SAMPLE_DATA / "alfworld_eto.json"), "eto", "alfworld", str(out), tokenizer, **kw)


def test_build_commits_and_rerun_is_a_noop(tmp_path, tokenizer):
    out = tmp_path / "prefixes"
    first = _build(out, tokenizer)
    assert not first.skipped
    train, val = read_prefixes(str(out), "train"), read_prefixes(str(out), "val")
    assert train.num_rows + val.num_rows == 42 == first.manifest["stats"]["kept"]
    assert set(train.column("trajectory_id").to_pylist()).isdisjoint(val.column("trajectory_id").to_pylist())
    mtimes = {p: p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file()}
    second = _build(out, tokenizer)
    assert second.skipped and second.manifest["build_id"] == first.manifest["build_id"]
    assert {p: p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file()} == mtimes  # nothing rewritten
    with pytest.raises(shards.ShardError, match="different committed prefix build"):
        _build(out, tokenizer, opts=PrefixOptions(history_length=1))
    third = _build(out, tokenizer, opts=PrefixOptions(history_length=1), overwrite=True)
    assert not third.skipped and third.manifest["build_id"] != first.manifest["build_id"]
    assert read_prefixes(str(out)).num_rows == train.num_rows


def test_half_written_output_is_never_read_as_complete(tmp_path, tokenizer, monkeypatch):
    out = tmp_path / "prefixes"
    real_commit = shards.commit_manifest

    def crash_on_top_level(folder, manifest):
        if manifest.get("kind") == "prefix_build":
            raise RuntimeError("killed before the commit")
        real_commit(folder, manifest)

    monkeypatch.setattr(shards, "commit_manifest", crash_on_top_level)
    with pytest.raises(RuntimeError):
        _build(out, tokenizer)
    assert (out / "train" / "part-00000.parquet").exists()  # parts landed…
    with pytest.raises(shards.ShardError, match="no committed prefix build"):
        read_prefixes(str(out))  # …but nothing is committed
    monkeypatch.setattr(shards, "commit_manifest", real_commit)
    (out / "train" / "stray-leftover.parquet").write_bytes(b"junk")
    result = _build(out, tokenizer)  # the re-run redoes the uncommitted work, clearing leftovers
    assert not result.skipped and not (out / "train" / "stray-leftover.parquet").exists()
    assert read_prefixes(str(out)).num_rows == result.manifest["stats"]["train"]


def test_damaged_part_is_detected(tmp_path, tokenizer):
    out = tmp_path / "prefixes"
    _build(out, tokenizer)
    part = out / "train" / "part-00000.parquet"
    part.write_bytes(part.read_bytes()[:-10] + b"0123456789")
    with pytest.raises(shards.ShardError, match="checksum mismatch"):
        read_prefixes(str(out))
    part.unlink()
    with pytest.raises(shards.ShardError, match="listed in _MANIFEST.json but missing"):
        read_prefixes(str(out))


def test_shards_split_into_parts_and_stripe_by_rank(tmp_path, tokenizer):
    out = tmp_path / "prefixes"
    result = _build(out, tokenizer, rows_per_part=10, opts=PrefixOptions(val_fraction=0))
    manifest = shards.read_manifest(str(out / "train"))
    assert [p["rows"] for p in manifest["parts"]] == [10, 10, 10, 10, 2]
    ranks = [read_prefixes(str(out), "train", rank=r, world_size=2) for r in range(2)]
    ids = ranks[0].column("prefix_id").to_pylist() + ranks[1].column("prefix_id").to_pylist()
    assert sorted(ids) == sorted(read_prefixes(str(out)).column("prefix_id").to_pylist())
    assert (ranks[0].num_rows, ranks[1].num_rows) == (22, 20)
    assert result.manifest["stats"]["val"] == 0
    assert read_prefixes(str(out), "val").num_rows == 0  # an empty split is still committed, with its schema
    assert "prompt" in read_prefixes(str(out), "val").schema.names


def test_build_to_and_from_s3(s3_storage, tokenizer):
    src = storage.join(s3_storage, "input", "alfworld_eto.json")
    storage.write_bytes(src, (SAMPLE_DATA / "alfworld_eto.json").read_bytes())
    out = storage.join(s3_storage, "run", "prefixes")
    result = build_prefixes(src, "eto", "alfworld", out, tokenizer, show_progress=False, log=lambda s: None)
    assert result.files == [src]
    assert read_prefixes(out).num_rows == result.manifest["stats"]["train"]
    assert build_prefixes(src, "eto", "alfworld", out, tokenizer, show_progress=False, log=lambda s: None).skipped
    names = [u.rsplit("/", 1)[-1] for u in storage.list_files(out)]
    assert sorted(names) == ["_MANIFEST.json", "_MANIFEST.json", "_MANIFEST.json",
                             "part-00000.parquet", "part-00000.parquet"]
