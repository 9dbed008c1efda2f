"""Numbers in every YAML sapd reads follow YAML 1.2 (sapd/yamlio.py): 1e-6, 5E-7 and .5 are floats in
run configs, variants' loss overrides, study files and sequence files; config errors name file:line."""

from __future__ import annotations

import dataclasses
import math
import typing

import pytest

from sapd import yamlio
from sapd.config import ConfigError, RunConfig, load_config
from sapd.method.objective import LossConfig

# YAML text → the float it must be (YAML 1.1 reads the first three as strings)
SPELLINGS = {"1e-6": 1e-6, "5E-7": 5e-7, ".5": 0.5, "+2.5e+3": 2500.0, "5.": 5.0}


def _is_float_field(tp) -> bool:
    return tp is float or (typing.get_origin(tp) in (typing.Union, __import__("types").UnionType)
                           and float in typing.get_args(tp))


def float_fields(cls, prefix: str = "") -> list[str]:
    """Dotted paths of every float field of a config dataclass, nested dataclasses included."""
    out = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            out += float_fields(tp, f"{prefix}{f.name}.")
        elif _is_float_field(tp):
            out.append(prefix + f.name)
    return out


def nested_yaml(dotted: str, text: str) -> str:
    *parents, leaf = dotted.split(".")
    lines = [f"{'  ' * i}{p}:" for i, p in enumerate(parents)] + [f"{'  ' * len(parents)}{leaf}: {text}"]
    return "\n".join(lines) + "\n"


def get(obj, dotted: str):
    for part in dotted.split("."):
        obj = obj[part] if isinstance(obj, dict) else getattr(obj, part)
    return obj


def test_scalars_follow_yaml_1_2():
    data = yamlio.load("a: 1e-6\nb: 5E-7\nc: .5\nd: 017\ne: 0o17\nf: 0x1f\ng: 1_000\nh: 1:30\ni: -.inf\n"
                       "j: .nan\nk: '1e-6'\nl: true\nm: ~\nn: -3\n")
    assert data["a"] == 1e-6 and data["b"] == 5e-7 and data["c"] == 0.5
    assert (data["d"], data["e"], data["f"]) == (17, 15, 31)
    assert (data["g"], data["h"], data["k"]) == ("1_000", "1:30", "1e-6")
    assert data["i"] == -math.inf and math.isnan(data["j"])
    assert data["l"] is True and data["m"] is None and data["n"] == -3
    assert all(type(data[k]) is float for k in "abcij") and all(type(data[k]) is int for k in "defn")
    assert data.lines == {k: i + 1 for i, k in enumerate("abcdefghijklmn")}
    # what sapd writes, it reads back to the same values
    assert yamlio.load(yamlio.dump({"x": 1e-6, "y": [0.5, 3], "z": "1e-6"})) == {"x": 1e-6, "y": [0.5, 3], "z": "1e-6"}


def test_every_run_config_float_field(tmp_path):
    paths = float_fields(RunConfig)
    # every float knob the user can set (a guard: a new float field is covered without editing this test)
    assert {"train.lr", "train.weight_decay", "sampling.temperature", "sampling.top_p", "data.val_fraction",
            "data.reopd_kappa", "rules.format_weight"} <= set(paths)
    # fields with a range of their own get spellings inside it (the lease is renewed every quarter of its time)
    ranged = {"storage.lease_ttl_s": {"4e0": 4.0, "5E+0": 5.0, "+2.5e+3": 2500.0, "5.": 5.0}}
    for dotted in paths:
        for text, want in ranged.get(dotted, SPELLINGS).items():
            f = tmp_path / "run.yaml"
            f.write_text(nested_yaml(dotted, text))
            got = get(load_config(f), dotted)
            assert type(got) is float and got == want, (dotted, text, got)


def test_every_loss_float_field(tmp_path):
    paths = float_fields(LossConfig)
    assert {"lambda_tok", "lambda_step", "lambda_rule", "token_scale", "clip_eps", "eps"} <= set(paths)
    # fields with a range of their own get spellings inside it (dual-clip's c must exceed 1)
    ranged = {name: {"3e0": 3.0, "3.5E+0": 3.5, "+2.5e+3": 2500.0, "5.": 5.0}
              for name in ("dual_clip", "behaviour_weight_cap")}  # a behaviour weight cap is at least 1
    for name in paths:
        for text, want in ranged.get(name, SPELLINGS).items():
            f = tmp_path / "variant.yaml"
            f.write_text(f"variant: sapd\nloss:\n  {name}: {text}\n")
            cfg = load_config(f)
            assert getattr(cfg.loss_cfg, name) == want and type(getattr(cfg.loss_cfg, name)) is float, (name, text)


