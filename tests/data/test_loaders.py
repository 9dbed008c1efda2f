"""Loaders: the shipped samples in every format, and bad input with file/record/field in the error."""

import json

import pytest

from sapd.data.errors import InvalidRecordError
from sapd.data.loaders import LoadOptions, load_trajectories, write_native_jsonl, write_native_parquet
from tests.tokenizer_util import SAMPLE_DATA


def load(path, fmt, bench, **kw):
    return load_trajectories(str(path), fmt, LoadOptions(bench, **kw))


def _eto(convs, **extra):
    return {"id": "t1", "conversations": [{"from": f, "value": v} for f, v in convs], **extra}


ALF_OK = [("human", "instructions"), ("gpt", "OK"),
          ("human", "-= Welcome =-\n\nYou are in a room.\n\nYour task is to: put a mug in fridge."),
          ("gpt", "Thought: find the mug.\nAction: go to table 1"),
          ("human", "Observation: On the table 1, you see a mug 1."),
          ("gpt", "Action: take mug 1 from table 1"),
          ("human", "Observation: You pick up the mug 1 from the table 1.")]


def write_json(tmp_path, name, obj):
    p = tmp_path / name
    p.write_text(json.dumps(obj), encoding="utf-8")
    return p


# ------------------------------------------------------------------------------------------- ETO


def test_eto_alfworld_sample():
    res = load(SAMPLE_DATA / "alfworld_eto.json", "eto", "alfworld")
    assert len(res.trajectories) == 6 and res.report.total == 0
    assert sorted(t.category for t in res.trajectories) == sorted(["Pick", "Look", "Clean", "Heat", "Cool", "Pick2"])
    for t in res.trajectories:
        assert t.task and "Your task is to" not in t.turns[0].observation
        assert t.final_observation  # o_{T+1} kept, never shown in a prefix
        for turn in t.turns:
            assert turn.response.startswith("<think>") and turn.response.endswith(f"<action>{turn.action}</action>")
            assert not turn.observation.startswith("Observation:")
    pick = next(t for t in res.trajectories if t.category == "Pick")
    assert pick.turns[0].response == "<think></think>\n<action>go to countertop 1</action>"  # no Thought line
    assert pick.task == "put a soapbar in toilet."
    assert pick.metadata["game_file"].startswith("json_2.1.1/train/pick_and_place_simple")


def test_eto_action_wording_normalisation():
    recorded = load(SAMPLE_DATA / "alfworld_eto.json", "eto", "alfworld")
    as_put = load(SAMPLE_DATA / "alfworld_eto.json", "eto", "alfworld", action_wording="put")
    as_move = load(SAMPLE_DATA / "alfworld_eto.json", "eto", "alfworld", action_wording="move")
    rec_actions = [a.action for t in recorded.trajectories for a in t.turns]
    assert any(a.startswith("move ") for a in rec_actions) and any(a.startswith("put ") for a in rec_actions)
    put_actions = [a.action for t in as_put.trajectories for a in t.turns]
    move_actions = [a.action for t in as_move.trajectories for a in t.turns]
    assert not any(a.startswith("move ") for a in put_actions)
    assert "put lettuce 1 in/on diningtable 1" in put_actions
    assert not any(a.startswith("put ") for a in move_actions)
    assert len(put_actions) == len(move_actions) == len(rec_actions)


def test_eto_webshop_sample():
    res = load(SAMPLE_DATA / "webshop_eto.json", "eto", "webshop")
    assert [t.id for t in res.trajectories] == ["1532", "4207", "9021"]
    t = res.trajectories[0]
    assert t.task.startswith("i need a long sleeve men's flannel shirt")
    assert t.turns[0].action.startswith("search[") and t.turns[-1].action == "click[Buy Now]"
    assert t.turns[1].observation.startswith("[Back to Search]")


