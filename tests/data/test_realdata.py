"""Real public trajectory files, as users download them (tests/assets/realdata/SOURCES.md): every file
either builds the prefixes a person reading it expects, or is refused with a message naming the file,
record, field and what to do. Expected values were read off the files by hand."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from sapd.data.errors import InvalidRecordError
from sapd.data.loaders import LoadOptions, load_trajectories
from sapd.data.prefixes import PrefixOptions, build_prefix_rows, build_prefixes
from sapd.method.benchmarks import get_benchmark
from tests.tokenizer_util import build_test_tokenizer

REAL = Path(__file__).resolve().parents[1] / "assets" / "realdata"
RAW, DERIVED = REAL / "raw", REAL / "derived"

LTSURE_ALF = RAW / "LTSure__on-policy-cold-start__data__alfworld_sft.excerpt-first6.json"
LTSURE_SCI = RAW / "LTSure__on-policy-cold-start__get_data__sft__sci.excerpt-first1.json"
FIREACT_HOTPOTQA = RAW / "anchen1011__FireAct__data__finetune__gpt_format__hotpotqa.jsonl"
FIREACT_MULTITASK = RAW / "anchen1011__FireAct__data__finetune__gpt_format__multitask.jsonl"
FIREACT_TRAJS = RAW / "anchen1011__FireAct__trajs__hotpotqa_dev_0_500_ft_gpt-3.5-turbo-0613.json"

THINK_HINT = ("You should first reason step-by-step about the current situation. This reasoning process MUST be "
              "enclosed within <think> </think> tags.")
ACTION_HINT = ("Once you've finished your reasoning, you should choose an admissible action for current step and "
               "present it within <action> </action> tags.")
ROOM_TOILET = ("You are in the middle of a room. Looking quickly around you, you see a bathtubbasin 1, a cabinet 2, "
               "a cabinet 1, a countertop 1, a garbagecan 1, a handtowelholder 1, a sinkbasin 1, a toilet 1, a "
               "toiletpaperhanger 1, and a towelholder 1.")
SCI_TASK = ("Your task is to determine if metal pot is electrically conductive. The metal pot is located around the "
            "kitchen. First, focus on the metal pot. If it is electrically conductive, place it in the blue box. If "
            "it is electrically nonconductive, place it in the orange box.")
WEBSHOP_TASK = "i need a long lasting 6.76 fl oz bottle of l'eau d'issey, and price lower than 100.00 dollars"


def load(path, fmt, bench, **kw):
    return load_trajectories(str(path), fmt, LoadOptions(bench, **kw))


def refused(path, fmt, bench):
    """The error a load without --skip-invalid stops at."""
    with pytest.raises(InvalidRecordError) as ei:
        load(path, fmt, bench)
    return ei.value


def counts_add_up(res):
    assert res.valid_records + res.report.total == res.records_read


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return build_test_tokenizer(tmp_path_factory.mktemp("tok"))


# ------------------------------------------------------------------------------ raw: ETO role/content


def test_ltsure_alfworld_role_content_keys_load_as_eto():
    res = load(LTSURE_ALF, "eto", "alfworld")
    ts = res.trajectories
    assert [t.id for t in ts] == [f"alfworld_{i}" for i in range(6)]
    assert [len(t.turns) for t in ts] == [5, 8, 10, 13, 10, 11] and res.records_read == 6 and res.report.total == 0
    assert [t.category for t in ts] == ["Pick", "Clean", "Pick", "Clean", "Pick", "Look"]
    t0 = ts[0]
    assert t0.task == "put a toiletpaper in toiletpaperhanger."
    assert t0.turns[0].observation == ROOM_TOILET
    assert [u.action for u in t0.turns] == ["go to toiletpaperhanger 1", "go to toilet 1",
                                            "take toiletpaper 1 from toilet 1", "go to toiletpaperhanger 1",
                                            "put toiletpaper 1 in/on toiletpaperhanger 1"]
    assert t0.turns[2].observation == "On the toilet 1, you see a soapbottle 1, and a toiletpaper 1."
    assert t0.turns[4].response == ("<think>I'm back at the toilet paper hanger with the roll in hand. It's time to "
                                    "put the toilet paper on the hanger.</think>\n"
                                    "<action>put toiletpaper 1 in/on toiletpaperhanger 1</action>")
    assert t0.final_observation is None and t0.success is None  # the record ends with the last action
    assert t0.metadata["instruction"].startswith("Interact with a household to solve a task.")
    assert t0.metadata["game_file"] == ("data/json_2.1.1/train/pick_and_place_simple-ToiletPaper-None-"
                                        "ToiletPaperHanger-406/trial_T20190908_122807_136741")
    assert ts[5].task == "look at pillow under the desklamp." and ts[5].turns[-1].action == "use desklamp 1"
    # the documented from/value copy of the same data reads identically
    same = load(DERIVED / "eto_alfworld_fromvalue.json", "eto", "alfworld").trajectories
    assert [t.to_dict() for t in same] == [t.to_dict() for t in ts]


def test_ltsure_alfworld_prefix_prompt_and_target(tokenizer):
    ts = load(LTSURE_ALF, "eto", "alfworld").trajectories
    rows, stats = build_prefix_rows(ts, get_benchmark("alfworld"), tokenizer, PrefixOptions(val_fraction=0))
    assert stats.kept == 57 and stats.by_category == {"Pick": 25, "Clean": 21, "Look": 11}
    row = rows[1]
    assert row["prefix_id"] == "alfworld_0#1" and row["previous_action"] == "go to toiletpaperhanger 1"
    content = ("You are an expert agent operating in the ALFRED Embodied Environment. Your task is to: put a "
               "toiletpaper in toiletpaperhanger.\n"
               "Prior to this step, you have already taken 1 step(s). Below are the most recent 1 observations and "
               f"the corresponding actions you took: [Observation 1: '{ROOM_TOILET}', Action 1: 'go to "
               "toiletpaperhanger 1']\n"
               "You are now at step 2 and your current observation is: On the toiletpaperhanger 1, you see nothing.\n"
               f"\nNow it's your turn to take an action.\n{THINK_HINT}\n{ACTION_HINT}")
    assert row["prompt"] == f"<|im_start|>user\n{content}<|im_end|>\n<|im_start|>assistant\n"
    assert row["recorded_response"] == ("<think>The toilet paper hanger is empty, so I need to find a new roll of "
                                        "toilet paper to put on it.</think>\n<action>go to toilet 1</action>")
    assert row["recorded_action"] == "go to toilet 1"


def test_alfworld_data_is_refused_for_search_qa_and_webshop(tmp_path, tokenizer):
    """Issue #12.5: recorded responses that are not decisions of the chosen benchmark are refused, not cut
    into prefixes whose every target is invalid."""
    e = refused(LTSURE_ALF, "eto", "searchqa")
    assert (e.location, e.field, e.reason) == ("record 0 (id=alfworld_0)", "conversations[2].content",
                                               "benchmark_mismatch")
    assert str(e).endswith("the text reads like alfworld data ('Looking quickly around you, you see'), but "
                           "--benchmark is searchqa: is --benchmark alfworld meant? [benchmark_mismatch]")
    res = load(LTSURE_ALF, "eto", "searchqa", skip_invalid=True)
    assert res.trajectories == [] and res.report.counts == {"benchmark_mismatch": 6}
    with pytest.raises(ValueError, match=r"no valid trajectories \(6 records read, 6 invalid\)"):
        build_prefixes(str(LTSURE_ALF), "eto", "searchqa", str(tmp_path / "o"), tokenizer, skip_invalid=True,
                       log=lambda s: None, show_progress=False)
    # without the tell-tale first observation, the responses themselves are refused
    recs = json.loads(LTSURE_ALF.read_text())[:1]
    recs[0]["conversations"][2]["content"] = "Your task is to: put a toiletpaper in toiletpaperhanger."
    path = tmp_path / "one.json"
    path.write_text(json.dumps(recs))
    e = refused(path, "eto", "searchqa")
    assert (e.field, e.reason) == ("conversations[3].content", "not_benchmark_action")
    assert "action 'go to toiletpaperhanger 1' is not a search QA decision (search[query] or finish[answer]); " \
           "is --benchmark right?" in str(e)
    e = refused(LTSURE_ALF, "eto", "webshop")
    assert (e.field, e.reason) == ("conversations[2].content", "benchmark_mismatch")
    assert "reads like alfworld data ('Looking quickly around you, you see')" in str(e)


def test_ltsure_sciworld_messages_system_and_task_without_colon():
    res = load(LTSURE_SCI, "eto", "scienceworld")
    (t,) = res.trajectories
    assert t.id == "9_412" and len(t.turns) == 17 and t.task == SCI_TASK
    assert t.metadata["system"].startswith("You are an intelligent agent in a household environment")
    assert t.metadata["instruction"] is None  # no instruction/"OK" pair: the first user message is the task
    assert t.turns[0].observation == ""  # ETO shows no observation before the first action
    assert [u.action for u in t.turns[:3]] == ["look around", "teleport to kitchen",
                                               "pick up metal pot containing nothing in kitchen"]
    assert t.turns[1].observation.startswith("This room is called the foundry. In it, you see: \n\tthe agent\n")
    assert t.turns[-1].action == "move metal pot to blue box"
    # derived copies: keys renamed (the same episode), and a diagnostic one with "Your task is to:"
    (same,) = load(DERIVED / "eto_sciworld_fromvalue.json", "eto", "scienceworld").trajectories
    assert same.task == t.task and [vars(u) for u in same.turns] == [vars(u) for u in t.turns]
    (colon,) = load(DERIVED / "eto_sciworld_fromvalue_colon_added.json", "eto", "scienceworld").trajectories
    assert colon.task == SCI_TASK.replace("Your task is to ", "Your task is to: ") and len(colon.turns) == 17
    # read as ALFWorld it is refused, with the reason
    e = refused(LTSURE_SCI, "eto", "alfworld")
    assert (e.field, e.reason) == ("messages[1].content", "missing_task")
    assert "without a colon, as ScienceWorld does: is --benchmark scienceworld meant?" in str(e)
    e = refused(DERIVED / "eto_sciworld_fromvalue_colon_added.json", "eto", "alfworld")
    assert (e.field, e.reason) == ("conversations[1].value", "not_benchmark_action")
    assert "action 'look around' is not an ALFWorld command" in str(e)


# ------------------------------------------------------------------------------ raw: ICL example files


@pytest.mark.parametrize("name,n", [
    ("Yifan-Song793__ETO__eval_agent__prompt__icl_examples__alfworld_icl.json", 10),
    ("Yifan-Song793__ETO__eval_agent__prompt__icl_examples__sciworld_icl.json", 14),
    ("Yifan-Song793__ETO__eval_agent__prompt__icl_examples__webshop_icl.json", 8),
    ("WeiminXiong__IPR__eval_agent__prompt__icl_examples__alfworld_icl.json", 10),
    ("WeiminXiong__IPR__eval_agent__prompt__icl_examples__webshop_icl.json", 8),
    ("WeiminXiong__IPR__eval_agent__prompt__icl_examples__intercode_sql_icl.json", 8),
])
def test_icl_example_files_are_refused_with_how_to_wrap_them(name, n):
    e = refused(RAW / name, "eto", "alfworld")
    assert (e.location, e.reason) == ("record 0", "bad_type")
    assert str(e) == (f"{RAW / name}: record 0: the record is a bare list of {n} messages, not an object (an ICL "
                      "example file?): wrap each conversation as {\"id\": …, \"conversations\": [...]} [bad_type]")
    e = refused(RAW / name, "auto", "alfworld")
    assert e.reason == "unknown_format" and f"a bare list of {n} messages" in str(e)


def test_wrapped_icl_files_build_their_one_trajectory():
    alf0 = load(LTSURE_ALF, "eto", "alfworld").trajectories[0]
    for name in ("icl_alfworld_wrapped_rawkeys.json", "icl_alfworld_fromvalue.json"):  # mixed role/from keys too
        (t,) = load(DERIVED / name, "eto", "alfworld").trajectories
        assert t.id == "alfworld_icl_0" and t.task == alf0.task
        assert [vars(u) for u in t.turns] == [vars(u) for u in alf0.turns]  # the same episode as alfworld_0
    for name in ("icl_sciworld_wrapped_rawkeys.json", "icl_sciworld_fromvalue.json"):
        (t,) = load(DERIVED / name, "eto", "scienceworld").trajectories
        assert t.task == ("Your task is to use chemistry to create green paint. When you are done, focus on the "
                          "green paint.")
        assert [u.action for u in t.turns] == [
            "look around", "teleport to art studio", "look around",
            "pour cup containing blue paint in art studio in cup containing nothing",
            "pour cup containing yellow paint in art studio in cup containing blue paint in table",
            "mix cup containing blue paint and yellow paint", "focus on green paint"]
    for name in ("icl_webshop_wrapped_rawkeys.json", "icl_webshop_fromvalue.json"):
        (t,) = load(DERIVED / name, "eto", "webshop").trajectories
        assert t.task == WEBSHOP_TASK
        assert [u.action for u in t.turns] == ["search[l'eau d'issey 6.76 fl oz bottle price < 100.00]",
                                               "click[B000VOHH8I]", "click[6.76 fl oz (pack of 1)]", "click[Buy Now]"]
        assert t.turns[0].observation == f"WebShop [SEP] Instruction: [SEP] {WEBSHOP_TASK} [SEP] Search"


@pytest.mark.parametrize("bench,reason,field", [
    ("alfworld", "missing_task", "conversations[0].value"),
    ("webshop", "missing_task", "conversations[0].value"),
    ("scienceworld", "missing_task", "conversations[0].value"),
    ("searchqa", "text_after_action", "conversations[1].value"),  # a multi-line ```sql block
])
@pytest.mark.parametrize("name", ["icl_intercode_sql_fromvalue.json", "icl_intercode_sql_wrapped_rawkeys.json"])
def test_intercode_sql_fits_no_benchmark_of_sapd(name, bench, reason, field):
    res = load(DERIVED / name, "eto", bench, skip_invalid=True)
    assert res.trajectories == [] and res.report.counts == {reason: 3}
    e = refused(DERIVED / name, "eto", bench)
    if "rawkeys" in name:  # role/content as recorded
        field = field.replace(".value", ".content")
    assert (e.location, e.field) == ("record 0 (id=intercode_sql_icl_0)", field)
    if bench == "alfworld":
        assert ("cannot find the task ('Your task is to: …') in the first observation, which starts 'What is the "
                "average GNP and total population in all nations whose government is US territory?'.") in str(e)


# ------------------------------------------------------------------------------ raw: FireAct


def test_fireact_finetune_messages_load_as_search_qa():
    res = load(FIREACT_HOTPOTQA, "fireact", "searchqa")
    ts = res.trajectories
    assert len(ts) == 500 and sum(len(t.turns) for t in ts) == 1385 and res.report.total == 0
    t = ts[0]
    assert t.id == "anchen1011__FireAct__data__finetune__gpt_format__hotpotqa:L1"
    assert t.task == ("Who was once considered the best kick boxer in the world, however he has been involved in a "
                      "number of controversies relating to his \"unsportsmanlike conducts\" in the sport and crimes "
                      "of violence outside of the ring.")
    assert t.turns[0].observation == ""
    assert t.turns[0].response == ("<think>I need to search for the best kick boxer in the world who has been "
                                   "involved in unsportsmanlike conducts and crimes of violence outside of the "
                                   "ring.</think>\n<search>best kick boxer in the world unsportsmanlike conducts "
                                   "crimes of violence</search>")
    assert t.turns[0].action == "best kick boxer in the world unsportsmanlike conducts crimes of violence"
    assert t.turns[1].observation == ("Badr Hari (born 8 December 1984) is a Moroccan-Dutch kickboxer. He is a "
                                      "former K-1 Heavyweight World Champion (2007\u20132008), It's Showtime "
                                      "Heavyweight World ...")
    assert t.turns[1].response == "<think>Badr Hari is the person who fits the description.</think>\n" \
                                  "<answer>Badr Hari</answer>"
    assert t.success is True and t.final_observation == "Episode finished, reward = True"
    # the ETO-shaped copy of the same lines reads the same, under its own ids
    same = load(DERIVED / "fireact_hotpotqa_fromvalue.jsonl", "eto", "searchqa").trajectories
    assert [s.id for s in same[:2]] == ["fireact_hotpotqa_0", "fireact_hotpotqa_1"]
    assert [[vars(u) for u in s.turns] for s in same] == [[vars(u) for u in x.turns] for x in ts]


def test_fireact_search_prompt(tokenizer):
    (t,) = load(FIREACT_HOTPOTQA, "fireact", "searchqa").trajectories[:1]
    rows, _ = build_prefix_rows([t], get_benchmark("searchqa"), tokenizer, PrefixOptions(val_fraction=0))
    msg = json.loads(rows[1]["messages"])[0]["content"]
    assert msg == (
        "You are an expert agent answering questions with the help of a search engine.\n"
        f"Question: {t.task}\n"
        "Prior to this step, you have already searched 1 time(s). Below are the most recent 1 searches and the "
        "information they returned:\n"
        "[Search 1: 'best kick boxer in the world unsportsmanlike conducts crimes of violence', Information 1: Badr "
        "Hari (born 8 December 1984) is a Moroccan-Dutch kickboxer. He is a former K-1 Heavyweight World Champion "
        "(2007\u20132008), It's Showtime Heavyweight World ...]\n"
        "You are now at step 2.\n"
        f"\n{THINK_HINT}\nIf you lack knowledge, call the search engine with <search> query </search>; results come "
        "back between <information> and </information>. When you know the answer, give it inside <answer> </answer> "
        "tags without extra explanation.")
    assert rows[1]["recorded_action"] == "Badr Hari"


def test_fireact_multitask_and_its_question_label():
    res = load(FIREACT_MULTITASK, "fireact", "searchqa")
    assert len(res.trajectories) == 1344 and sum(len(t.turns) for t in res.trajectories) == 3100
    t = res.trajectories[500]  # line 501: a multiple-choice question, answered at once
    assert t.task == "Which is likeliest to make noises from its mouth?\nA. a fish\nB. a truck\nC. a chicken\nD. an ant"
    assert [u.action for u in t.turns] == ["C"] and t.success is True  # "reward = 1"
    # FireAct data is search QA: read as ALFWorld, every record says where it fails
    res = load(FIREACT_MULTITASK, "fireact", "alfworld", skip_invalid=True)
    assert res.report.counts == {"missing_task": 1344} and res.records_read == 1344


def test_fireact_recorded_evaluations_and_their_broken_responses():
    res = load(FIREACT_TRAJS, "auto", "searchqa", skip_invalid=True)
    assert res.format_summary() == ("auto → fireact (a dict of question id → {'traj', …} (FireAct's recorded "
                                    "evaluations))")
    assert res.records_read == 465 and len(res.trajectories) == 454
    assert res.report.counts == {"text_after_action": 8, "ambiguous_action": 3}
    counts_add_up(res)
    by_id = {t.id: t for t in res.trajectories}
    t = by_id["6238"]
    assert t.task == "Who created the show with Wendy Schaal doing the voice of Francine?" and t.success is True
    assert [u.action for u in t.turns] == ["Seth MacFarlane"]
    assert t.metadata["golden_answers"] == ["seth macfarlane"] and t.metadata["f1"] == 1.0
    assert by_id["5388"].success is False and by_id["5388"].turns[0].action == "Enemy ships and aircraft"
    assert sum(t.success for t in res.trajectories) == 199
    # question 457 wrote two Action lines; FireAct and ETO would send both to the environment
    bad = [ex for ex in res.report.examples["text_after_action"] if "key '457'" in ex]
    assert bad == [f"{FIREACT_TRAJS}: key '457' (id=457): field traj[3].content: a second 'Action:' line follows "
                   "('Action: search[tales associated with Frigg]'); ETO's and FireAct's parsers take everything "
                   "after the first 'Action:' as the action, so the environment would have received it too: remove "
                   "the extra text or drop the record [text_after_action]"]
    # question 7082 wrote "… Action: finish[Italy]" inside its thought, then the Action line
    assert any("key '7082'" in ex and "'Action:' already appears inside the thought ('Action: finish[Italy]')" in ex
               for ex in res.report.examples["ambiguous_action"])


# ------------------------------------------------------------------------------ raw: not trajectory files


def test_search_r1_raw_chat_text_is_refused():
    path = RAW / "PeterGriffinJin__Search-R1__example__case.txt"
    for fmt in ("searchr1", "auto"):
        e = refused(path, fmt, "searchqa")
        assert str(e) == (f"{path}: file: not JSON, JSONL or Parquet: it starts with '<|im_start|>system\\nYou are a "
                          "helpful ass' (raw chat or log text?); convert it to one of the formats in docs/FORMATS.md "
                          "[not_json]")


def test_search_r1_case_rows_load_without_golden_answers():
    res = load(DERIVED / "searchr1_case_rows.jsonl", "searchr1", "searchqa")
    a, b = res.trajectories
    assert a.task == "paul walkers cars in fast and furious list?" and a.category == "nq"
    assert [u.action for u in a.turns] == ["Paul Walker's cars in Fast and Furious",
                                           "list of cars paul walker drove in Fast and Furious", "Charger"]
    assert a.turns[1].observation.startswith('Doc 1(Title: "Paul Walker") also had a large car collection')
    assert a.success is None  # no golden answers recorded: the outcome is unknown, not a failure
    assert b.task == ("the heart muscle is stimulated to contract by electrical impulses which are generated where?")
    assert [u.action for u in b.turns] == ["origin of heart's electrical impulses", "sinoatrial (SA) node"]
    e = refused(DERIVED / "searchr1_case_rows.jsonl", "searchr1", "alfworld")
    assert (e.field, e.reason) == ("response (model turn 1)", "invalid_response")


def test_git_lfs_pointer_says_to_pull():
    path = RAW / "Ruimeng-Ye__wts_70B__data__webshop_sft.json.lfs-pointer.json"
    for fmt in ("eto", "auto"):
        e = refused(path, fmt, "webshop")
        assert str(e) == (f"{path}: file: this is a Git LFS pointer for a 10,741,287-byte file, not the data: run "
                          "`git lfs install && git lfs pull` in the repository you cloned it from (or download the "
                          "file itself) [lfs_pointer]")


def test_agentgym_webshop_human_log_is_not_a_trajectory_format():
    path = RAW / "WooooDyy__AgentGym__agentenv-webshop__webshop__all_trajs__20220427_1_12.jsonl"
    e = refused(path, "auto", "webshop")
    assert (e.location, e.reason) == ("line 1", "unknown_format")
    assert "the first record is an object with keys goal, page, url, none of the layouts sapd reads" in str(e)
    res = load(path, "eto", "webshop", skip_invalid=True)
    assert res.records_read == 6 and res.report.counts == {"missing_field": 6}
    assert res.report.examples["missing_field"][0] == (
        f"{path}: line 1: field conversations: required field 'conversations' (or 'messages') is missing; the record "
        "has keys goal, page, url — is --format right? [missing_field]")
    assert res.report.lines()[-1] == "    (3 more)"


# ------------------------------------------------------------------------------ derived: AgentGym


@pytest.mark.parametrize("name", ["agenttraj_shaped_alfworld.json", "agenttraj_shaped_alfworld_with_id.json"])
def test_agenttraj_layout(name):
    res = load(DERIVED / name, "agentgym", "alfworld")
    (t,) = res.trajectories
    assert t.id == "pick_clean_then_place_in_recep-Potato-None-Microwave-2_trial_T20190908_102004_349533"
    assert t.category == "Clean" and t.task == "put a clean potato in microwave." and len(t.turns) == 8
    assert t.metadata["instruction"].startswith("Interact with a household to solve a task.")
    assert t.turns[0].observation.endswith("a stoveburner 1, and a toaster 1.")
    assert t.turns[1].observation == "The fridge 1 is closed."  # AgentGym writes no "Observation:"
    assert t.turns[1].response == "<think></think>\n<action>open fridge 1</action>"  # bare "Action: x "
    assert [u.action for u in t.turns][-2:] == ["open microwave 1", "put potato 1 in/on microwave 1"]
    auto = load(DERIVED / name, "auto", "alfworld")
    assert auto.format_summary() == "auto → agentgym (records have 'item_id' and 'conversations')"
    assert [vars(u) for u in auto.trajectories[0].turns] == [vars(u) for u in t.turns]


def test_agenttraj_reply_marked_loss_false_is_refused(tmp_path):
    recs = json.loads((DERIVED / "agenttraj_shaped_alfworld.json").read_text())
    recs[0]["conversations"][5]["loss"] = False
    path = tmp_path / "a.json"
    path.write_text(json.dumps(recs))
    e = refused(path, "agentgym", "alfworld")
    assert (e.field, e.reason) == ("conversations[5].loss", "untrained_turn")


# ------------------------------------------------------------------------------ derived: SkillRL


@pytest.mark.parametrize("name,task", [
    ("skillrl_constructed_upstream.jsonl", "put a toiletpaper in toiletpaperhanger."),  # step 1: from the observation
    ("skillrl_constructed_memory.jsonl", "put a toiletpaper in toiletpaperhanger."),
    ("skillrl_constructed_comma_control.jsonl", "put a toiletpaper in toiletpaperhanger"),  # from the header
    ("skillrl_constructed_upstream_admissible_only.jsonl", "put a toiletpaper in toiletpaperhanger"),
])
def test_skillrl_layouts_all_regroup_into_the_six_trajectories(name, task):
    res = load(DERIVED / name, "skillrl", "alfworld")
    assert res.records_read == 57 and res.valid_records == 57 and res.report.total == 0
    assert [len(t.turns) for t in res.trajectories] == [5, 8, 10, 13, 10, 11]
    t = res.trajectories[0]
    assert t.task == task and t.id == f"{name[:-6]}:L1"
    assert t.turns[0].admissible_actions == ["go to toiletpaperhanger 1", "inventory", "look"]
    assert t.turns[1].observation == "On the toiletpaperhanger 1, you see nothing."
    eto = load(LTSURE_ALF, "eto", "alfworld").trajectories
    assert [[u.action for u in x.turns] for x in res.trajectories] == [[u.action for u in x.turns] for x in eto]
    assert [[u.response for u in x.turns] for x in res.trajectories] == [[u.response for u in x.turns] for x in eto]


# ------------------------------------------------------------------------------ derived: damaged and native


def test_truncated_file_says_it_is_cut_short():
    path = DERIVED / "truncated_eto.json"
    e = refused(path, "eto", "alfworld")
    assert str(e) == (f"{path}: line 8 column 18: the JSON ends mid-record after 300 bytes: the file looks cut short "
                      "(an interrupted download or copy?); fetch it again [malformed_json]")


def test_fireact_native_copy_labelled_webshop():
    path = DERIVED / "fireact_hotpotqa_native.jsonl"
    res = load(path, "native", "searchqa", skip_invalid=True)
    assert res.report.counts == {"benchmark_mismatch": 500}
    assert res.report.examples["benchmark_mismatch"][0] == (
        f"{path}: line 1 (id=fireact_hotpotqa_0): field benchmark: record is for benchmark 'webshop', but "
        "--benchmark is 'searchqa' [benchmark_mismatch]")
    # taken at its label, finish[…] is no WebShop action
    e = refused(path, "native", "webshop")
    assert (e.location, e.field, e.reason) == ("line 1 (id=fireact_hotpotqa_0)", "turns[1].response",
                                               "not_benchmark_action")
    assert "action 'finish[Badr Hari]' is not a WebShop action (search[…] or click[…])" in str(e)


# ------------------------------------------------------------------------------ derived: one-change variations


def test_alfworld_variations_each_read_or_refused_for_its_reason():
    path = DERIVED / "variations_eto_alfworld.json"
    res = load(path, "eto", "alfworld", skip_invalid=True)
    by_id = {t.id: t for t in res.trajectories}
    assert list(by_id) == ["V01_system_message_first", "V02a_ack_OK.", "V02b_ack_Ok.", "V02c_ack_OK. I'",
                           "V03_missing_thought_trailing_space", "V04_multiline_thought_action_on_next_line",
                           "V09_unicode", "V10_final_observation", "7", "V15_dup", "V17_task_on_next_line",
                           "V18_agentgym_available_actions_after_task", "V20_already_tagged_response"]
    assert res.report.counts == {"text_after_action": 3, "empty_action": 3, "bad_turn_order": 1,
                                 "duplicate_id": 1, "missing_field": 1, "special_token": 1}
    assert res.records_read == 23 and res.valid_records == 13
    for t in by_id.values():
        assert t.task == "put a toiletpaper in toiletpaperhanger." and len(t.turns) == 5
        assert t.turns[0].observation == ROOM_TOILET
    assert by_id["V01_system_message_first"].metadata["system"] == "You are a helpful assistant."
    for v in ("V02a_ack_OK.", "V02b_ack_Ok.", "V02c_ack_OK. I'"):
        assert by_id[v].metadata["instruction"].startswith("Interact with a household")
    assert by_id["V03_missing_thought_trailing_space"].turns[0].response == \
        "<think></think>\n<action>go to toiletpaperhanger 1</action>"
    assert by_id["V04_multiline_thought_action_on_next_line"].turns[0].response == (
        "<think>I need to place a toilet paper roll on the hanger.\n\nFirst, check the hanger.</think>\n"
        "<action>go to toiletpaperhanger 1</action>")
    assert by_id["V09_unicode"].turns[0].response == ("<think>The caf\u00e9\u2019s hanger \u2014 I\u2019ll check it "
                                                      "first \U0001f9fb</think>\n<action>go to toiletpaperhanger 1"
                                                      "</action>")
    assert by_id["V09_unicode"].turns[1].observation == ("On the toiletpaperhanger 1, you see nothing. "
                                                         "\u00a0\u2003(\u7a7a)")
    assert by_id["V10_final_observation"].final_observation == ("You put the toiletpaper 1 in/on the "
                                                                "toiletpaperhanger 1.")
    assert by_id["V18_agentgym_available_actions_after_task"].turns[0].admissible_actions == [
        "go to bathtubbasin 1", "go to toilet 1", "go to toiletpaperhanger 1", "inventory", "look"]
    assert by_id["V20_already_tagged_response"].turns[0].response == \
        "<think>I need the hanger.</think>\n<action>go to toiletpaperhanger 1</action>"
    examples = {ex.split(": field ")[0].split("(id=")[1].rstrip(")"): ex
                for exs in res.report.examples.values() for ex in exs}
    assert "an 'Observation:' the model wrote itself follows the action ('Observation: On the toiletpaperhanger 1, " \
           "you see nothing.')" in examples["V05_hallucinated_observation_after_action"]
    assert "a second 'Action:' line follows ('Action: go to toilet 1')" in examples["V06_two_action_lines"]
    assert "no 'Action:' line, only 'action:'" in examples["V07_lowercase_keywords"]
    assert "no 'Action:' line, only 'ACTION:'" in examples["V07b_uppercase_keywords"]
    assert "field conversations[5].from: two human messages in a row" in examples["V11_two_human_in_a_row"]
    assert "the 'Action:' line is empty [empty_action]" in examples["V12_empty_action"]
    assert "another Thought/Action follows" in examples["V13_two_thought_action_pairs"]
    assert "trajectory id 'V15_dup' already read at" in examples["V15_dup"]
    assert "field conversations[4].value: field 'value' is null" in examples["V16_null_value"]
    assert "holds the chat-template token '<|im_end|>'" in examples["V19_leaked_special_token"]
    assert res.report.lines()[-4:] == ["  text_after_action: 3 records"] + [
        f"    e.g. {examples[i]}" for i in ("V05_hallucinated_observation_after_action", "V06_two_action_lines",
                                            "V13_two_thought_action_pairs")]


def test_webshop_variations():
    res = load(DERIVED / "variations_eto_webshop.json", "eto", "webshop")
    by_id = {t.id: t for t in res.trajectories}
    assert len(by_id) == 7 and all(t.task == WEBSHOP_TASK and len(t.turns) == 4 for t in by_id.values())
    assert [by_id[i].success for i in ("W01_reward_1.0", "W02_reward_0.75", "W03_reward_string")] == [True, False, True]
    assert by_id["W03_reward_string"].metadata["reward"] == "1.0"  # kept as recorded
    assert by_id["W04_action_name_contains_Action:"].turns[0].action == "search[marvel Action: figure 6 inch]"
    assert by_id["W05_instruction_pair_first"].metadata["instruction"].startswith("You are web shopping.")
    assert by_id["W06_agentgym_obs_no_Observation_prefix"].turns[0].observation == \
        f"WebShop [SEP] Instruction: [SEP] {WEBSHOP_TASK} [SEP] Search"


# ------------------------------------------------------------------------------ the command line


def test_cli_auto_format_and_convert_permissions(tmp_path, tokenizer):
    tok_dir = tmp_path / "tok"
    tokenizer.save_pretrained(str(tok_dir))
    cmd = [sys.executable, "-m", "sapd.cli"]
    res = subprocess.run([*cmd, "build-prefixes", "--input", str(DERIVED / "variations_eto_alfworld.json"),
                          "--format", "auto", "--benchmark", "alfworld", "--tokenizer", str(tok_dir),
                          "--out", str(tmp_path / "p"), "--skip-invalid", "--no-progress"],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert "format: auto → eto (records have 'id' and 'conversations')\n" in res.stdout
    assert "records read: 23 = 13 valid + 10 invalid\n" in res.stdout and "trajectories: 13 " in res.stdout
    assert "  text_after_action: 3 records\n" in res.stdout
    out = tmp_path / "native.jsonl"
    old = os.umask(0o022)
    try:
        res = subprocess.run([*cmd, "convert", "--input", str(LTSURE_ALF), "--format", "auto", "--benchmark",
                              "alfworld", "--out", str(out)], capture_output=True, text=True, timeout=120)
    finally:
        os.umask(old)
    assert res.returncode == 0, res.stderr
    assert res.stdout.splitlines()[:3] == ["format: auto → eto (records have 'id' and 'conversations')",
                                          "records read: 6 = 6 valid + 0 invalid (skipped)",
                                          f"wrote 6 trajectories to {out}"]
    assert out.stat().st_mode & 0o777 == 0o644
    res = subprocess.run([*cmd, "build-prefixes", "--input", str(LTSURE_ALF), "--format", "eto", "--benchmark",
                          "searchqa", "--tokenizer", str(tok_dir), "--out", str(tmp_path / "q"), "--no-progress"],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and "record 0 (id=alfworld_0)" in res.stderr
    assert "reads like alfworld data" in res.stderr
    assert not (tmp_path / "q" / "_MANIFEST.json").exists()
