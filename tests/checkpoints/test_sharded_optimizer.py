"""Sharded optimizer checkpoints (sapd/checkpoints.py): every rank writes and reads only its own share of
the AdamW state, and a checkpoint moves between world sizes, ZeRO stages and engines (resharded on load)
with the next steps' losses those of the uninterrupted run; old checkpoints (the whole state inside
``trainer.pt``) still resume; a checkpoint of another model is refused by name."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
import torch

from sapd import checkpoints, layout, storage
from sapd.engines.torch_engine import TorchEngine
from sapd.models.loading import load_tokenizer
from sapd.stages import train
from tests import reshard_worker as rw
from tests.pipeline_util import make_models, run_rank_worker

REPO = Path(__file__).resolve().parents[2]
TOL = 1e-6


@pytest.fixture(scope="module")
def student(tmp_path_factory) -> str:
    return make_models(tmp_path_factory.mktemp("models"))[0]


def _save_and_continue(student: str, root: str) -> tuple[list[float], TorchEngine, checkpoints.OptimizerShard]:
    """The torch engine: round 0, checkpoint 1, round 1 in the same process (the uninterrupted run)."""
    torch.manual_seed(0)
    cfg, engine = rw._engine({"engine": "torch"}, student, root)
    _, step = rw._round(cfg, engine, 0, 0)
    shard = engine.optimizer_shard()
    checkpoints.save_checkpoint(root, 1, engine.module, load_tokenizer(student), train._trainer_state(engine, 0, step),
                                optimizer=shard)
    losses, _ = rw._round(cfg, engine, 1, step)
    return losses, engine, shard


def _resume(root: str, into: str, engine_kind: str = "torch") -> tuple[list[float], str, TorchEngine]:
    cfg, engine = rw._engine({"engine": engine_kind}, str(checkpoints.checkpoint_model_path(root, 1)), into)
    state = checkpoints.load_trainer_state(root, 1)
    how = checkpoints.restore_optimizer(root, 1, engine, state, log=lambda s: None)
    losses, _ = rw._round(cfg, engine, 1, state["global_step"])
    return losses, how, engine


@pytest.mark.parametrize("where", ["local", "s3"])
def test_torch_engine_resumes_exactly_from_its_sharded_state(student, tmp_path, where, request):
    root = request.getfixturevalue("s3_storage") if where == "s3" else str(tmp_path / "run")
    storage.reset_transfer_stats()
    uninterrupted, engine, shard = _save_and_continue(student, root)
    files = sorted(f.rsplit("/", 1)[1] for f in storage.list_files(checkpoints.optimizer_dir(root, 1)))
    # one shard (one rank), DCP's index and the digests of the shard's items (checked on every ranged read)
    assert files == [".metadata", checkpoints.ITEM_DIGESTS, "__0_0.distcp"]
    state_bytes = 2 * 4 * sum(shard.numels)  # exp_avg + exp_avg_sq, fp32
    data = storage.read_bytes(storage.join(checkpoints.optimizer_dir(root, 1), "__0_0.distcp"))
    assert state_bytes <= len(data) < state_bytes * 1.2
    trainer_pt = storage.read_bytes(storage.join(layout.checkpoint_state_dir(root, 1), "trainer.pt"))
    assert len(trainer_pt) < 20_000  # step counter, RNG, hyper-parameters: no tensor of the state
    assert checkpoints.read_marker(root, 1)["optimizer"] == checkpoints.OPTIMIZER_FORMAT
    if where == "s3":
        assert storage.transfer_stats()["s3_written_bytes"] >= state_bytes
    resumed, how, fresh = _resume(root, str(tmp_path / "resumed"))
    assert how == "sharded"
    assert len(resumed) == 3 and resumed == pytest.approx(uninterrupted, abs=TOL, rel=0)
    # the restored state is the saved one, bit for bit (the uninterrupted engine has since stepped on)
    saved = checkpoints.consolidated_optimizer_state(root, 1)
    assert fresh.optimizer.state_dict()["param_groups"][0]["weight_decay"] == 0.01
    assert saved["param_groups"][0]["betas"] == (0.9, 0.999)


def test_restored_state_equals_the_saved_state(student, tmp_path):
    root = str(tmp_path / "run")
    _save_and_continue(student, root)
    cfg, engine = rw._engine({"engine": "torch"}, str(checkpoints.checkpoint_model_path(root, 1)), str(tmp_path / "x"))
    state = checkpoints.load_trainer_state(root, 1)
    checkpoints.restore_optimizer(root, 1, engine, state, log=lambda s: None)
    saved = checkpoints.consolidated_optimizer_state(root, 1)["state"]
    got = engine.optimizer.state_dict()["state"]
    assert got.keys() == saved.keys()
    for i in saved:
        assert float(got[i]["step"]) == float(saved[i]["step"]) == 3.0
        for key in checkpoints.STATE_KEYS:
            assert torch.equal(got[i][key], saved[i][key]), (i, key)


def _write_legacy(root: str, engine: TorchEngine, step: int) -> None:
    """Checkpoint 1's state as sapd wrote it before sharding: the whole AdamW state in trainer.pt."""
    buf = io.BytesIO()
    torch.save({"global_step": step, "round": 1, "rng": train._rng_state(),
                "optimizer": engine.optimizer.state_dict()}, buf)
    storage.delete_prefix(checkpoints.optimizer_dir(root, 1))
    storage.write_bytes(storage.join(layout.checkpoint_state_dir(root, 1), "trainer.pt"), buf.getvalue())
    marker = checkpoints.read_marker(root, 1)
    for key in ("files", "optimizer"):  # that sapd recorded no digests, and no sharded optimizer
        marker.pop(key, None)
    storage.write_json(layout.checkpoint_marker(root, 1), marker)


