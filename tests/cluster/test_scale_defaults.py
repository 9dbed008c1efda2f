"""The chart's defaults at the paper's scale (issue #37 items 3, 5, 7), measured on what Helm renders:

* the training stage fits an 80 GB GPU for the base values and every GPU overlay — 1.5B student, G = 8,
  responses up to max_new_tokens, prompts as long as the prefix build of the benchmark's shipped sample,
  rendered with the real Qwen2.5 tokenizer, keeps (and at the overlay's data.max_prompt_tokens cap too);
* every rank's passes carry weight (≥ 95 % of an ALFWorld round's), on the rendered world size;
* the overlays name the paper's Table 5 models and the run config the 512-token response budget;
* a train pod whose GPU is too small stops in its preflight, before the model loads, with exit 2 and one
  line saying what to change.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sapd import layout
from sapd.config import ConfigError, load_config, resolved_for
from sapd.data.prefix_table import longest_prompt
from sapd.entry import EXIT_USER_ERROR
from sapd.models.memory import GIB, HEADROOM, estimate, shape_from_config
from sapd.models.tiny import QWEN2_5, write_shape_folder
from sapd.platform import planned
from sapd.stages.train import round_passes
from tests.cluster.test_chart import by_kind, container, job, overlay_values, render
from tests.tokenizer_util import SAMPLE_DATA, qwen_tokenizer

GPU_BYTES = 80e9  # an 80 GB GPU (H100 80GB: 79.1 GiB)
# config.json of the released checkpoints (Qwen2.5-1.5B-Instruct, Qwen2.5-3B-Instruct)
QWEN_1_5B, QWEN_3B = QWEN2_5["1.5b"], QWEN2_5["3b"]
# each GPU value set's shipped sample (its benchmark and format); textworld ships none: its cap only
SAMPLES = {"base": ("alfworld_eto.json", "eto"), "alfworld": ("alfworld_eto.json", "eto"),
           "webshop": ("webshop_eto.json", "eto"), "searchqa": ("searchqa_searchr1.jsonl", "searchr1"),
           "textworld": None}
ALFWORLD_ROUND = 143  # prefixes of 16 ALFWorld trajectories (the paper's Table 4 ratio, 21,300 / 2,382 × 16)


def rendered_train(values: dict, tmp_path: Path):
    """(the train job's run config as rendered, its world size: torchrun's nodes × processes per node)."""
    docs = render(values)
    text = by_kind(docs, "ConfigMap")["sapd-test-config"]["data"]["train.yaml"]
    (tmp_path / "train.yaml").write_text(text)
    args = container(job(docs, "train")["spec"])["args"]
    flag = {a.split("=")[0]: a.split("=")[1] for a in args if a.startswith("--n")}
    return load_config(tmp_path / "train.yaml"), int(flag["--nnodes"]) * int(flag["--nproc-per-node"])


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    return qwen_tokenizer(tmp_path_factory.mktemp("qwen"))


@pytest.mark.slow  # the real Qwen2.5 tokenizer and four prefix builds
@pytest.mark.parametrize("name", list(SAMPLES))
def test_the_train_stage_fits_an_80gb_gpu_at_the_papers_shapes(name, qwen, tmp_path):
    from sapd.stages.build_prefixes import ensure_prefixes
    cfg, world = rendered_train(overlay_values(name), tmp_path)
    cfg = resolved_for(cfg, planned(world))  # what "auto" is in the chart's GPU pods
    assert (cfg.model.device, cfg.model.dtype, cfg.train.engine) == ("cuda", "bfloat16", "deepspeed")
    assert (cfg.sampling.group_size, cfg.sampling.max_new_tokens) == (8, 512)
    assert cfg.train.micro_batch_prefixes == 1 and cfg.checkpointing_on()
    student, teacher = shape_from_config(QWEN_1_5B), shape_from_config(QWEN_3B)
    prompts = {"cap": cfg.data.max_prompt_tokens}
    if SAMPLES[name]:
        # the prefix build of the shipped sample, rendered through the real Qwen2.5 chat template
        sample, fmt = SAMPLES[name]
        cfg.run_root = str(tmp_path / "run")
        cfg.data.input, cfg.data.format = str(SAMPLE_DATA / sample), fmt
        ensure_prefixes(cfg, qwen, log=lambda s: None, show_progress=False)
        prompts["build"] = longest_prompt(layout.prefixes_dir(cfg.run_root))
        assert 100 < prompts["build"] <= cfg.data.max_prompt_tokens
    for where, prompt in prompts.items():
        train = {e.stage: e for e in estimate(cfg, student, teacher, world, prompt)}["train"]
        assert train.total * HEADROOM <= GPU_BYTES, (name, where, prompt, train.line())
    print(f"\n[{name}] train estimate at the build's longest prompt {prompts.get('build')}: "
          + (train.line() if "build" not in prompts else
             {e.stage: e for e in estimate(cfg, student, teacher, world, prompts['build'])}["train"].line()))


def rendered_configs(values: dict, tmp_path: Path) -> dict[str, object]:
    """Each stage's run config as the chart renders it (the ConfigMap's overlays), keyed by stage."""
    docs = render(values)
    data = by_kind(docs, "ConfigMap")["sapd-test-config"]["data"]
    out = {}
    for stage in ("teacher-scores", "train"):
        (tmp_path / f"{stage}.yaml").write_text(data[f"{stage}.yaml"])
        out[stage] = load_config(tmp_path / f"{stage}.yaml")
    return out


@pytest.mark.parametrize("name", ["alfworld", "webshop", "searchqa"])
def test_every_phase_fits_the_gpus_the_chart_gives_it(name, tmp_path):
    """The GPU plan (``sapd check --gpu-memory 80 --gpus 16``, what the `helm test` pod runs) of each paper
    overlay: each scoring pod's GPU holds both vLLM engines and the teacher's prompt log-probs, each of the 16
    training GPUs its ZeRO-2 share of the trainer, at Qwen2.5-1.5B/3B shapes and prompts at the overlay's cap."""
    from sapd.models.memory import gpu_plan
    docs = render(overlay_values(name))
    pods = {c: container(job(docs, c)["spec"]) for c in ("teacher-scores", "train")}
    scoring_gpus = int(pods["teacher-scores"]["resources"]["limits"]["nvidia.com/gpu"])
    assert scoring_gpus == 1
    _, world = rendered_train(overlay_values(name), tmp_path)
    student, teacher = shape_from_config(QWEN_1_5B), shape_from_config(QWEN_3B)
    for stage, cfg in rendered_configs(overlay_values(name), tmp_path).items():
        cfg = resolved_for(cfg, planned(world))
        assert cfg.sampling.backend == "vllm" and cfg.model.dtype == "bfloat16"
        phase = {"teacher-scores": "sample + score", "train": "train"}[stage]
        plan = gpu_plan(cfg, student, teacher, GPU_BYTES, gpus=world, phases=(phase,))
        assert not plan.problems, (name, stage, plan.lines())
        (p,) = plan.phases
        assert p.gpu == ("each scoring pod's GPU" if stage == "teacher-scores" else "each of the 16 training GPUs")
        assert p.total <= GPU_BYTES


