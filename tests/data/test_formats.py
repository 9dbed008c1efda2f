"""Input-format details not tied to one real file: auto-detection over a folder, message keys spelled
two ways, rewards, report counting, streamed shards, and the mode of written files."""

import json
import os

import pyarrow.parquet as pq
import pytest

from sapd import storage
from sapd.data import shards
from sapd.data.errors import InvalidRecordError, InvalidReport
from sapd.data.loaders import LoadOptions, load_trajectories
from sapd.data.prefixes import PREFIX_SCHEMA, PrefixOptions, build_prefix_rows, build_prefixes, read_prefixes
from sapd.method.benchmarks import get_benchmark
from tests.tokenizer_util import SAMPLE_DATA, build_test_tokenizer

TASK_OBS = "You are in a room.\n\nYour task is to: put a mug in fridge."


def conv(*pairs, key=("from", "value")):
    return [{key[0]: r, key[1]: v} for r, v in pairs]


def rec(rid="t1", **extra):
    return {"id": rid, "conversations": conv(("human", TASK_OBS), ("gpt", "Thought: go.\nAction: go to fridge 1"),
                                             ("human", "Observation: The fridge 1 is closed.")), **extra}


def load(path, fmt="eto", bench="alfworld", **kw):
    return load_trajectories(str(path), fmt, LoadOptions(bench, **kw))


def write(tmp_path, name, obj):
    p = tmp_path / name
    p.write_text(json.dumps(obj), encoding="utf-8")
    return p


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return build_test_tokenizer(tmp_path_factory.mktemp("tok"))


def test_auto_detects_each_file_of_a_folder(tmp_path):
    write(tmp_path, "a.json", [rec("a")])
    (tmp_path / "b.jsonl").write_text(json.dumps({"messages": conv(("user", "Question: who?"),
                                                                    ("assistant", "Thought: t\nAction: finish[Me]"))})
                                      + "\n", encoding="utf-8")
    res = load(tmp_path, "auto", "alfworld", skip_invalid=True)
    assert res.formats == {str(tmp_path / "a.json"): "eto", str(tmp_path / "b.jsonl"): "fireact"}
    assert res.format_summary() == ("auto → eto (records have 'id' and 'conversations'), fireact (records have "
                                    "'messages' and no 'id')")
    assert [t.id for t in res.trajectories] == ["a"] and res.report.counts == {"missing_task": 1}
    # the FireAct line read as search QA: its id is the line, the answer the action
    (t,) = load(tmp_path / "b.jsonl", "auto", "searchqa").trajectories
    assert (t.id, t.task, t.turns[0].action, t.turns[0].response) == (
        "b:L1", "who?", "Me", "<think>t</think>\n<answer>Me</answer>")


def test_message_keys_spelled_both_ways(tmp_path):
    r = rec()
    r["conversations"][1] = {"from": "gpt", "role": "assistant", "value": "Action: go to fridge 1"}  # agree
    r2 = rec("t2")
    r2["conversations"][1] = {"from": "gpt", "role": "user", "value": "Action: go to fridge 1"}  # disagree
    res = load(write(tmp_path, "x.json", [r, r2]), skip_invalid=True)
    assert [t.id for t in res.trajectories] == ["t1"]
    assert "field conversations[1]: 'from' and 'role' disagree ('gpt' vs 'user'); keep one of them" in \
        res.report.examples["conflicting_fields"][0]


@pytest.mark.parametrize("reward,success,reason", [
    (1, True, None), (0.5, False, None), ("0.5", False, None), ("great", None, "bad_type"), ([1], None, "bad_type")])
def test_rewards(tmp_path, reward, success, reason):
    path = write(tmp_path, "x.json", [rec(reward=reward)])
    if reason:
        with pytest.raises(InvalidRecordError, match=r"field reward: expected a number") as ei:
            load(path)
        assert ei.value.reason == reason
    else:
        (t,) = load(path).trajectories
        assert t.success is success and t.metadata["reward"] == reward