def test_eto_success_from_reward_is_a_perfect_episode_everywhere(tmp_path):
    """WebShop counts a purchase scored 1.0 as a success, as its environment adapter does; a partial
    reward is kept in metadata, not read as success."""
    import json
    recs = json.loads((SAMPLE_DATA / "webshop_eto.json").read_text())
    recs[0]["reward"], recs[1]["reward"] = 1.0, 0.75
    path = tmp_path / "ws.json"
    path.write_text(json.dumps(recs))
    got = load(path, "eto", "webshop").trajectories
    assert [t.success for t in got] == [True, False, None]
    assert got[1].metadata["reward"] == 0.75


@pytest.mark.parametrize("convs,field,reason", [
    (ALF_OK[:3] + [("robot", "x")], "conversations[3].from", "unknown_role"),
    (ALF_OK[:3] + [("gpt", "Thought: hmm, no action here")] + ALF_OK[4:5], "conversations[3].value", "empty_action"),
    (ALF_OK[:3] + [("gpt", "Thought: x\nAction:   ")], "conversations[3].value", "empty_action"),
    (ALF_OK[:3], "conversations", "missing_turns"),
    (ALF_OK[:3] + [("human", "again")], "conversations[3].from", "bad_turn_order"),
    ([ALF_OK[0], ALF_OK[1], ("human", "no task here"), ALF_OK[3]], "conversations[2].value", "missing_task"),
])
def test_eto_bad_records_name_file_record_and_field(tmp_path, convs, field, reason):
    good = _eto(ALF_OK)
    bad = _eto(convs)
    bad["id"] = "bad-one"
    path = write_json(tmp_path, "x.json", [good, bad])
    with pytest.raises(InvalidRecordError) as ei:
        load(path, "eto", "alfworld")
    e = ei.value
    assert (e.path, e.field, e.reason) == (str(path), field, reason)
    assert "record 1 (id=bad-one)" in str(e) and str(path) in str(e) and field in str(e)
    # with skip_invalid the good record survives and the bad one is counted by reason
    res = load(path, "eto", "alfworld", skip_invalid=True)
    assert [t.id for t in res.trajectories] == ["t1"]
    assert res.report.counts == {reason: 1}


def test_eto_missing_field_and_malformed_json(tmp_path):
    path = write_json(tmp_path, "x.json", [{"conversations": []}])
    with pytest.raises(InvalidRecordError, match=r"record 0: field id: required field 'id' is missing"):
        load(path, "eto", "alfworld")
    bad = tmp_path / "broken.json"
    bad.write_text('[{"id": 1,\n "conversations": [}]', encoding="utf-8")
    with pytest.raises(InvalidRecordError) as ei:
        load(bad, "eto", "alfworld", skip_invalid=True)  # an unparseable .json file cannot be skipped past
    assert ei.value.reason == "malformed_json" and "line 2" in str(ei.value)


def test_jsonl_malformed_lines_are_counted_when_skipping(tmp_path):
    good = json.dumps(_eto(ALF_OK))
    other = json.dumps({**_eto(ALF_OK), "id": "t2"})
    path = tmp_path / "x.jsonl"
    path.write_text(f"{good}\n{{not json\n\n{other}\n", encoding="utf-8")
    with pytest.raises(InvalidRecordError, match=r"x.jsonl: line 2: malformed JSON"):
        load(path, "eto", "alfworld")
    res = load(path, "eto", "alfworld", skip_invalid=True)
    assert [t.id for t in res.trajectories] == ["t1", "t2"]
    assert res.report.counts == {"malformed_json": 1}
    assert res.records_read == 3


def test_duplicate_ids_are_invalid(tmp_path):
    path = write_json(tmp_path, "x.json", [_eto(ALF_OK), _eto(ALF_OK)])
    with pytest.raises(InvalidRecordError, match="duplicate_id"):
        load(path, "eto", "alfworld")