def test_the_old_defaults_would_not_fit():
    """The estimate is not lenient: the defaults before this change (4 prefixes per micro-batch, no
    checkpointing, 256 new tokens) at a 700-token prompt — the audit's 88 GiB of activations — do not fit."""
    from sapd.config import config_from_dict
    cfg = config_from_dict({"model": {"device": "cuda", "dtype": "bfloat16"}, "sampling": {"max_new_tokens": 256},
                            "train": {"engine": "deepspeed", "micro_batch_prefixes": 4,
                                      "gradient_checkpointing": False}})
    train = {e.stage: e for e in estimate(cfg, shape_from_config(QWEN_1_5B), None, 16, 700)}["train"]
    assert train.parts["activations"] / GIB > 90 and train.total * HEADROOM > GPU_BYTES


@pytest.mark.parametrize("name", ["base", "alfworld", "webshop", "searchqa", "textworld"])
def test_no_rank_idles_with_the_rendered_defaults(name, tmp_path):
    cfg, world = rendered_train(overlay_values(name), tmp_path)
    assert world == 16
    weighted, total = round_passes(ALFWORLD_ROUND, cfg, world)
    assert weighted / total >= 0.95, (weighted, total)
    # the chart's earlier batch shape idles 3 ranks in 4, and the checks refuse it
    cfg.train.micro_batch_prefixes = 4
    assert round_passes(ALFWORLD_ROUND, cfg, world) == (36, 144)


def test_overlays_name_the_papers_models_and_response_budget(tmp_path):
    for name in ("alfworld", "webshop", "searchqa"):
        cfg, _ = rendered_train(overlay_values(name), tmp_path)
        assert cfg.model.student.endswith("/Qwen2.5-1.5B-Instruct"), name
        assert cfg.model.teacher.endswith("-teacher-3b"), name
    assert load_config().sampling.max_new_tokens == 512