def test_tagged_response_is_checked_by_the_projection(tmp_path):
    r = rec()
    r["conversations"][1]["value"] = "<action>go to fridge 1</action>"  # no <think> block: verl-agent marks it invalid
    e = pytest.raises(InvalidRecordError, load, write(tmp_path, "x.json", [r])).value
    assert (e.field, e.reason) == ("conversations[1].value", "invalid_response")
    assert "not a valid alfworld decision (missing <think>…</think>" in str(e)
    r["conversations"][1]["value"] = "<think>a</think><action>put mug 1 in/on fridge 1</action>"
    (t,) = load(write(tmp_path, "y.json", [r]), action_wording="move").trajectories
    assert t.turns[0].response == "<think>a</think><action>move mug 1 to fridge 1</action>"
    assert t.turns[0].action == "move mug 1 to fridge 1"


def test_report_counts_records_and_says_how_many_more():
    report = InvalidReport()
    for n in range(5):
        report.add(InvalidRecordError("f.jsonl", f"line {n + 1}", "output", "empty_action", "no action"), records=2)
    assert report.total == 10 and report.more("empty_action") == 2
    assert report.lines() == ["  empty_action: 10 records in 5 errors"] + [
        f"    e.g. f.jsonl: line {n}: field output: no action [empty_action]" for n in (1, 2, 3)] + ["    (2 more)"]


def test_skillrl_counts_add_up_when_everything_is_refused(tmp_path):
    """The old summary said "12 invalid" of 57 records; now each refused trajectory counts its lines."""
    lines = (SAMPLE_DATA / "alfworld_skillrl.jsonl").read_text().splitlines()
    path = tmp_path / "s.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    res = load(path, "skillrl", "webshop", skip_invalid=True)  # ALFWorld prompts read as WebShop
    assert res.records_read == 7 and res.valid_records == 0 and res.report.total == 7
    assert res.report.counts == {"benchmark_mismatch": 7}


def test_shard_writer_writes_what_write_shards_writes(tmp_path):
    import pyarrow as pa
    rows = [{"prefix_id": f"t#{i}", "trajectory_id": "t", "turn_index": i, "num_turns": 7, "benchmark": "alfworld",
             "category": None, "task": "x", "messages": "[]", "prompt": "p", "prompt_tokens": 1,
             "recorded_response": "r", "recorded_action": "a", "previous_action": None, "success": None,
             "split": "train"} for i in range(7)]
    a = shards.write_shards(str(tmp_path / "a"), pa.Table.from_pylist(rows, schema=PREFIX_SCHEMA), kind="k",
                            schema_version=1, rows_per_part=3)
    w = shards.ShardWriter(str(tmp_path / "b"), PREFIX_SCHEMA, kind="k", schema_version=1, rows_per_part=3)
    for r in rows:
        w.add([r])
    b = w.close()
    assert [(p["name"], p["rows"], p["sha256"]) for p in a["parts"]] == \
        [(p["name"], p["rows"], p["sha256"]) for p in b["parts"]] and [p["rows"] for p in b["parts"]] == [3, 3, 1]
    empty = shards.ShardWriter(str(tmp_path / "c"), PREFIX_SCHEMA, kind="k", schema_version=1).close()
    assert [p["rows"] for p in empty["parts"]] == [0]