def test_checkpoints_holding_the_whole_state_still_resume(student, tmp_path):
    root = str(tmp_path / "run")
    torch.manual_seed(0)
    cfg, engine = rw._engine({"engine": "torch"}, student, root)
    _, step = rw._round(cfg, engine, 0, 0)
    checkpoints.save_checkpoint(root, 1, engine.module, load_tokenizer(student), train._trainer_state(engine, 0, step),
                                optimizer=engine.optimizer_shard())
    _write_legacy(root, engine, step)
    uninterrupted, _ = rw._round(cfg, engine, 1, step)
    seen: list[str] = []
    cfg2, fresh = rw._engine({"engine": "torch"}, str(checkpoints.checkpoint_model_path(root, 1)), str(tmp_path / "b"))
    state = checkpoints.load_trainer_state(root, 1)
    assert checkpoints.restore_optimizer(root, 1, fresh, state, log=seen.append) == "whole"
    assert "stored whole (written by an earlier sapd)" in seen[0]
    resumed, _ = rw._round(cfg2, fresh, 1, state["global_step"])
    assert resumed == pytest.approx(uninterrupted, abs=TOL, rel=0)


def test_a_checkpoint_of_another_model_is_refused(student, tmp_path):
    from sapd.models.tiny import build_tiny_model
    from tests.tokenizer_util import build_test_tokenizer
    root = str(tmp_path / "run")
    _save_and_continue(student, root)
    other = tmp_path / "other"
    build_tiny_model(build_test_tokenizer(tmp_path / "tok"), other, layers=1)
    cfg, engine = rw._engine({"engine": "torch"}, str(other), str(tmp_path / "x"))
    with pytest.raises(ValueError, match=r"optimizer state is for \d+ parameters, the model has \d+ .*another model"):
        checkpoints.restore_optimizer(root, 1, engine, checkpoints.load_trainer_state(root, 1))


# --------------------------------------------------------------------------------------------------
# DeepSpeed ZeRO 1-3 and the torch engine, 2 ranks -> 1 and 1 -> 2 (gloo, CPU)


