"""Search QA for real over loopback: the BM25 retriever server (Search-R1 /retrieve API) on a small
corpus the test writes, the search-QA environment, and the agent loop over the sample Search-R1 rows."""

from __future__ import annotations

import json
import re
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from sapd.data.errors import InvalidRecordError
from sapd.data.loaders import LoadOptions, load_trajectories
from sapd.envs.base import Environment
from sapd.envs.loop import LoopOptions, run_episodes, summarize
from sapd.envs.retriever import (
    RetrieverClient,
    RetrieverError,
    format_passages,
    load_corpus,
    start_retriever,
    stop_retriever,
)
from sapd.envs.searchqa import INVALID_OBSERVATION, SearchQAEnv, exact_match_by_source, read_questions, searchqa_specs
from sapd.models.generation import Sample
from tests.tokenizer_util import SAMPLE_DATA, build_test_tokenizer

ROWS = SAMPLE_DATA / "searchqa_searchr1.jsonl"
_DOC = re.compile(r"^Doc \d+ ?\(Title: (\".*?\")\) (.*)$")

# distractors sharing words with the questions, so that ranking has something to get wrong
DISTRACTORS = [
    ("Sea", "The sea is the interconnected body of salt water that covers over 70 percent of the Earth."),
    ("Old age", "Old age is the range of ages for people nearing the end of the human life span."),
    ("Novel", "A novel is a relatively long work of narrative fiction, typically written in prose."),
    ("The Man Who Would Be King", "The Man Who Would Be King is an 1888 story by Rudyard Kipling."),
    ("University of Cambridge", "The University of Cambridge is a public research university in Cambridge, "
                                "England, founded in 1209."),
    ("Professor", "A professor is an academic rank at universities and other post-secondary institutions."),
    ("Solar System", "The Solar System is the gravitationally bound system of the Sun and the objects that "
                     "orbit it, including eight planets."),
    ("Jupiter", "Jupiter is the fifth planet from the Sun and the largest in the Solar System."),
    ("Venus", "Venus is the second planet from the Sun, sometimes called Earth's sister planet."),
    ("Red Sea", "The Red Sea is a seawater inlet of the Indian Ocean lying between Africa and Asia."),
    ("Mumbai", "Mumbai is the capital city of the Indian state of Maharashtra and a financial centre."),
    ("Thames", "The River Thames flows through southern England, including London, the capital of the "
               "United Kingdom."),
    ("Seine", "The Seine is a river in northern France that flows through Paris, the capital of France."),
    ("Nile", "The Nile is a major north-flowing river in northeastern Africa, flowing through Cairo."),
    ("Mahal (film)", "Mahal is a 1949 Indian Hindi-language horror film."),
    ("Hobbit (disambiguation)", "Hobbit may refer to the fictional race or to several video games."),
    ("Oxford English Dictionary", "The Oxford English Dictionary is the principal historical dictionary "
                                  "of the English language."),
    ("Leeds", "Leeds is a city in West Yorkshire, England, home to the University of Leeds."),
    ("Marlin", "Marlins are fish with an elongated body, a spear-like snout and a long rigid dorsal fin."),
    ("Cuba", "Cuba is an island country in the Caribbean; its capital is Havana."),
]
# the answer to the one sample question whose recorded episode did not search
MARS = ("Mars", "Mars is the fourth planet from the Sun. The iron oxide of its surface gives it a reddish look, "
                "hence its name, the Red Planet.")


def _sample_passages() -> list[tuple[str, str]]:
    """(quoted title, text) of every passage recorded in the sample rows' <information> blocks."""
    out: dict[str, str] = {}
    for line in ROWS.read_text(encoding="utf-8").splitlines():
        for block in re.findall(r"<information>(.*?)</information>", json.loads(line)["response"], re.S):
            for doc in block.strip().splitlines():
                m = _DOC.match(doc)
                assert m, doc
                out.setdefault(m.group(1), m.group(2))
    return list(out.items())


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    rows = [{"id": f"s{i}", "contents": f"{title}\n{text}"} for i, (title, text) in enumerate(_sample_passages())]
    rows += [{"id": f"d{i}", "title": title, "text": text} for i, (title, text) in enumerate([*DISTRACTORS, MARS])]
    path = tmp_path_factory.mktemp("corpus") / "corpus.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    assert 20 <= len(rows) <= 50
    return path


@pytest.fixture(scope="module")
def retriever(corpus):
    server, thread, url = start_retriever(corpus)
    yield url
    stop_retriever(server, thread)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return build_test_tokenizer(tmp_path_factory.mktemp("tok"))


