"""One GPU, as far as a CPU shows it: ``auto`` (the default of ``model.device``, ``model.dtype`` and
``sampling.backend``) resolves per process and says why — CUDA's presence faked on this CPU machine; the
memory plan of ``sapd check --gpu-memory`` for a GPU that is not here, from the models' config.json alone,
at the paper's Qwen2.5-1.5B/3B shapes; and ``sapd run`` keeping one trainer for the whole run, handing the
device over by phase in order, with the weights of a run that reloads its trainer every round."""

from __future__ import annotations

import types
from pathlib import Path

import pytest
import torch

from sapd import checkpoints, platform
from sapd.cli import main
from sapd.config import ConfigError, ModelConfig, RunConfig, config_from_dict, dump_config, write_run_config
from sapd.entry import EXIT_OK, EXIT_USER_ERROR
from sapd.models.memory import GIB, PROMPT_LOGPROB_BYTES, gpu_plan, kv_cache_bytes, shape_from_config
from sapd.models.tiny import QWEN2_5, write_shape_folder
from sapd.run.local import run_pipeline
from sapd.stages import train as train_stage
from tests.pipeline_util import make_models, tiny_config
from tests.tokenizer_util import SAMPLE_DATA, qwen_tokenizer

QUIET = dict(log=lambda s: None, show_progress=False)


# ---------------------------------------------------------------------------------------------------
# auto


@pytest.fixture
def fake_gpu(monkeypatch):
    """torch sees CUDA devices (``major``: their compute capability) and vLLM is or is not installed, as set."""
    def install(gpus: int = 1, major: int = 9, vllm: bool = True, local_rank: str | None = None) -> None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: gpus > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
        monkeypatch.setattr(torch.cuda, "get_device_properties",
                            lambda i: types.SimpleNamespace(major=major, name="NVIDIA H100 80GB HBM3"))
        monkeypatch.setattr(platform, "vllm_installed", lambda: vllm)
        if local_rank is None:
            monkeypatch.delenv("LOCAL_RANK", raising=False)
        else:
            monkeypatch.setenv("LOCAL_RANK", local_rank)
        platform.detect.cache_clear()
    yield install
    platform.detect.cache_clear()


def test_auto_resolves_from_what_this_process_runs_on_and_says_why(fake_gpu):
    fake_gpu(gpus=2, major=9, vllm=True, local_rank="1")
    cfg = RunConfig()
    assert (cfg.model.device, cfg.model.dtype, cfg.sampling.backend) == ("cuda:1", "bfloat16", "vllm")
    assert cfg.auto_lines() == [
        "model.device: auto → cuda:1 (2 CUDA devices NVIDIA H100 80GB HBM3; this rank's LOCAL_RANK is 1)",
        "model.dtype: auto → bfloat16 (a GPU that computes in bfloat16; training keeps an fp32 master of the weights)",
        "sampling.backend: auto → vllm (vLLM is installed and the device is a GPU)"]
    assert cfg.checkpointing_on()  # gradient checkpointing's own auto follows the resolved device
    # written back as the user wrote it: each process resolves the run root's config for itself
    assert "device: auto" in dump_config(cfg) and "dtype: auto" in dump_config(cfg)
    assert "device: cuda:1" in dump_config(cfg, as_written=False)

    fake_gpu(gpus=1, major=9, vllm=False)
    cfg = RunConfig()
    assert (cfg.model.device, cfg.sampling.backend) == ("cuda", "hf")
    assert "pip install 'sapd[vllm]'" in cfg.auto_lines()[2]

    fake_gpu(gpus=1, major=7, vllm=True)  # a V100: no bfloat16
    assert RunConfig().model.dtype == "float32"
    assert "compute capability below 8.0" in RunConfig().auto_lines()[1]

    fake_gpu(gpus=0)
    cfg = RunConfig()
    assert (cfg.model.device, cfg.model.dtype, cfg.sampling.backend) == ("cpu", "float32", "hf")
    assert cfg.auto_lines()[0] == "model.device: auto → cpu (torch sees no CUDA device)"


