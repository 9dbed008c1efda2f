"""ALFWorld and WebShop adapters against recorded observation transcripts (the sample ETO files):
ALFWorld through a fake textworld-gym backend replaying the record, WebShop through a small fake
WebShop HTTP server on loopback serving pages rebuilt from the recorded observations."""

from __future__ import annotations

import dataclasses
import html
import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote

import pytest

from sapd.data.prefixes import PrefixOptions
from sapd.envs.alfworld_env import AlfworldEnv, alfworld_specs, clean_observation, game_files
from sapd.envs.base import Environment
from sapd.envs.loop import EpisodeSpec, run_episodes
from sapd.envs.webshop_env import HTTPFetcher, WebShopEnv, page_text, parse_page, webshop_specs
from sapd.method.benchmarks import ALFWORLD_CATEGORIES
from tests.envs.test_agent_loop import ScriptedGenerator, _load, assert_replay_matches_prefixes
from tests.tokenizer_util import SAMPLE_DATA, build_test_tokenizer


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return build_test_tokenizer(tmp_path_factory.mktemp("tok"))


def _records(name):
    return json.loads((SAMPLE_DATA / name).read_text())


def _action(gpt_value: str) -> str:
    return gpt_value[gpt_value.rfind("Action:") + len("Action:"):].strip()


# ---------------------------------------------------------------------------------------------------
# ALFWorld


class TranscriptBackend:
    """textworld.gym's non-batched API over one ETO record: the recorded action k gives the recorded
    observation k+1 (as ALFWorld prints it: no "Observation:" prefix); anything else "Nothing happens.";
    the last recorded action wins the game. Admissible commands: the recorded action, look, inventory."""

    def __init__(self, rec):
        ep = rec["conversations"][2:]
        self.first = ep[0]["value"]
        self.actions = [_action(ep[i]["value"]) for i in range(1, len(ep), 2)]
        self.obs = [re.sub(r"^Observation:\s*", "", ep[i]["value"].strip()) for i in range(2, len(ep), 2)]
        self.game_file = rec["game_file"]
        self.t = 0
        self.closed = False

    def _infos(self, won=False):
        adm = ([self.actions[self.t]] if self.t < len(self.actions) else []) + ["look", "inventory"]
        return {"admissible_commands": adm, "won": won, "extra.gamefile": self.game_file}

    def reset(self):
        self.t = 0
        return self.first, self._infos()

    def step(self, cmd):
        if self.t < len(self.actions) and cmd == self.actions[self.t]:
            obs = self.obs[self.t]
            self.t += 1
            won = self.t == len(self.actions)
            return obs, float(won), won, self._infos(won)
        return "Nothing happens.", 0.0, False, self._infos()

    def close(self):
        self.closed = True


def test_alfworld_adapter_replays_the_recorded_transcripts():
    recs = _records("alfworld_eto.json")
    trajs = {t.id: t for t in _load("alfworld_eto.json", "alfworld")}
    cats = set()
    for rec in recs:
        traj = trajs[rec["id"]]
        backend = TranscriptBackend(rec)
        env = AlfworldEnv(rec["game_file"], backend=backend)
        assert isinstance(env, Environment)
        first = env.reset()
        assert (first.observation, first.task, first.category) == (traj.turns[0].observation, traj.task, traj.category)
        assert first.task and not first.observation.endswith(first.task)
        assert first.admissible_actions == [traj.turns[0].action, "look", "inventory"]
        for k, turn in enumerate(traj.turns):
            res = env.step(turn.action)
            if k + 1 < len(traj.turns):
                assert res.observation == traj.turns[k + 1].observation and not res.done and not res.won
            else:
                assert res.observation == traj.final_observation and res.done and res.won and res.reward == 1.0
        cats.add(first.category)
        env.close()
        assert backend.closed
    assert cats == {name for _, name in ALFWORLD_CATEGORIES}  # the six categories


def test_alfworld_wrong_action_and_clean_observation():
    rec = _records("alfworld_eto.json")[0]
    env = AlfworldEnv(rec["game_file"], backend=TranscriptBackend(rec))
    env.reset()
    res = env.step("go to the moon")
    assert (res.observation, res.done, res.won) == ("Nothing happens.", False, False)
    assert clean_observation("Observation: You see a mug 1.") == ("You see a mug 1.", None)
    assert clean_observation("Room.\n\nYour task is to: heat some egg.") == ("Room.", "heat some egg.")


def test_alfworld_through_the_agent_loop_gives_the_prefix_prompts(tokenizer):
    recs = {r["id"]: r for r in _records("alfworld_eto.json")}
    trajs = [dataclasses.replace(t, turns=[dataclasses.replace(u, admissible_actions=[u.action, "look", "inventory"])
                                           for u in t.turns]) for t in _load("alfworld_eto.json", "alfworld")]

    def specs(ts):
        return [EpisodeSpec(t.id, (lambda t=t: AlfworldEnv(recs[t.id]["game_file"], backend=TranscriptBackend(recs[t.id]))))
                for t in ts]

    for popts in (PrefixOptions(), PrefixOptions(prompt_style="chat", history_length=3)):
        got = assert_replay_matches_prefixes(trajs, specs, "alfworld", tokenizer, popts)
        assert [g.category for g in got] == [t.category for t in trajs]
        assert all(g.success for g in got)