def test_betas_tuple_of_floats(tmp_path):
    f = tmp_path / "run.yaml"
    f.write_text("train:\n  betas: [.9, 9.99e-1]\n")
    assert load_config(f).train.betas == (0.9, 0.999)


def test_every_study_config_float_field(tmp_path):
    from research.reproduction import StudyConfig, load_study_config
    paths = float_fields(StudyConfig)
    assert {"pretrain_lr", "lr", "sft_lr", "student_epochs", "env_timeout_s"} <= set(paths)
    for dotted in paths:
        for text, want in SPELLINGS.items():
            f = tmp_path / "study.yaml"
            f.write_text(nested_yaml(dotted, text))
            got = get(load_study_config(str(f)), dotted)
            assert type(got) is float and got == want, (dotted, text, got)


def test_every_powered_config_float_field(tmp_path):
    """The powered study reads its file through sapd.yamlio too: `pretrain_lr: 1e-3` is the float 0.001 (it
    was the string '1e-3' under PyYAML), in the nested power plan and the arms' learning rates as well."""
    from research.powered import PoweredConfig, load_powered_config
    paths = float_fields(PoweredConfig)
    assert {"pretrain_lr", "noise", "temperature", "power.alpha", "power.match_mde"} <= set(paths)
    for dotted in paths:
        for text, want in SPELLINGS.items():
            f = tmp_path / "powered.yaml"
            f.write_text(nested_yaml(dotted, text))
            got = get(load_powered_config(f), dotted)
            assert type(got) is float and got == want, (dotted, text, got)
    f = tmp_path / "powered.yaml"
    f.write_text("pretrain_lr: 1e-3\narms:\n  sapd: {variant: sapd, lrs: [3e-5, 1e-4]}\n")
    cfg = load_powered_config(f)
    assert cfg.pretrain_lr == 1e-3 and cfg.arms["sapd"].lrs == [3e-5, 1e-4]
    f.write_text("pretrain_lr: 1e-3\narms:\n  sapd:\n    variant: sapd\n    lrz: [1e-4]\n")
    with pytest.raises(ConfigError, match=r"powered\.yaml:5: arms\.sapd\.lrz: unknown key \(did you mean "
                                          r"'arms\.sapd\.lrs'\?\)"):
        load_powered_config(f)
    f.write_text("noise: 0.25\nnoize: 0.3\n")
    with pytest.raises(ConfigError, match=r"powered\.yaml:2: noize: unknown key \(did you mean 'noise'\?\)"):
        load_powered_config(f)


def test_sequence_file_numbers(tmp_path):
    from research.sequential import load_sequence
    f = tmp_path / "seq.yaml"
    f.write_text("root: runs/seq\nenv_timeout_s: 1.5e2\nbase:\n  train: {lr: 1e-6}\n  sampling: {top_p: .5}\n"
                 "stages:\n  - name: a\n    data: {input: a.jsonl, format: native, benchmark: textworld}\n"
                 "    eval: {benchmark: textworld, families: [coin_near], games_per_family: 1, seed: 0}\n")
    seq = load_sequence(str(f))
    assert seq["env_timeout_s"] == 150.0
    assert seq["base"]["train"]["lr"] == 1e-6 and seq["base"]["sampling"]["top_p"] == 0.5


def test_config_errors_name_file_and_line(tmp_path):
    f = tmp_path / "run.yaml"
    f.write_text("data:\n  input: x.jsonl\ntrain:\n  rounds: 2\n  lr: '1e-6'\n")
    with pytest.raises(ConfigError, match=r"run\.yaml:5: train\.lr: expected a number, got '1e-6' \(a string: "
                                          r"write the number without quotes\)"):
        load_config(f)
    f.write_text("train:\n  rounds: 2\n  lrr: 1e-6\n")
    with pytest.raises(ConfigError, match=r"run\.yaml:3: train\.lrr: unknown key \(did you mean 'train\.lr'\?\)"):
        load_config(f)
    f.write_text("# a comment\ntrain:\n  rounds: 0\n")  # a check after all overlays are applied
    with pytest.raises(ConfigError, match=r"run\.yaml:3: train\.rounds: must be at least 1"):
        load_config(f)
    f.write_text("loss:\n  lambda_tok: high\n")
    with pytest.raises(ConfigError, match=r"run\.yaml:2: loss\.lambda_tok: expected a number"):
        load_config(f)