def test_explicit_values_win_and_a_resumed_run_compares_what_auto_resolves_to(fake_gpu, tmp_path):
    fake_gpu(gpus=1, major=9, vllm=True)
    cfg = config_from_dict({"run_root": str(tmp_path / "run"), "model": {"dtype": "float32"},
                            "sampling": {"backend": "hf"}})
    assert (cfg.model.device, cfg.model.dtype, cfg.sampling.backend) == ("cuda", "float32", "hf")
    assert [line.split(":")[0] for line in cfg.auto_lines()] == ["model.device"]
    assert "dtype: float32" in dump_config(cfg)
    # a cluster's CPU driver pod: the configured cuda device is a GPU, so auto is bfloat16 there too
    fake_gpu(gpus=0)
    driver = config_from_dict({"model": {"device": "cuda"}})
    assert (driver.model.device, driver.model.dtype) == ("cuda", "bfloat16")
    # a run root written on a CPU with auto resumes under auto on a CPU; one written with float32 is refused
    # under auto on a GPU, where auto means bfloat16 (another experiment)
    write_run_config(config_from_dict({"run_root": str(tmp_path / "a")}))
    write_run_config(config_from_dict({"run_root": str(tmp_path / "a")}))  # the same: no error
    write_run_config(config_from_dict({"run_root": str(tmp_path / "b"), "model": {"dtype": "float32"}}))
    fake_gpu(gpus=1, major=9, vllm=False)
    with pytest.raises(ConfigError, match=r"model.dtype \('float32' there, 'bfloat16' here\)"):
        write_run_config(config_from_dict({"run_root": str(tmp_path / "b")}))


def test_every_door_opens_with_the_resolved_values(tmp_path, capsys):
    """``sapd run``'s first lines (and every stage pod's, through the same config loader) name what auto chose."""
    student, teacher = make_models(tmp_path / "models")
    path = tmp_path / "run.yaml"
    import yaml
    path.write_text(yaml.safe_dump(tiny_config(str(tmp_path / "run"), student, teacher, train={"rounds": 1})))
    assert main(["run", str(path), "--no-progress"]) == EXIT_OK
    first = capsys.readouterr().out.splitlines()[:3]
    assert first == ["config: model.device: auto → cpu (torch sees no CUDA device)",
                     "config: model.dtype: auto → float32 (a CPU)",
                     "config: sampling.backend: auto → hf (a CPU: vLLM is for GPUs)"]


def test_the_starter_leaves_device_dtype_and_backend_on_auto():
    from sapd.run.starter import starter_config
    text = starter_config("alfworld")
    for line in ("# device: auto", "# dtype: auto", "# backend: auto"):
        assert line in text


# ---------------------------------------------------------------------------------------------------
# the memory plan


@pytest.fixture(scope="module")
def qwen_shapes(tmp_path_factory) -> tuple[str, str]:
    """Model folders of Qwen2.5-1.5B and -3B's config.json and the real Qwen2.5 tokenizer, no weights."""
    root = tmp_path_factory.mktemp("qwen-shapes")
    tok = qwen_tokenizer(root / "tokenizer")
    return (str(write_shape_folder(tok, root / "student", QWEN2_5["1.5b"])),
            str(write_shape_folder(tok, root / "teacher", QWEN2_5["3b"])))


def _starter(tmp_path: Path, student: str, teacher: str) -> Path:
    out = tmp_path / "alfworld.yaml"
    assert main(["init", "--benchmark", "alfworld", "--out", str(out)]) == EXIT_OK
    text = out.read_text().replace("PATH/TO/student-model", student).replace("PATH/TO/teacher-model", teacher)
    text = text.replace("PATH/TO/alfworld_expert.jsonl", str(SAMPLE_DATA / "alfworld_eto.json"))
    out.write_text(text.replace("run_root: runs/alfworld", f"run_root: {tmp_path / 'run'}"))
    return out