def test_alfworld_specs_find_game_files_and_explain_a_missing_folder(tmp_path, monkeypatch):
    with pytest.raises(FileNotFoundError, match="alfworld-download"):
        game_files(tmp_path, "valid_unseen")
    for rec in _records("alfworld_eto.json"):
        p = tmp_path / rec["game_file"].replace("/train/", "/valid_unseen/")
        p.parent.mkdir(parents=True)
        p.write_text('{"solvable": true}')
    skipped = tmp_path / "json_2.1.1/valid_unseen/pick_and_place_with_movable_recep-X-Y-Z-1/trial_1/game.tw-pddl"
    skipped.parent.mkdir(parents=True)
    skipped.write_text('{"solvable": true}')
    specs = alfworld_specs(tmp_path, "test")  # "test" = valid_unseen
    assert len(specs) == 6 and sorted(s.category for s in specs) == sorted(n for _, n in ALFWORLD_CATEGORIES)
    assert all(s.id.startswith("alfworld/") for s in specs)
    assert len(alfworld_specs(tmp_path, "valid_unseen", limit=2)) == 2
    monkeypatch.setenv("ALFWORLD_DATA", str(tmp_path))
    env = specs[0].make_env()  # built lazily: no alfworld import until reset
    assert isinstance(env, AlfworldEnv) and env.backend is None


# ---------------------------------------------------------------------------------------------------
# WebShop: pages rebuilt from the recorded observations, served by a fake WebShop server

NAV = {"[Back to Search]": "Back to Search", "[< Prev]": "< Prev", "[Next >]": "Next >"}
BUTTONS = {"Buy Now", "Description", "Features", "Reviews", "Search"}
OPTION_HEADERS = {"color", "size", "flavor name"}
ASIN = re.compile(r"^B0[A-Z0-9]{8}$")
REWARDS = {1532: 1.0, 4207: 0.75, 9021: 0.5}  # sample_data/README.md


def _html(obs: str, instruction: str | None, score: float | None = None) -> str:
    segs = obs.split(" [SEP] ")
    options: set[int] = set()
    if any(s.startswith("Price: ") for s in segs):  # a product page: values between a header and the title
        title = next(i for i, s in enumerate(segs) if s.startswith("Price: ")) - 1
        in_group = False
        for i, s in enumerate(segs[:title]):
            if s in OPTION_HEADERS:
                in_group = True
            elif in_group:
                options.add(i)
    body = []
    if instruction is not None:  # every page but the first shows the instruction, as WebShop's do
        body.append(f"<div id='instruction-text'><h4>Instruction:<br>{html.escape(instruction)}</h4></div>")
    for i, s in enumerate(segs):
        e = html.escape(s)
        if s in NAV:
            body.append(f"<form><button type='submit' class='btn'>{html.escape(NAV[s])}</button></form>")
        elif s in BUTTONS:
            body.append(f"<button class='btn'>{e}</button>")
        elif ASIN.match(s):
            body.append(f"<h4 class='product-asin'><a class='product-link' href='#'>{e}</a></h4>")
        elif i in options:
            body.append(f"<input type='radio' id='o{i}'><label for='o{i}'>{e}</label>")
        else:
            body.append(f"<p>\n  {e}\n</p>")
    if score is not None:
        body.append(f"<h3 id='reward'>Your score (min 0.0, max 1.0)</h3><h2>{score}</h2>")
    return ("<!DOCTYPE html><html><head><title>WebShop</title><style>.btn{color:red}</style>"
            "<script>var x = 'Buy Now';</script></head><body><!-- a comment -->\n"
            + "\n".join(body) + "\n</body></html>")


def _site(rec) -> dict[tuple[str, str], str]:
    """(page kind, key) → HTML for one recorded goal: the start page, the results, each product, done."""
    ep = rec["conversations"][2:]
    obs = [re.sub(r"^Observation:\s*", "", ep[i]["value"].strip()) for i in range(0, len(ep), 2)]
    acts = [_action(ep[i]["value"]) for i in range(1, len(ep), 2)]
    instr = re.search(r"Instruction: \[SEP\] (.+?) \[SEP\]", obs[0]).group(1)
    pages = {("init", ""): _html(obs[0], None)}
    for a, o in zip(acts, obs[1:]):
        if a.startswith("search["):
            pages[("search", "")] = _html(o, instr)
        elif (m := re.match(r"click\[(B0\w+)\]", a)):
            pages[("item", m.group(1))] = _html(o, instr)
        elif a == "click[Buy Now]":
            pages[("done", "")] = _html(o, instr, REWARDS[rec["id"]])
    return pages


