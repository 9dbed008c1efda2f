"""The `sapd` console script as a user runs it: counts on success, exit code 2 and a located error
on bad input, every skipped record reported."""

import json
import subprocess
import sys

import pytest

from tests.tokenizer_util import SAMPLE_DATA, build_test_tokenizer

SAPD = [sys.executable, "-m", "sapd.cli"]


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    build_test_tokenizer(d)
    return str(d)


def run(*args):
    return subprocess.run([*SAPD, *args], capture_output=True, text=True, timeout=120)


def test_build_prefixes_prints_counts_and_is_idempotent(tmp_path, tok_dir):
    out = tmp_path / "prefixes"
    args = ["build-prefixes", "--input", str(SAMPLE_DATA / "alfworld_skillrl.jsonl"), "--format", "skillrl",
            "--benchmark", "alfworld", "--tokenizer", tok_dir, "--out", str(out), "--skip-invalid",
            "--max-prompt-tokens", "100000", "--no-progress"]
    first = run(*args)
    assert first.returncode == 0, first.stderr
    # counts in records (lines): trajectory 2 (lines 5–7) is refused, so 4 valid + 3 invalid = 7 read
    assert "format: skillrl\n" in first.stdout
    assert "records read: 7 = 4 valid + 3 invalid" in first.stdout and "trajectories: 1 " in first.stdout
    assert "  action_not_admissible: 3 records in 1 error\n" in first.stdout and "line 7" in first.stdout
    assert "prefixes: 4 built, 0 filtered (prompt > 100000 tokens), 4 kept" in first.stdout
    manifest = json.loads((out / "_MANIFEST.json").read_text())
    assert manifest["invalid"]["by_reason"] == {"action_not_admissible": 3}  # recorded with the output too
    assert manifest["records_read"] == 7 and manifest["valid_records"] == 4
    again = run(*args)
    assert again.returncode == 0 and "already committed" in again.stdout
    shown = run("show-prefixes", str(out), "-n", "1")
    assert shown.returncode == 0 and "Your task is to: put some spraybottle on toilet." in shown.stdout


def test_bad_input_exits_2_naming_file_line_and_field(tmp_path, tok_dir):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"instruction": "x", "output": "y"}\n', encoding="utf-8")
    res = run("build-prefixes", "--input", str(bad), "--format", "skillrl", "--benchmark", "alfworld",
              "--tokenizer", tok_dir, "--out", str(tmp_path / "o"), "--no-progress")
    assert res.returncode == 2
    assert f"{bad}: line 1: field instruction:" in res.stderr and "--skip-invalid" in res.stderr
    assert not (tmp_path / "o" / "_MANIFEST.json").exists()
    res = run("build-prefixes", "--input", str(tmp_path / "missing.json"), "--format", "eto", "--benchmark",
              "alfworld", "--tokenizer", tok_dir, "--out", str(tmp_path / "o"))
    assert res.returncode == 2 and "missing.json: no such file" in res.stderr
    res = run("build-prefixes", "--input", str(bad), "--format", "eto", "--benchmark", "alfworld",
              "--tokenizer", str(tmp_path), "--out", str(tmp_path / "o"))
    assert res.returncode == 2 and "not a Hugging Face tokenizer folder" in res.stderr


def test_convert_to_native_roundtrips(tmp_path):
    out = tmp_path / "native.jsonl"
    res = run("convert", "--input", str(SAMPLE_DATA / "webshop_eto.json"), "--format", "eto",
              "--benchmark", "webshop", "--out", str(out))
    assert res.returncode == 0 and "wrote 3 trajectories" in res.stdout
    assert [json.loads(line)["id"] for line in out.read_text().splitlines()] == ["1532", "4207", "9021"]


def test_run_refuses_an_unknown_config_key(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("trian:\n  rounds: 2\n")
    res = run("run", str(cfg))
    assert res.returncode == 2 and "trian: unknown key (did you mean 'train'?)" in res.stderr


def test_demo_config_reads_numbers_as_yaml_1_2(tmp_path, monkeypatch):
    """`sapd demo --config` reads its file with the project's one YAML reader: `1e-3` is the number 0.001
    (PyYAML alone reads it as the string '1e-3'), and the setting is checked before anything runs; a bad
    field is refused naming the file and line."""
    from sapd.cli import main
    seen = {}
    monkeypatch.setattr("sapd.demo.main.run_demo", lambda out, cfg, **kw: seen.update(cfg=cfg))
    cfg = tmp_path / "demo.yaml"
    cfg.write_text("student_lr: 1e-3\ntest_games: 3\n")
    assert main(["demo", "--out", str(tmp_path / "out"), "--config", str(cfg), "--no-progress"]) == 0
    assert seen["cfg"].student_lr == 0.001 and isinstance(seen["cfg"].student_lr, float)
    assert seen["cfg"].test_games == 3
    cfg.write_text("test_games: 3\nstudent_lr: fast\n")
    res = run("demo", "--out", str(tmp_path / "out"), "--config", str(cfg))
    assert res.returncode == 2 and f"{cfg}:2" in res.stderr and "student_lr" in res.stderr, res.stderr