def test_the_alfworld_starter_fits_one_80gb_gpu_planned_from_config_json_alone(tmp_path, qwen_shapes, capsys):
    path = _starter(tmp_path, *qwen_shapes)
    assert main(["check", str(path), "--gpu-memory", "80"]) == EXIT_OK
    out = capsys.readouterr().out
    assert "check config: model.device: auto → cuda (1 CUDA device (planned))" in out
    assert "check config: sampling.backend: auto → vllm" in out
    assert "check memory: ok (every phase fits GPUs of 80 GiB (as given): one GPU, every phase on it (sapd run))" in out
    for line in ("  sample + score (the GPU): ", "    student engine (vLLM) 32.00 GiB", "    teacher engine (vLLM) 32.00 GiB",
                 "    trainer 0.0 MiB (waits in host memory", "  train (the GPU): ", "    fp32 master 5.75 GiB",
                 "    student engine asleep", "    teacher engine asleep"):
        assert line in out, (line, out)


def test_the_starter_at_g64_and_4096_new_tokens_does_not_fit_and_names_what_to_change(tmp_path, qwen_shapes, capsys):
    path = _starter(tmp_path, *qwen_shapes)
    more = tmp_path / "more.yaml"
    more.write_text("sampling:\n  group_size: 64\n  max_new_tokens: 4096\n")
    assert main(["check", str(path), str(more), "--gpu-memory", "80"]) == EXIT_USER_ERROR
    out = capsys.readouterr().out
    (failed,) = [line for line in out.splitlines() if line.startswith("check memory: FAILED")]
    assert failed.startswith("check memory: FAILED: train: ") and "on a GPU of 80.00 GiB: lower sampling.group_size" in failed
    assert "  train (the GPU): " in out and "DOES NOT FIT" in out  # the plan is shown under its failure
    # the change it names fits
    fix = tmp_path / "fix.yaml"
    value = int(failed.split("sampling.group_size to ")[1].split()[0])
    fix.write_text(f"sampling:\n  group_size: {value}\n  max_new_tokens: 4096\n")
    assert main(["check", str(path), str(fix), "--gpu-memory", "80"]) == EXIT_OK, capsys.readouterr().out


def test_a_cpu_only_config_is_not_planned_for_a_gpu(tmp_path, qwen_shapes, capsys):
    path = _starter(tmp_path, *qwen_shapes)
    cpu = tmp_path / "cpu.yaml"
    cpu.write_text("model:\n  device: cpu\n")
    assert main(["check", str(path), str(cpu), "--gpu-memory", "80"]) == EXIT_USER_ERROR
    assert "model.device: cpu runs nothing on a GPU" in capsys.readouterr().err


def test_each_part_of_the_plan_by_hand():
    """The plan's parts at Qwen2.5-1.5B/3B in bfloat16, hand-computed: weights 2 bytes per parameter, the
    fp32 master 4, Adam's moments 8, the KV cache 2 (K and V) × layers × KV heads × head dim × 2 bytes per
    token, the teacher's prompt log-probs tokens × vocabulary × 10 bytes; ZeRO-2 over 16 GPUs splits the master,
    the moments and the gradients 16 ways."""
    from sapd.config import resolved_for
    student, teacher = shape_from_config(QWEN2_5["1.5b"]), shape_from_config(QWEN2_5["3b"])
    assert (student.params, teacher.params) == (1_543_714_304, 3_085_938_688)
    assert kv_cache_bytes(student, 1, 2) == 2 * 28 * 2 * 128 * 2
    cfg = resolved_for(RunConfig(), platform.planned(1))
    plan = gpu_plan(cfg, student, teacher, 80 * GIB, prompt_tokens=1000)
    sample, train = plan.phases
    parts = {h.what: h.bytes for h in train.holds}
    n = student.params
    assert (parts["weights"], parts["fp32 master"], parts["Adam moments"], parts["gradients"]) == (2 * n, 4 * n, 8 * n, 2 * n)
    logp = {h.what: h.bytes for h in sample.holds}["teacher prompt log-probs"]
    assert logp == (1000 + 512) * 151936 * PROMPT_LOGPROB_BYTES
    engine = {h.what: h for h in sample.holds}["student engine (vLLM)"]
    assert engine.bytes == 0.4 * 80 * GIB and {i.what for i in engine.inside} == {"weights", "activation peak", "KV cache"}
    cfg.train.engine = "deepspeed"
    sharded = gpu_plan(cfg, student, teacher, 80 * GIB, gpus=16, prompt_tokens=1000)
    parts16 = {h.what: h.bytes for h in sharded.phases[1].holds}
    # the gradients: bf16, and the fp32 sums DeepSpeed accumulates them in (sapd.engines.deepspeed_engine)
    assert (parts16["fp32 master"], parts16["Adam moments"], parts16["gradients"], parts16["weights"]) == \
        (4 * n / 16, 8 * n / 16, 2 * n / 16 + 4 * n / 16, 2 * n)
    assert sharded.phases[0].gpu == "each scoring pod's GPU" and "trainer" not in {h.what for h in sharded.phases[0].holds}