def test_streamed_build_equals_the_rows_built_in_memory(tmp_path, tokenizer):
    trajs = load(SAMPLE_DATA / "alfworld_eto.json").trajectories
    rows, stats = build_prefix_rows(trajs, get_benchmark("alfworld"), tokenizer, PrefixOptions())
    res = build_prefixes(str(SAMPLE_DATA / "alfworld_eto.json"), "auto", "alfworld", str(tmp_path / "out"),
                         tokenizer, rows_per_part=5, log=lambda s: None, show_progress=False)
    m = res.manifest
    assert m["stats"]["kept"] == stats.kept == 42 and m["records_read"] == m["valid_records"] == 6
    assert m["format"] == "auto" and m["format_read"] == "auto → eto (records have 'id' and 'conversations')"
    parts = sorted((tmp_path / "out" / "train").glob("part-*.parquet"))
    assert len(parts) == -(-stats.train // 5) and all(pq.read_metadata(p).num_rows <= 5 for p in parts)
    got = read_prefixes(str(tmp_path / "out"), "train").to_pylist() + read_prefixes(str(tmp_path / "out"),
                                                                                    "val").to_pylist()
    key = lambda r: r["prefix_id"]  # noqa: E731
    assert sorted(got, key=key) == sorted(rows, key=key)


def test_written_files_have_normal_permissions(tmp_path):
    old = os.umask(0o027)
    try:
        storage.write_bytes(str(tmp_path / "a.txt"), b"x")
    finally:
        os.umask(old)
    assert (tmp_path / "a.txt").stat().st_mode & 0o777 == 0o640  # 0666 less the umask, as open() would give


@pytest.mark.parametrize("text,thought,action", [
    ("Thought: a\nAction: go to desk 1", "a", "go to desk 1"),
    ("Action: go to desk 1 ", "", "go to desk 1"),
    ("thought: a\nAction: look", "a", "look"),  # the label of the thought is not what the parsers look for
    ("Thought:   a\n\nb\n  \nAction:\n  go to desk 1  \n", "a\n\nb", "go to desk 1"),  # ETO's "Action:\\s?"
    ("Thought: a\nAction: click[Buy Now]\n\n", "a", "click[Buy Now]"),
])
def test_react_responses_read(text, thought, action):
    from sapd.data.react import parse_react
    step = parse_react(text)
    assert (step.thought, step.action) == (thought, action)


@pytest.mark.parametrize("text,reason,words", [
    ("Thought: a", "empty_action", "has no 'Action: …' line"),
    ("Thought: a\nAction:", "empty_action", "the 'Action:' line is empty"),
    ("Thought: a\naction: look", "empty_action", "only 'action:'"),
    ("Thought: a. Action: look", "ambiguous_action", "appears only inside a line"),
    ("Thought: a Action: look\nAction: look", "ambiguous_action", "already appears inside the thought"),
    ("Thought: a\nAction: look\nObservation: dark", "text_after_action", "'Observation:' the model wrote itself"),
    ("Thought: a\nAction: look\nAction: go to desk 1", "text_after_action", "a second 'Action:' line"),
    ("Thought: a\nAction: look\nthen more", "text_after_action", "more text follows the action line"),
])
def test_react_responses_refused(text, reason, words):
    from sapd.data.react import ResponseProblem, parse_react
    with pytest.raises(ResponseProblem) as ei:
        parse_react(text)
    assert ei.value.reason == reason and words in ei.value.detail


@pytest.mark.parametrize("action,reason", [
    ("lookup[Paris]", "not_benchmark_action"), ("search[a] b", "not_benchmark_action"),
    ("go to desk 1", "not_benchmark_action"), ("search[ ]", "empty_action")])
def test_search_qa_takes_only_search_and_finish(action, reason):
    from sapd.data.react import ResponseProblem, decision_response
    with pytest.raises(ResponseProblem) as ei:
        decision_response("t", action, get_benchmark("searchqa").decision)
    assert ei.value.reason == reason


def test_native_turns_the_agent_loop_flagged_invalid_load_as_recorded(tmp_path):
    """Teacher pools record a malformed sample with the no-op the environment got, and list the turn in
    metadata.invalid_turns; an unflagged malformed response is refused."""
    turns = [{"observation": "o1", "response": "<think>a</think><action>go north</action>", "action": "go north"},
             {"observation": "o2", "response": "I will go north", "action": "look"}]
    rec = {"id": "p1", "benchmark": "textworld", "task": "t", "turns": turns,
           "metadata": {"invalid_steps": 1, "invalid_turns": [1]}}
    path = tmp_path / "pool.jsonl"
    path.write_text(json.dumps(rec) + "\n", encoding="utf-8")
    (t,) = load(path, "native", "textworld").trajectories
    assert [u.action for u in t.turns] == ["go north", "look"] and t.turns[1].response == "I will go north"
    rec["metadata"]["invalid_turns"] = []
    path.write_text(json.dumps(rec) + "\n", encoding="utf-8")
    with pytest.raises(InvalidRecordError, match=r"line 1 \(id=p1\): field turns\[1\].response: .*missing <action>"):
        load(path, "native", "textworld")


def test_an_empty_file_holds_no_records(tmp_path):
    (tmp_path / "a.jsonl").write_text("\n", encoding="utf-8")
    write(tmp_path, "b.json", [rec("b")])
    res = load(tmp_path, "auto", "alfworld")
    assert [t.id for t in res.trajectories] == ["b"] and res.records_read == 1