@pytest.fixture(scope="module")
def webshop_server():
    sites = {f"fixed_{r['id']}": _site(r) for r in _records("webshop_eto.json")}
    requests: list[str] = []

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            requests.append(self.path)
            parts = [unquote(p) for p in self.path.strip("/").split("/")]
            if len(parts) == 1:
                key = (parts[0], ("init", ""))
            elif parts[0] == "search_results":
                key = (parts[1], ("search", ""))
            elif parts[0] == "item_page":
                key = (parts[1], ("item", parts[2]))
            elif parts[0] == "done":
                key = (parts[1], ("done", ""))
            else:
                key = ("", ("", ""))
            page = sites.get(key[0], {}).get(key[1])
            body = (page or "not found").encode()
            self.send_response(200 if page else 404)
            self.send_header("Content-Type", "text/html; charset=utf-8")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", requests
    server.shutdown()
    server.server_close()


def test_webshop_adapter_replays_the_recorded_transcripts_over_http(webshop_server):
    url, requests = webshop_server
    for traj in _load("webshop_eto.json", "webshop"):
        goal = int(traj.id)
        env = WebShopEnv(goal, url)
        assert isinstance(env, Environment)
        first = env.reset()
        assert (first.observation, first.task) == (traj.turns[0].observation, traj.task)
        for k, turn in enumerate(traj.turns):
            res = env.step(turn.action)
            if k + 1 < len(traj.turns):
                assert res.observation == traj.turns[k + 1].observation, (goal, k)
                assert not res.done and res.reward == 0.0
            else:
                assert res.done and res.observation.startswith(traj.final_observation)
                assert res.reward == res.score == REWARDS[goal] and res.won == (REWARDS[goal] == 1.0)
    assert "/fixed_1532" in requests
    assert any(r.startswith("/search_results/fixed_1532/") and r.endswith("/1") for r in requests)
    assert any(r.startswith("/item_page/fixed_4207/B01N4H7VZX/") for r in requests)
    assert any(r.startswith("/done/fixed_1532/B09QK7RZ2N/") for r in requests)
    opts = [unquote(r.rsplit("/", 1)[1]) for r in requests if r.startswith("/done/fixed_1532/")]
    assert opts == [str({"color": "blue", "size": "medium"})]


def test_webshop_invalid_actions_keep_the_page_and_actions_are_listed(webshop_server):
    url, _ = webshop_server
    env = WebShopEnv(9021, url, list_actions=True)
    first = env.reset()
    assert first.admissible_actions == ["search[<your query>]"]
    for bad in ("look", "click[Buy Now]", "search[]"):
        res = env.step(bad)
        assert res.observation == first.observation and not res.done and res.info["invalid"]
    res = env.step("search[iphone 13 pro tempered glass screen protector 2 pack]")
    assert "click[B09JT6V3QD]" in res.admissible_actions and "click[Back to Search]" in res.admissible_actions
    assert env.step("search[again]").info["invalid"]  # search only on the search page
    res = env.step("click[b09jt6v3qd]")  # case-insensitive
    assert "click[Buy Now]" in res.admissible_actions
    res = env.step("click[< Prev]")
    assert res.observation.startswith("[Back to Search] [SEP] Page 1")


def test_webshop_through_the_agent_loop_gives_the_prefix_prompts(tokenizer, webshop_server):
    url, _ = webshop_server
    trajs = _load("webshop_eto.json", "webshop")
    for popts in (PrefixOptions(), PrefixOptions(full_history=True)):
        got = assert_replay_matches_prefixes(trajs, lambda ts: webshop_specs(url, goals=[int(t.id) for t in ts]),
                                             "webshop", tokenizer, popts)
        assert [g.metadata["score"] for g in got] == [REWARDS[int(t.id)] for t in trajs]


def test_webshop_injected_fetcher_and_page_parsing(tokenizer):
    rec = _records("webshop_eto.json")[2]
    site = _site(rec)
    paths = []

    def fetch(path):
        paths.append(path)
        kind = "init" if path.count("/") == 1 else {"search_results": "search", "item_page": "item",
                                                    "done": "done"}[path.split("/")[1]]
        key = unquote(path.split("/")[3]) if kind == "item" else ""
        return site[(kind, key)]

    trajs = [t for t in _load("webshop_eto.json", "webshop") if t.id == "9021"]
    got = run_episodes(webshop_specs(goals=[9021], fetch=fetch), ScriptedGenerator(trajs), tokenizer, "webshop")
    assert got[0].metadata["end_reason"] == "done" and got[0].metadata["score"] == 0.5 and not got[0].success
    assert paths[0] == "/fixed_9021" and isinstance(HTTPFetcher("http://x/").base_url, str)
    segs = parse_page("<head><title>t</title></head><body><button>< Prev</button><p> a </p><label>blue</label></body>")
    assert page_text(segs) == "[< Prev] [SEP] a [SEP] blue" and segs[2].kind == "option" and segs[2].group == "a"