def test_folder_input_reads_every_file_in_order(tmp_path):
    write_json(tmp_path, "b.json", [{**_eto(ALF_OK), "id": "b"}])
    write_json(tmp_path, "a.json", [{**_eto(ALF_OK), "id": "a"}])
    (tmp_path / "notes.txt").write_text("ignored")
    res = load(tmp_path, "eto", "alfworld")
    assert [t.id for t in res.trajectories] == ["a", "b"] and len(res.files) == 2
    with pytest.raises(FileNotFoundError, match="no such file"):
        load(tmp_path / "missing", "eto", "alfworld")


# ------------------------------------------------------------------------------------- SkillRL


def test_skillrl_regroups_and_flags_non_admissible_actions():
    with pytest.raises(InvalidRecordError) as ei:
        load(SAMPLE_DATA / "alfworld_skillrl.jsonl", "skillrl", "alfworld")
    assert ei.value.reason == "action_not_admissible" and ei.value.location == "line 7"
    res = load(SAMPLE_DATA / "alfworld_skillrl.jsonl", "skillrl", "alfworld", skip_invalid=True)
    # counted in records: the refused trajectory is lines 5–7, so 4 valid + 3 invalid = the 7 read
    assert res.records_read == 7 and res.valid_records == 4 and res.report.counts == {"action_not_admissible": 3}
    assert res.report.errors == {"action_not_admissible": 1}
    (t,) = res.trajectories
    assert t.task == "put some spraybottle on toilet." and len(t.turns) == 4
    assert t.turns[0].admissible_actions and "look" in t.turns[0].admissible_actions
    assert all(turn.action in turn.admissible_actions for turn in t.turns)
    assert t.turns[1].observation.startswith("You arrive at countertop 1.")
    # the admissible-list check can be switched off, but "turn on desklamp 1" is no ALFWorld command at
    # all (the lamp's is "use desklamp 1"), so the benchmark check still refuses it
    with pytest.raises(InvalidRecordError) as ei:
        load(SAMPLE_DATA / "alfworld_skillrl.jsonl", "skillrl", "alfworld", check_admissible=False)
    assert (ei.value.location, ei.value.field, ei.value.reason) == ("line 7", "output", "not_benchmark_action")


def _skill_prompt(task, step, obs, actions=("look", "go to desk 1")):
    acts = ", ".join(f"'{a}'" for a in actions)
    return (f"You are an expert agent operating in the ALFRED Embodied Environment. Your task is to: {task}\n"
            f"You are now at step {step} and your current observation is: {obs}\n"
            f"Your admissible actions of the current situation are: [{acts}].\n\nNow it's your turn.")


def test_skillrl_step_breaks_start_new_trajectories(tmp_path):
    out = "<think>x</think>\n<action>look</action>"
    recs = [{"instruction": _skill_prompt("A", 1, "o1"), "output": out},
            {"instruction": _skill_prompt("A", 2, "o2"), "output": out},
            {"instruction": _skill_prompt("A", 1, "p1"), "output": out},  # same task, restarts: new trajectory
            {"instruction": _skill_prompt("B", 2, "q2"), "output": out}]  # starts mid-way: incomplete
    path = tmp_path / "s.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in recs) + "\n", encoding="utf-8")
    res = load(path, "skillrl", "alfworld", skip_invalid=True)
    assert [[x.observation for x in t.turns] for t in res.trajectories] == [["o1", "o2"], ["p1"]]
    assert res.report.counts == {"incomplete_trajectory": 1}
    assert len({t.id for t in res.trajectories}) == 2
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"instruction": "no markers", "output": out}) + "\n", encoding="utf-8")
    with pytest.raises(InvalidRecordError, match=r"bad.jsonl: line 1: field instruction: .*Your task is to"):
        load(bad, "skillrl", "alfworld")


# ------------------------------------------------------------------------------------- Search-R1