def _post(url: str, payload) -> tuple[int, dict]:
    body = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
    req = urllib.request.Request(url + "/retrieve", data=body, method="POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


# ---------------------------------------------------------------------------------------------------
# the server


def test_server_listens_on_loopback_and_reports_health(retriever, corpus):
    assert retriever.startswith("http://127.0.0.1:")
    n = sum(1 for line in corpus.read_text().splitlines() if line.strip())
    assert RetrieverClient(retriever).health() == {"status": "ok", "documents": n, "retriever": "bm25"}


def test_retrieve_response_shape_and_ranking(retriever, corpus):
    status, data = _post(retriever, {"queries": ["who wrote the novel the old man and the sea?", "Red Planet"],
                                     "topk": 3, "return_scores": True})
    assert status == 200 and set(data) == {"result"}
    assert [len(r) for r in data["result"]] == [3, 3]
    for hits in data["result"]:
        for hit in hits:
            assert set(hit) == {"document", "score"} and set(hit["document"]) == {"id", "contents"}
            assert isinstance(hit["score"], float) and isinstance(hit["document"]["id"], str)
        assert [h["score"] for h in hits] == sorted((h["score"] for h in hits), reverse=True)
    first = [hits[0]["document"]["contents"].split("\n")[0] for hits in data["result"]]
    assert first == ['"The Old Man and the Sea"', '"Mars"']
    # without scores: bare documents, as Search-R1's server answers
    status, data = _post(retriever, {"queries": ["capital of India"], "topk": 2, "return_scores": False})
    assert status == 200 and [set(d) for d in data["result"][0]] == [{"id", "contents"}] * 2
    assert data["result"][0][0]["contents"].startswith('"New Delhi"\n')
    # title/text rows get the quoted-title contents; topk past the corpus size gives the whole corpus
    status, data = _post(retriever, {"queries": ["Thames London"], "topk": 1000})
    assert status == 200 and data["result"][0][0]["contents"].startswith('"Thames"\n')
    assert len(data["result"][0]) == len({d["id"] for d in data["result"][0]}) == len(load_corpus(corpus))


@pytest.mark.parametrize("payload, message", [
    (b"not json", "not JSON"),
    ({"topk": 3}, "'queries' must be a list"),
    ({"queries": []}, "'queries' is empty"),
    ({"queries": ["ok", "  "]}, "queries[1] is empty"),
    ({"queries": [3]}, "queries[0] is a int"),
    ({"queries": ["mars"], "topk": 0}, "'topk' must be an integer >= 1"),
    ({"queries": ["mars"], "topk": "3"}, "'topk' must be an integer >= 1"),
])
def test_bad_requests_are_400_with_a_json_error(retriever, payload, message):
    status, data = _post(retriever, payload)
    assert status == 400 and message in data["error"]


def test_client_formats_passages_as_search_r1(retriever):
    client = RetrieverClient(retriever, topk=3)
    info = client.information("who wrote the novel the old man and the sea?")
    # the recorded nq row: each "Doc i(Title: …) …" line of ours is one the sample recorded for this query
    recorded = re.search(r"<information>(.*?)</information>", json.loads(ROWS.read_text().splitlines()[0])["response"],
                         re.S).group(1)
    assert info.splitlines()[0] == recorded.strip().splitlines()[0]
    assert [ln[:6] for ln in info.splitlines()] == ["Doc 1(", "Doc 2(", "Doc 3("]
    assert format_passages(client.search("Mars")) == client.information("Mars") + "\n"
    with pytest.raises(RetrieverError, match="HTTP 400"):
        client.search("   ")
    with pytest.raises(RetrieverError, match="unreachable"):
        RetrieverClient("http://127.0.0.1:9", timeout=2).search("mars")


def test_bad_corpus_rows_name_file_line_and_field(tmp_path):
    cases = [('{"id": 1, "contents": "\\"T\\"\\nx"}\n{"id": 2, "title": "T"}\n', "line 2: field text"),
             ('{"id": 1, "contents": "\\"T\\"\\nx"}\n{broken\n', "line 2: malformed JSON"),
             ('{"id": 1, "contents": ""}\n', "line 1: field contents"),
             ('{"id": 1, "contents": "a"}\n{"id": 1, "contents": "b"}\n', "line 2: field id: id '1' already"),
             ("\n", "no rows")]
    for i, (text, message) in enumerate(cases):
        path = tmp_path / f"c{i}.jsonl"
        path.write_text(text)
        with pytest.raises(InvalidRecordError, match=re.escape(message)) as e:
            load_corpus(path)
        assert str(path) in str(e.value)


# ---------------------------------------------------------------------------------------------------
# the environment


def _env(url: str, golden=("Ernest Hemingway", "Hemingway")) -> SearchQAEnv:
    return SearchQAEnv("who wrote the novel the old man and the sea?", list(golden), RetrieverClient(url), "nq", "q1")


def test_env_search_then_answer_scores_exact_match(retriever):
    env = _env(retriever)
    assert isinstance(env, Environment)
    first = env.reset()
    assert (first.observation, first.task, first.admissible_actions, first.category) == (
        "", "who wrote the novel the old man and the sea?", None, "nq")
    res = env.step_response("<think>I should search.</think>\n<search> novel The Old Man and the Sea </search>")
    assert (res.reward, res.done, res.won) == (0.0, False, False)
    assert res.observation.startswith('Doc 1(Title: "The Old Man and the Sea") ')
    res = env.step_response("<think>It says Hemingway.</think>\n<answer> the  Hemingway! </answer>")
    assert (res.reward, res.done, res.won, res.observation) == (1.0, True, True, "")
    with pytest.raises(RuntimeError, match="after the answer"):
        env.step("more")


def test_env_wrong_answer_and_invalid_response(retriever):
    env = _env(retriever)
    env.reset()
    res = env.step_response("<think>hm</think> no tags here")
    assert res.observation == INVALID_OBSERVATION and not res.done
    res = env.step_response("<search> a <answer> b </answer>")  # both kinds before the first close: invalid
    assert res.info["kind"] == "invalid"
    assert env.step("Ernest Hemingway").observation.startswith("Doc 1(Title: ")  # plain step = a search
    res = env.answer("Mark Twain")
    assert (res.reward, res.done, res.won) == (0.0, True, False)


# ---------------------------------------------------------------------------------------------------
# the agent loop


class ScriptedSearcher:
    """A Generator answering each episode (found by the question in its prompt) with its script."""

    def __init__(self, scripts: dict[str, list[str]]) -> None:
        self.scripts = scripts
        self.step = 0
        self.prompts: list[str] = []

    def generate(self, prompts, params, progress=None):
        out = []
        for p in prompts:
            q = next(q for q in self.scripts if f"Question: {q}\n" in p)
            script = self.scripts[q]
            text = script[min(self.step, len(script) - 1)]
            self.prompts.append(p)
            out.append([Sample(token_ids=[], logprobs=[], text=text, finish_reason="stop")])
        self.step += 1
        return out


def test_agent_loop_over_sample_rows_gives_em_per_source(retriever, tokenizer):
    recorded = load_trajectories(str(ROWS), "searchr1", LoadOptions(benchmark="searchqa")).trajectories
    specs = searchqa_specs(ROWS, retriever)
    assert [s.id for s in specs] == [t.id for t in recorded]
    assert [s.category for s in specs] == ["nq", "hotpotqa", "triviaqa", "bamboogle"]
    # the recorded responses: nq / hotpotqa / triviaqa answer right, bamboogle says "Ganges" (gold: Yamuna)
    gen = ScriptedSearcher({t.task: [turn.response for turn in t.turns] for t in recorded})
    trajs = run_episodes(specs, gen, tokenizer, "searchqa")
    by_id = {t.id: t for t in trajs}
    for rec in recorded:
        got = by_id[rec.id]
        assert [turn.action for turn in got.turns] == [turn.action for turn in rec.turns]
        assert got.success == rec.success and got.metadata["end_reason"] == "done"
        assert got.metadata["question_id"] == rec.id
        assert json.loads(got.metadata["golden_answers"]) == rec.metadata["golden_answers"]
    hp = by_id["hotpotqa_train_2310"]
    assert hp.turns[1].observation.startswith('Doc 1(Title: "The Hobbit") ')
    assert hp.turns[2].observation.startswith('Doc 1(Title: "J. R. R. Tolkien") ')
    assert any("Question: The author of the novel The Hobbit" in p and
               "[Search 1: 'author of The Hobbit', Information 1: Doc 1(Title: \"The Hobbit\")" in p
               for p in gen.prompts)
    em = exact_match_by_source(trajs)
    assert {s: v["em"] for s, v in em["by_source"].items()} == {"nq": 1.0, "hotpotqa": 1.0, "triviaqa": 1.0,
                                                                  "bamboogle": 0.0}
    assert em["average"] == 0.75 and em["questions"] == 4
    assert {c: v["success"] for c, v in summarize(trajs)["by_category"].items()} == {
        s: v["em"] for s, v in em["by_source"].items()}


def test_agent_loop_horizon_and_invalid_responses(retriever, tokenizer):
    specs = searchqa_specs(ROWS, retriever, limit=2)
    gen = ScriptedSearcher({
        "who wrote the novel the old man and the sea?": ["<think>a</think> I forgot the tags",
                                                          "<think>b</think><search> Hemingway </search>"],
        "The author of the novel The Hobbit held a professorship at which university?":
            ["<think>c</think><search> The Hobbit </search>"]})
    trajs = run_episodes(specs, gen, tokenizer, "searchqa")
    assert [len(t.turns) for t in trajs] == [4, 4]  # never answered: the search-QA horizon
    assert all(t.metadata["end_reason"] == "horizon" and not t.success for t in trajs)
    nq = trajs[0]
    assert nq.metadata["invalid_steps"] == 1 and nq.turns[1].observation == INVALID_OBSERVATION
    assert nq.turns[2].observation.startswith("Doc 1(Title: ")
    assert exact_match_by_source(trajs)["average"] == 0.0


class FlakyClient(RetrieverClient):
    """Fails its ``fail_at``-th search (1-based) once, like a retriever that drops a connection."""

    def __init__(self, url: str, fail_at: int | None) -> None:
        super().__init__(url)
        self.fail_at, self.calls = fail_at, 0

    def search_batch(self, queries, topk=None):
        self.calls += 1
        if self.calls == self.fail_at:
            raise RetrieverError("connection reset (injected)")
        return super().search_batch(queries, topk)


def test_agent_loop_retries_a_failing_retriever_then_records_the_failure(retriever, tokenizer):
    from sapd.envs.loop import EpisodeSpec

    q = read_questions(ROWS, limit=2)[1]  # hotpotqa: two searches, then the answer
    flaky = FlakyClient(retriever, fail_at=2)  # shared by the rebuilt environments, as searchqa_specs does
    dead = RetrieverClient("http://127.0.0.1:9", timeout=2)
    specs = [EpisodeSpec("flaky", lambda: SearchQAEnv(q.question, q.golden_answers, flaky, q.data_source, q.id)),
             EpisodeSpec("dead", lambda: SearchQAEnv(q.question, q.golden_answers, dead, q.data_source, q.id))]
    script = [t.response for t in load_trajectories(str(ROWS), "searchr1", LoadOptions(benchmark="searchqa"))
              .trajectories[1].turns]
    good, bad = run_episodes(specs, ScriptedSearcher({q.question: script}), tokenizer, "searchqa",
                             opts=LoopOptions(max_env_retries=2))
    # rebuilt once: reset, the first search replayed (same passages), then the failed search again
    assert good.success and good.metadata["env_restarts"] == 1 and good.metadata["end_reason"] == "done"
    assert bad.metadata["end_reason"] == "env_error" and not bad.success
    assert "RetrieverError" in bad.metadata["error"] and "after 2 restart(s)" in bad.metadata["error"]
    assert exact_match_by_source([good, bad])["by_source"]["hotpotqa"]["em"] == 0.5


def test_read_questions_limits(tmp_path):
    qs = read_questions(ROWS)
    assert [(q.id, q.data_source) for q in qs][:2] == [("nq_train_17", "nq"), ("hotpotqa_train_2310", "hotpotqa")]
    assert qs[2].question == "Which planet in our solar system is commonly known as the Red Planet?"
    assert qs[2].golden_answers == ["Mars", "Planet Mars"]
    assert len(read_questions(ROWS, limit=3)) == 3
    assert len(read_questions(ROWS, per_source=1)) == 4
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "x", "data_source": "nq", "question": "q?"}\n')
    with pytest.raises(InvalidRecordError, match="reward_model.ground_truth.target"):
        read_questions(bad)


def test_evaluate_stage_on_search_qa(retriever, tmp_path):
    """`sapd evaluate` end to end on search QA: a committed tiny checkpoint, the real retriever, EM per
    data source in the result (a random tiny model answers nothing right, which is a fine 0.0)."""
    from sapd.config import config_from_dict
    from sapd.envs.panels import PanelSpec
    from sapd.stages.build_prefixes import ensure_initial_checkpoint
    from sapd.stages.evaluate import evaluate_checkpoint
    from tests.pipeline_util import make_models, tiny_config

    student, teacher = make_models(tmp_path / "models")
    cfg = config_from_dict(tiny_config(str(tmp_path / "run"), student, teacher))
    ensure_initial_checkpoint(cfg, lambda s: None)
    panel = PanelSpec("searchqa", rows=str(ROWS), retriever_url=retriever)
    result = evaluate_checkpoint(cfg.run_root, 0, panel, max_new_tokens=16, log=lambda s: None, show_progress=False)
    assert result["overall"]["episodes"] == 4
    assert set(result["exact_match"]["by_source"]) == {"nq", "hotpotqa", "triviaqa", "bamboogle"}
    assert result["overall"]["mean_steps"] <= 4  # the search-QA horizon
