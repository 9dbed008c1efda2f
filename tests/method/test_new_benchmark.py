""""A benchmark is one registration", end to end: a toy benchmark (corridors to walk east) is added the way
docs/guides/new-benchmark.md says — one :class:`~sapd.method.benchmarks.BenchmarkSpec` and a tiny environment
adapter with its panel, registered from this file as a module of one's own would — and then used through the
real entry points only: ``sapd init --benchmark toy`` writes its starter, ``sapd collect-expert`` plays its panel,
``sapd convert`` tells its recorded data by the spec's fingerprints and command language, ``sapd check`` loads
the starter once its paths are filled in and passes (the data check included), ``sapd run`` trains a round on
the collected records and ``sapd evaluate`` plays the panel with the checkpoint. The guide shows this file's code,
line for line. The five built-in benchmarks are held to the same spec: each chart overlay sets what its
benchmark's spec says, and each spec's extra is one of pyproject's."""

from __future__ import annotations

import json
import random
import re
import tomllib
from functools import partial
from pathlib import Path

import pytest
import yaml

from sapd.cli import main
from sapd.entry import EXIT_OK, EXIT_USER_ERROR
from sapd.envs.base import EpisodeSpec, StepInfo, StepResult
from sapd.envs.panels import PANELS, Panel, PanelSpec, episode_specs, register_panel
from sapd.method.benchmarks import BENCHMARKS, BenchmarkSpec, Starter, register_benchmark
from tests.pipeline_util import make_models

REPO = Path(__file__).resolve().parents[2]

# --------------------------------------------------------------------------------------------------
# the toy benchmark, as docs/guides/new-benchmark.md writes it

TOY = BenchmarkSpec(
    name="toy", decision="action", horizon=8, history_length=2,
    intro="You are an expert agent walking a toy corridor.",
    action_hint="Once you've finished your reasoning, choose an admissible action and present it within "
                "<action> </action> tags.",
    starter=Starter(format="native", example="toy_expert.jsonl",
                    what="`sapd collect-expert --benchmark toy` records",
                    before="\n# Toy corridors, walked by their expert first:\n"
                           "#   sapd collect-expert --benchmark toy --split easy --out toy_expert.jsonl\n"),
    fingerprints=("Welcome to the toy corridor",),
    commands=r"^(?:go (?:east|west)|look)$", commands_hint="a toy command (go east, go west, look)",
    splits=("easy", "hard"))

ACTIONS = ["go east", "go west", "look"]


class Corridor:
    """Rooms 1…length in a row; the episode is won in the last room. Its expert always goes east."""

    benchmark = "toy"

    def __init__(self, length: int) -> None:
        self.length, self.room = length, 1

    def reset(self, seed: int | None = None) -> StepInfo:
        self.room = 1
        return StepInfo(observation=f"Welcome to the toy corridor! You are in room 1 of {self.length}.",
                        task=f"reach room {self.length}.", admissible_actions=ACTIONS)

    def step(self, action: str) -> StepResult:
        self.room = self.room + 1 if action == "go east" else max(1, self.room - (action == "go west"))
        won = self.room == self.length
        return StepResult(observation=f"You are in room {self.room} of {self.length}.", reward=float(won),
                          done=won, won=won, admissible_actions=ACTIONS)

    def expert_action(self) -> str | None:
        return "go east"

    def close(self) -> None:
        pass


def corridors(panel: PanelSpec) -> list[EpisodeSpec]:
    """``limit`` corridors (default 4) of the split's lengths, drawn by ``seed``."""
    split = {"dev": "easy", "test": "hard"}.get(panel.split, panel.split)
    if split not in ("easy", "hard"):
        raise ValueError(f"toy: --split {panel.split!r}: expected easy (dev) or hard (test)")
    rng = random.Random(panel.seed)
    lengths = [rng.choice((2, 3) if split == "easy" else (4, 5)) for _ in range(panel.limit or 4)]
    return [EpisodeSpec(f"toy/{split}-{i}", partial(Corridor, n), category=f"length-{n}")
            for i, n in enumerate(lengths)]


@pytest.fixture
def toy():
    """The toy registered as a user's module registers it (the guide's section 4), and gone afterwards."""
    register_benchmark(TOY)
    register_panel("toy", Panel(corridors, identity=("split",), split_aliases={"dev": "easy", "test": "hard"}))
    yield TOY
    BENCHMARKS.pop("toy")
    PANELS.pop("toy")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return make_models(tmp_path_factory.mktemp("models"))


# --------------------------------------------------------------------------------------------------
# the guide's steps, through the real entry points