def _launch(jobs: list[dict], out: Path, ranks: int) -> list[list[dict]]:
    return run_rank_worker("reshard_worker.py", jobs, out, ranks, torchrun=True)  # torch.distributed even for 1


@pytest.mark.slow
def test_zero_checkpoints_reshard_between_world_sizes_and_engines(student, tmp_path):
    pytest.importorskip("deepspeed")
    one, two = tmp_path / "saved-by-1", tmp_path / "saved-by-2"
    stages = (1, 2, 3)
    # A: one process saves (ZeRO 1-3 and the torch engine) and trains on: the uninterrupted 1-rank runs
    a = _launch([{"do": "save", "engine": "deepspeed", "zero": z, "model": student, "root": str(one / f"z{z}")}
                 for z in stages] + [{"do": "save", "engine": "torch", "model": student, "root": str(one / "torch")}],
                tmp_path / "a", 1)[0]
    # B: two ranks save and train on (the uninterrupted 2-rank runs), and resume the 1-rank checkpoints (1 -> 2)
    b_jobs = []
    for z in stages:
        b_jobs += [{"do": "save", "engine": "deepspeed", "zero": z, "model": student, "root": str(two / f"z{z}")},
                   {"do": "resume", "engine": "deepspeed", "zero": z, "root": str(one / f"z{z}"),
                    "into": str(tmp_path / f"b-z{z}")}]
    b_jobs.append({"do": "resume", "engine": "deepspeed", "zero": 2, "root": str(one / "torch"),
                   "into": str(tmp_path / "b-from-torch")})
    b = _launch(b_jobs, tmp_path / "b", 2)
    # C: one process resumes the 2-rank checkpoints (2 -> 1), one of them into the torch engine
    c = _launch([{"do": "resume", "engine": "torch", "root": str(two / "z3"), "into": str(tmp_path / "c-torch")}]
                + [{"do": "resume", "engine": "deepspeed", "zero": z, "root": str(two / f"z{z}"),
                    "into": str(tmp_path / f"c-z{z}")} for z in stages], tmp_path / "c", 1)[0]

    def uninterrupted(results: list[dict], root: Path) -> list[float]:
        (hit,) = [r for r in results if r["job"]["do"] == "save" and r["job"]["root"] == str(root)]
        return hit["losses"]

    rows = []
    b0, b1 = b
    for r0, r1 in zip(b0, b1):
        assert r0["losses"] == r1["losses"]  # the loop's metrics are averaged over the ranks
        if r0["job"]["do"] == "save":  # each rank held about half the state, never the whole of it
            assert 0.3 < r0["held"] < 0.7 and 0.3 < r1["held"] < 0.7 and r0["held"] + r1["held"] == pytest.approx(1)
            continue
        src = Path(r0["job"]["root"])
        assert r0["restored"] == "sharded" and max(r0["max_state_diff"], r1["max_state_diff"]) == 0.0
        assert 0.3 < r0["held"] < 0.7
        rows.append((f"1 -> 2, {src.name} -> ZeRO-{r0['job']['zero']}", r0["losses"], uninterrupted(a, src)))
    for r in c:
        src = Path(r["job"]["root"])
        assert r["restored"] == "sharded" and r["max_state_diff"] == 0.0 and r["held"] == 1.0
        into = "torch" if r["job"]["engine"] == "torch" else f"ZeRO-{r['job']['zero']}"
        rows.append((f"2 -> 1, {src.name} -> {into}", r["losses"], uninterrupted(b0, src)))
    for name, got, want in rows:
        diff = max(abs(x - y) for x, y in zip(got, want))
        print(f"\n{name}: round-1 losses {[round(x, 6) for x in got]}, max |diff| vs uninterrupted {diff:.2e}")
        assert len(got) == len(want) == 3 and diff <= TOL, name
    assert len(rows) == 8