def test_searchr1_sample():
    res = load(SAMPLE_DATA / "searchqa_searchr1.jsonl", "searchr1", "searchqa")
    by_id = {t.id: t for t in res.trajectories}
    assert set(by_id) == {"nq_train_17", "hotpotqa_train_2310", "triviaqa_test_402", "bamboogle_test_58"}
    nq = by_id["nq_train_17"]
    assert nq.category == "nq" and nq.task == "who wrote the novel the old man and the sea?"
    assert [t.action for t in nq.turns] == ["The Old Man and the Sea author", "Ernest Hemingway"]
    assert nq.turns[0].observation == "" and nq.turns[1].observation.startswith("Doc 1")
    assert "<information>" not in nq.turns[1].response  # retrieved text is observation, not response
    assert nq.success is True and by_id["bamboogle_test_58"].success is False
    assert len(by_id["triviaqa_test_402"].turns) == 1


def test_searchr1_turns_list_and_parquet(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq
    row = {"id": "q1", "data_source": "nq", "question": "capital of france?", "golden_answers": ["Paris"],
           "turns": [{"response": "<think>a</think><search> france capital </search>", "observation": "Doc 1 Paris"},
                     {"response": "<think>b</think><answer> paris </answer>"}]}
    p = tmp_path / "rows.parquet"
    pq.write_table(pa.Table.from_pylist([row]), p)
    (t,) = load(p, "searchr1", "searchqa").trajectories
    assert [x.action for x in t.turns] == ["france capital", "paris"] and t.success is True
    assert t.turns[1].observation == "Doc 1 Paris"
    bad = dict(row, turns=[{"response": "<think>a</think><search> x <answer> y </answer>"}])
    path = write_json(tmp_path, "bad.json", [bad])
    with pytest.raises(InvalidRecordError, match=r"field turns\[0\].response: .*both <search> and <answer>"):
        load(path, "searchr1", "searchqa")


# ----------------------------------------------------------------------------------------- native


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_native_roundtrip(tmp_path, suffix):
    src = load(SAMPLE_DATA / "alfworld_eto.json", "eto", "alfworld").trajectories
    out = tmp_path / f"native{suffix}"
    (write_native_parquet if suffix == ".parquet" else write_native_jsonl)(src, str(out))
    back = load(out, "native", "alfworld").trajectories
    assert [t.to_dict() for t in back] == [t.to_dict() for t in src]


def test_native_errors(tmp_path):
    p = tmp_path / "n.jsonl"
    rec = {"id": "x", "benchmark": "alfworld", "task": "t",
           "turns": [{"observation": "o", "response": "<think></think><action>a</action>", "action": ""}]}
    p.write_text(json.dumps(rec) + "\n", encoding="utf-8")
    with pytest.raises(InvalidRecordError, match=r"line 1 \(id=x\): field turns\[0\].action: recorded action is empty"):
        load(p, "native", "alfworld")
    with pytest.raises(InvalidRecordError, match="benchmark_mismatch"):
        load(p, "native", "webshop")
    p.write_text(json.dumps({**rec, "turns": [{"observation": "o"}]}) + "\n", encoding="utf-8")
    with pytest.raises(InvalidRecordError, match=r"field turns\[0\].response: required field"):
        load(p, "native", "alfworld")


def test_an_unknown_format_names_the_config_key_and_the_registry():
    """The registry is the one list of formats: an unknown one is refused where data is read, as an error
    about data.format that names every registered format."""
    from sapd.config import ConfigError
    from sapd.data.loaders import FORMATS, REGISTRY
    assert FORMATS == (*REGISTRY, "auto") and {"native", "eto", "agentgym", "fireact", "skillrl", "searchr1"} == set(REGISTRY)
    with pytest.raises(ConfigError, match=r"data.format: unknown format 'xml'; expected one of skillrl, native, ") as e:
        load(SAMPLE_DATA / "alfworld_eto.json", "xml", "alfworld")
    assert e.value.path == "data.format"