def _eto(first: str, actions: list[str]) -> list[dict]:
    """One ETO-style conversation: instruction, acknowledgement, then observation / Thought-Action turns."""
    msgs = [{"from": "human", "value": "Walk the corridor, one command per turn."}, {"from": "gpt", "value": "OK"},
            {"from": "human", "value": first}]
    for i, action in enumerate(actions):
        msgs += [{"from": "gpt", "value": f"Thought: step {i + 1}.\nAction: {action}"},
                 {"from": "human", "value": f"Observation: You are in room {i + 2} of 3."}]
    return [{"id": "corridor-1", "conversations": msgs}]


def _init_and_collect(tmp_path: Path, models: tuple[str, str]) -> tuple[Path, str, Path]:
    """The guide's section 5 up to `sapd check`: the starter, expert records of the easy corridors, the
    starter's three paths filled in. (config, the starter's text, the records)."""
    config, data = tmp_path / "toy.yaml", tmp_path / "toy_expert.jsonl"
    assert main(["init", "--benchmark", "toy", "--out", str(config)]) == 0
    text = config.read_text()
    assert main(["collect-expert", "--benchmark", "toy", "--split", "easy", "--limit", "3", "--out", str(data),
                 "--no-progress"]) == 0
    student, teacher = models
    config.write_text(text.replace("PATH/TO/toy_expert.jsonl", str(data))
                      .replace("PATH/TO/student-model", student).replace("PATH/TO/teacher-model", teacher))
    return config, text, data


def test_a_toy_benchmark_is_one_spec_and_one_adapter(toy, models, tmp_path, capsys):
    # sapd init writes its starter (the spec's format, example, lines to run first and round size), sapd
    # collect-expert plays the panel (each environment in its own process, as by default)
    config, text, data = _init_and_collect(tmp_path, models)
    assert "a starter for toy" in text and "sapd collect-expert --benchmark toy --split easy" in text
    starter = yaml.safe_load(text)
    assert starter["data"] == {"input": "PATH/TO/toy_expert.jsonl", "format": "native", "benchmark": "toy"}
    assert starter["train"]["trajectories_per_round"] == 16 and starter["run_root"] == "runs/toy"

    # its panel builds, and records its split by the name the panel reads (test → hard)
    panel = PanelSpec("toy", split="test", limit=3, seed=1)
    assert [s.id for s in episode_specs(panel)] == ["toy/hard-0", "toy/hard-1", "toy/hard-2"]
    assert panel.recorded_split() == "hard" and panel.identity() == {"seed": 1, "games_per_family": 2, "split": "hard"}
    assert panel.identity_of({"seed": 1, "games_per_family": 2, "split": "test"}) == panel.identity()

    out = capsys.readouterr().out
    assert "wrote 3 expert trajectories" in out and "expert success 1.00" in out, out
    records = [json.loads(line) for line in data.read_text().splitlines()]
    assert len(records) == 3 and all(r["benchmark"] == "toy" and r["success"] for r in records)
    assert records[0]["turns"][0]["response"].endswith("<action>go east</action>")

    # recorded data is told by the spec's fingerprints and its command language (sapd convert reads it)
    eto = tmp_path / "corridor_eto.json"
    eto.write_text(json.dumps(_eto("Welcome to the toy corridor! You are in room 1 of 3.\n"
                                   "Your task is to: reach room 3.", ["go east", "go east"])))
    assert main(["convert", "--input", str(eto), "--format", "eto", "--benchmark", "toy",
                 "--out", str(tmp_path / "converted.jsonl")]) == 0
    capsys.readouterr()
    assert main(["convert", "--input", str(eto), "--format", "eto", "--benchmark", "alfworld",
                 "--out", str(tmp_path / "wrong.jsonl")]) == EXIT_USER_ERROR
    err = capsys.readouterr().err
    assert "reads like toy data ('Welcome to the toy corridor')" in err and "--benchmark toy meant?" in err
    teleport = tmp_path / "teleport_eto.json"
    teleport.write_text(json.dumps(_eto("You are in room 1 of 3.\nYour task is to: reach room 3.", ["teleport"])))
    assert main(["convert", "--input", str(teleport), "--format", "eto", "--benchmark", "toy",
                 "--out", str(tmp_path / "t.jsonl")]) == EXIT_USER_ERROR
    assert "is not a toy command (go east, go west, look)" in capsys.readouterr().err

    # the starter, its paths filled in, loads and passes every check of sapd check, the data check included
    assert main(["check", str(config), "--run-root", str(tmp_path / "run")]) == EXIT_OK
    out = capsys.readouterr().out
    assert "benchmark toy" in out and "(3 trajectories, toy)" in out, out
    assert any(line.startswith("check data: ok") for line in out.splitlines()), out