def test_the_ranks_check_refuses_idle_ranks_in_one_line(tmp_path, monkeypatch):
    from sapd.run.check import check_ranks
    cfg, world = rendered_train(overlay_values("base"), tmp_path)
    monkeypatch.setenv("SAPD_TRAIN_PROCESSES", str(world))  # what the chart sets in the driver's pod
    assert check_ranks(cfg).startswith("16 training ranks, 1 micro-batch of 1 prefix each")
    cfg.train.micro_batch_prefixes = 4
    with pytest.raises(ConfigError) as e:
        check_ranks(cfg)
    assert "\n" not in str(e.value) and "12 ranks would run a pass at weight 0" in str(e.value)
    assert "set train.micro_batch_prefixes to a divisor of 16 / 16 ranks (1)" in str(e.value)
    env = {x["name"]: x.get("value") for x in container(job(render({}), "pipeline")["spec"])["env"]}
    assert env["SAPD_TRAIN_PROCESSES"] == "16"


@pytest.mark.slow  # the real Qwen2.5 tokenizer
@pytest.mark.parametrize("gib,fits", [(80, True), (24, False)])
def test_a_train_pod_checks_its_own_gpu_before_loading(gib, fits, qwen, tmp_path, monkeypatch, capsys):
    """The train job's preflight against the GPU of its rank (LOCAL_RANK 1 → cuda:1), its free memory:
    torch.cuda is stood in for (no GPU here) by a device of ``gib`` GiB. Too small: exit 2 (the chart's
    podFailurePolicy fails the Job at once, no retry) with what to change, and nothing loaded."""
    import torch

    from sapd.jobs.train import main as train_main
    student = str(write_shape_folder(qwen, tmp_path / "student", QWEN_1_5B))
    config = tmp_path / "run.yaml"
    config.write_text(f"run_root: {tmp_path / 'run'}\nmodel: {{student: {student}, teacher: {student}, device: cuda, "
                      "dtype: bfloat16}\nsampling: {backend: vllm}\ntrain: {engine: deepspeed}\n")
    asked: list[int] = []

    class Props:
        name, total_memory = "NVIDIA H100 80GB HBM3", int(gib * GIB)

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: asked.append(i) or Props())
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda i: (int(gib * GIB) - 2**30, int(gib * GIB)))
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: asked.append(torch.device(d).index))
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "16")
    loaded: list[str] = []
    monkeypatch.setattr("sapd.checkpoints.load_checkpoint_model", lambda *a, **k: loaded.append("model"))
    code = train_main(["--config", str(config), "--round", "0", "--no-progress"])
    captured = capsys.readouterr()
    out = captured.out + captured.err
    assert asked and set(asked) == {1}  # its own GPU, not cuda:0
    assert not loaded
    if fits:  # the checks pass; the stage then stops at the missing checkpoint 0 (user error, after the checks)
        assert code == EXIT_USER_ERROR and "check memory" not in out and "000000" in out, out
    else:
        assert code == EXIT_USER_ERROR
        (line,) = [x for x in out.splitlines() if x.startswith("check memory: FAILED")]
        assert line.startswith("check memory: FAILED: train: ") and "cuda:1 (NVIDIA H100 80GB HBM3)" in line
        assert "lower sampling.max_new_tokens to 256 (now 512)" in line


@pytest.mark.slow
def test_the_memory_figures_are_measured(tmp_path):
    """bench/activation_memory.py --quick: what a Qwen2 layer at the 1.5B width keeps per token for backward
    (saved-tensor hooks, bf16) is the figure the estimate uses (107 KiB; it assumed 83 before), and one
    micro-batch of the real training step, measured by PyTorch's MemTracker, stays under the estimate, with
    and without gradient checkpointing."""
    import subprocess
    import sys
    repo = Path(__file__).resolve().parents[2]
    proc = subprocess.run([sys.executable, "bench/activation_memory.py", "--quick", "--out", str(tmp_path)],
                          cwd=repo, capture_output=True, text=True, timeout=900,
                          env={**__import__("os").environ, "OMP_NUM_THREADS": "2", "PYTHONPATH": str(repo)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads((tmp_path / "activation_memory-quick.json").read_text())
    from sapd.models.memory import SAVED_PER_TOKEN_LAYER
    a, c = SAVED_PER_TOKEN_LAYER["bfloat16"]
    measured = res["per_token_layer"]["1.5b-bfloat16"]
    assert measured / 1024 == pytest.approx(107.1, abs=0.5) and a * 1536 + c * 8960 == pytest.approx(measured, rel=0.02)
    steps = res["train_step"]
    assert [s["checkpointing"] for s in steps] == [False, True]
    for s in steps:
        assert 1.0 <= s["estimate_over_measured"] <= 1.8, s
    assert steps[1]["measured_bytes"] < steps[0]["measured_bytes"]  # checkpointing keeps less