# ---------------------------------------------------------------------------------------------------
# sapd run: one trainer for the run, the device handed over by phase


def test_sapd_run_keeps_one_trainer_and_hands_the_device_over_in_order(tmp_path, monkeypatch):
    student, teacher = make_models(tmp_path / "models")
    loads: list[int] = []
    real = train_stage.load_trainer

    def counting(cfg, k, **kw):
        loads.append(k)
        return real(cfg, k, **kw)

    monkeypatch.setattr(train_stage, "load_trainer", counting)
    cfg = config_from_dict(tiny_config(str(tmp_path / "kept"), student, teacher, train={"rounds": 3},
                                       validation={"every_rounds": 0}))
    result = run_pipeline(cfg, **QUIET)
    assert result["checkpoints"] == [0, 1, 2, 3]
    assert loads == [0]  # the trainer of round 0 trains every round: model, fp32 master and optimizer state kept
    order = [(h.round, h.what) for h in result["handoffs"]]
    released = ["student engine releases the device", "teacher engine releases the device"]
    woken = ["student engine wakes", "teacher engine wakes"]
    assert order == ([(0, w) for w in released] + [(0, "trainer to host memory")]
                     + [(k, w) for k in (1, 2) for w in woken + released + ["trainer to the device", "trainer to host memory"]])
    assert not any(h.moved for h in result["handoffs"])  # a CPU: nothing moves, the order is what is checked

    # the same weights as a run whose trainer is loaded afresh from its checkpoint every round (three
    # invocations, each one round longer): what a killed and resumed `sapd run` does
    for rounds in (1, 2, 3):
        run_pipeline(config_from_dict(tiny_config(str(tmp_path / "reloaded"), student, teacher,
                                                  train={"rounds": rounds}, validation={"every_rounds": 0})), **QUIET)
    assert loads == [0, 0, 1, 2]
    kept = checkpoints.load_checkpoint_model(str(tmp_path / "kept"), 3, "float32", "cpu").state_dict()
    again = checkpoints.load_checkpoint_model(str(tmp_path / "reloaded"), 3, "float32", "cpu").state_dict()
    assert all(torch.equal(kept[name], again[name]) for name in kept)


def test_a_pod_given_gpus_that_torch_does_not_see_stops_instead_of_running_on_the_cpu(fake_gpu, monkeypatch):
    fake_gpu(gpus=0)
    monkeypatch.setenv("SAPD_POD_GPUS", "8")  # the chart: this container's nvidia.com/gpu limit
    with pytest.raises(ConfigError, match=r"model.device: auto: this pod was given 8 GPUs .* but torch sees no CUDA"):
        RunConfig()
    assert RunConfig(model=ModelConfig(device="cpu")).model.device == "cpu"  # an explicit choice stands