def test_the_toy_trains_and_is_evaluated_on_its_panel(toy, models, tmp_path, capsys):
    """The rest of section 5: `sapd run` (one small round over the starter) and `sapd evaluate` on the
    default split, which the toy reads, and the evaluation records, as hard."""
    config, _, _ = _init_and_collect(tmp_path, models)
    small = tmp_path / "small.yaml"
    small.write_text("sampling: {group_size: 2, max_new_tokens: 8}\n"
                     "train: {rounds: 1, trajectories_per_round: 2, minibatch_prefixes: 4, micro_batch_prefixes: 2}\n")
    run = tmp_path / "run"
    assert main(["run", str(config), str(small), "--run-root", str(run), "--no-progress"]) == 0
    assert main(["evaluate", "--run", str(run), "--benchmark", "toy", "--limit", "2", "--max-new-tokens", "8",
                 "--horizon", "3", "--no-progress"]) == 0
    result = json.loads((run / "evals" / "000001" / "toy.json").read_text())
    assert result["benchmark"] == "toy" and result["split"] == "hard" and result["overall"]["episodes"] == 2
    assert set(result["by_category"]) <= {"length-4", "length-5"}


def test_a_spec_is_checked_when_it_is_registered(toy):
    for bad, says in ((TOY, "registered already"),
                      (BenchmarkSpec("Toy 2", "action", 8, 2, "x", "y", TOY.starter), "lowercase letters"),
                      (BenchmarkSpec("toy2", "shout", 8, 2, "x", "y", TOY.starter), "decision 'shout'"),  # type: ignore[arg-type]
                      (BenchmarkSpec("toy2", "action", 8, 2, "x", "y", TOY.starter, commands="(go"),
                       "not a regular expression")):
        with pytest.raises(ValueError, match=says):
            register_benchmark(bad)
    with pytest.raises(ValueError, match="register its spec first"):
        register_panel("nowhere", Panel(corridors))
    with pytest.raises(ValueError, match="has a panel already"):
        register_panel("toy", Panel(corridors))
    assert "toy2" not in BENCHMARKS


def test_the_guide_shows_this_toy():
    """The guide's code is this file's: every line of its spec, adapter and panel blocks (imports and
    comments aside) is a line here, so the steps tested are the steps shown."""
    guide = (REPO / "docs/guides/new-benchmark.md").read_text()
    here = {line.strip() for line in Path(__file__).read_text().splitlines()}
    blocks = re.findall(r"```python\n(.*?)```", guide, flags=re.S)
    shown = [line.strip() for block in blocks if "sapd.cli" not in block for line in block.splitlines()
             if line.strip() and not line.strip().startswith(("#", "from ", "import "))]
    assert len(shown) > 40 and [line for line in shown if line not in here] == []


# --------------------------------------------------------------------------------------------------
# the built-in benchmarks hold to their specs


def _flat(tree: dict, prefix: str = "") -> dict[str, object]:
    out: dict[str, object] = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def test_every_chart_overlay_agrees_with_its_benchmarks_spec():
    """An overlay sets the run root, the data and the models, and otherwise exactly what the spec says: the
    starter's format and round size where they differ from the chart's defaults, and the spec's overlay values."""
    base = _flat(yaml.safe_load((REPO / "charts/sapd/values.yaml").read_text()))
    seen = []
    for path in sorted((REPO / "charts/sapd/values").glob("*.yaml")):
        values = _flat(yaml.safe_load(path.read_text()))
        name = values.get("config.data.benchmark")
        if path.stem != name:  # smoke.yaml: sizes for a CPU cluster, layered before a benchmark's overlay
            continue
        spec = BENCHMARKS[path.stem]
        expected: dict[str, object] = {"config.data.benchmark": spec.name, **dict(spec.overlay)}
        if spec.starter.format != base["config.data.format"]:
            expected["config.data.format"] = spec.starter.format
        if spec.starter.trajectories_per_round != base.get("config.train.trajectories_per_round", 16):
            expected["config.train.trajectories_per_round"] = spec.starter.trajectories_per_round
        own = {k: v for k, v in values.items()
               if k not in ("runRoot", "config.data.input") and not k.startswith("config.model.")}
        assert own == expected, path.name
        seen.append(path.stem)
    assert seen == ["alfworld", "searchqa", "textworld", "webshop"]


def test_every_benchmarks_extra_is_a_pyproject_extra():
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert {name: spec.extra for name, spec in BENCHMARKS.items()} == {
        "alfworld": "alfworld", "webshop": None, "textworld": "textworld", "scienceworld": "scienceworld",
        "searchqa": "searchqa"}
    assert all(spec.extra in extras for spec in BENCHMARKS.values() if spec.extra is not None)
