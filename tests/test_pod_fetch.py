"""One download per pod (sapd/models/loading.py ``fetch_once``), against a real S3 server (SeaweedFS): the
processes sharing a cache (the ranks of a training pod, its scratch or the node's model cache) fetch a
model folder once; a rank killed mid-download hands the rest to a waiting rank; a downloader that makes
no progress makes the waiters fail after a deadline, naming it. And the S3 bytes a 2-process training pod
reads for one round, measured both ways: every rank fetching checkpoint k and the whole optimizer state
itself (before), against one fetch per pod and one optimizer shard per rank (now)."""

from __future__ import annotations

import fcntl
import io
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import yaml

from sapd import checkpoints, layout, storage
from sapd.config import config_from_dict
from sapd.models.loading import FetchStalled, fetch_once
from sapd.run.local import run_pipeline
from tests.conftest import free_port
from tests.pipeline_util import make_models, tiny_config

REPO = Path(__file__).resolve().parents[1]


def _env(s3) -> dict[str, str]:
    return {**os.environ, "SAPD_S3_ENDPOINT_URL": s3.endpoint_url, "AWS_ACCESS_KEY_ID": s3.access_key,
            "AWS_SECRET_ACCESS_KEY": s3.secret_key, "AWS_DEFAULT_REGION": "us-east-1", "PYTHONPATH": str(REPO),
            "OMP_NUM_THREADS": "1"}


@pytest.fixture
def model_on_s3(s3_storage, tmp_path):
    """A tiny model folder uploaded under an S3 prefix → (uri, {relative name: bytes})."""
    student, _ = make_models(tmp_path / "models")
    uri = storage.join(s3_storage, "model")
    files = {}
    for f in sorted(Path(student).iterdir()):
        storage.write_file_from(f, storage.join(uri, f.name))
        files[f.name] = f.read_bytes()
    return uri, files


def _resolve(s3, uri: str, cache: Path, out: Path, *extra: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "tests/fetch_worker.py", "resolve", uri, str(cache), str(out), *extra],
                            cwd=REPO, env=_env(s3), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def test_the_ranks_of_a_pod_download_once(s3_server, model_on_s3, tmp_path):
    uri, files = model_on_s3
    cache = tmp_path / "scratch"
    procs = [_resolve(s3_server, uri, cache, tmp_path / f"r{r}.json") for r in range(2)]  # two ranks at once
    for p in procs:
        assert p.wait(timeout=300) == 0, p.stdout.read() if p.stdout else ""
    outs = [json.loads((tmp_path / f"r{r}.json").read_text()) for r in range(2)]
    assert outs[0]["folder"] == outs[1]["folder"]
    total = sum(len(b) for b in files.values())
    read = [o["s3_read_bytes"] for o in outs]
    print(f"\nS3 bytes read by the two ranks: {read} (the model folder: {total})")
    assert sum(read) == total and sorted(read)[0] == 0  # one rank downloaded it all, the other nothing
    folder = Path(outs[0]["folder"])
    assert {f.name: f.read_bytes() for f in folder.iterdir() if not f.name.startswith(".")} == files


def test_a_rank_killed_mid_download_hands_over(s3_server, model_on_s3, tmp_path):
    uri, files = model_on_s3
    cache = tmp_path / "scratch"
    killed = _resolve(s3_server, uri, cache, tmp_path / "a.json", "--die-after-files", "2")
    assert killed.wait(timeout=300) == -9
    (dest,) = [d for d in (cache / "models").iterdir() if d.is_dir()]
    first_two = sorted(files)[:2]
    assert sorted(f.name for f in dest.iterdir()) == first_two  # stopped half way, nothing marked complete
    survivor = _resolve(s3_server, uri, cache, tmp_path / "b.json")  # the lock died with its holder
    assert survivor.wait(timeout=300) == 0, survivor.stdout.read() if survivor.stdout else ""
    out = json.loads((tmp_path / "b.json").read_text())
    assert out["s3_read_bytes"] == sum(len(files[n]) for n in files if n not in first_two)  # kept what was there
    assert {f.name: f.read_bytes() for f in dest.iterdir() if not f.name.startswith(".")} == files
    assert not list(dest.rglob("*.sapd-tmp"))


def test_a_stalled_downloader_fails_the_waiters_after_a_deadline(model_on_s3, tmp_path):
    uri, _ = model_on_s3
    dest = tmp_path / "scratch" / "m"
    dest.parent.mkdir(parents=True)
    with open(dest.with_name("m.lock"), "a+") as held:  # another rank holds the download, and hangs
        fcntl.flock(held, fcntl.LOCK_EX)
        held.write("pid 4242 on pod-a")
        held.flush()
        t0 = time.monotonic()
        with pytest.raises(FetchStalled, match=r"by pid 4242 on pod-a made no progress for 1 s; giving up") as e:
            fetch_once(uri, dest, stall_s=1.0, poll_s=0.1)
        assert 1.0 <= time.monotonic() - t0 < 10 and e.value.exit_code == 75  # a retried failure, one line


def test_a_slow_downloader_making_progress_is_waited_for(model_on_s3, tmp_path):
    uri, files = model_on_s3
    dest = tmp_path / "scratch" / "m"
    dest.mkdir(parents=True)

    def slow_holder(lock) -> None:  # a download that takes 2.5 s, its bytes growing all the while
        try:
            with open(dest / ".part.sapd-tmp", "wb") as part:
                for _ in range(8):
                    part.write(b"x" * 1000)
                    part.flush()
                    time.sleep(0.3)
            (dest / ".part.sapd-tmp").unlink()
            for name, data in files.items():
                (dest / name).write_bytes(data)
            (dest / ".sapd-sync-complete").write_text(uri)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)

    lock = open(dest.with_name("m.lock"), "a+")
    fcntl.flock(lock, fcntl.LOCK_EX)
    holder = threading.Thread(target=slow_holder, args=(lock,))
    holder.start()
    storage.reset_transfer_stats()
    seen: list[str] = []
    try:
        assert fetch_once(uri, dest, stall_s=1.0, poll_s=0.1, log=seen.append) == dest
    finally:
        holder.join()
        lock.close()
    assert storage.transfer_stats()["s3_read_bytes"] == 0 and "waiting for" in seen[0]


# --------------------------------------------------------------------------------------------------
# S3 bytes read per round by a 2-process training pod


def _upload(local: Path, uri: str) -> None:
    for f in sorted(local.rglob("*")):
        if f.is_file():
            storage.write_file_from(f, storage.join(uri, f.relative_to(local).as_posix()))


def _make_whole(root: str, k: int) -> None:
    """Checkpoint k's optimizer state as sapd wrote it before sharding: all of it inside trainer.pt."""
    state = checkpoints.load_trainer_state(root, k)
    state.pop(checkpoints.SHARDED_KEY)
    state["optimizer"] = checkpoints.consolidated_optimizer_state(root, k)
    buf = io.BytesIO()
    torch.save(state, buf)
    storage.delete_prefix(checkpoints.optimizer_dir(root, k))
    storage.write_bytes(storage.join(layout.checkpoint_state_dir(root, k), "trainer.pt"), buf.getvalue())
    marker = checkpoints.read_marker(root, k)
    for key in ("files", "optimizer"):  # that sapd recorded no digests, and no sharded optimizer
        marker.pop(key, None)
    storage.write_json(layout.checkpoint_marker(root, k), marker)


def _pod_round(s3, cfg_path: Path, k: int, cache: Path, out: Path, per_rank_cache: bool) -> int:
    env = {**_env(s3), "DS_ACCELERATOR": "cpu", "OMP_WAIT_POLICY": "PASSIVE", "SAPD_CACHE_DIR": str(cache),
           "TORCH_EXTENSIONS_DIR": os.environ.get("TORCH_EXTENSIONS_DIR", str(REPO / ".cache" / "torch_extensions"))}
    if per_rank_cache:
        env["SAPD_TEST_CACHE_PER_RANK"] = "1"
    port = str(free_port())
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", port, "tests/fetch_worker.py", "cli", str(out), "train-round", str(cfg_path), "--round",
           str(k), "--no-progress"]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-5000:]
    return sum(json.loads(Path(f"{out}.rank{r}.json").read_text())["s3_read_bytes"] for r in range(2))


@pytest.mark.slow
@pytest.mark.integration
def test_s3_bytes_read_per_round_by_a_two_process_pod(s3_server, s3_storage, tmp_path):
    pytest.importorskip("deepspeed")
    models = make_models(tmp_path / "models")
    train = {"rounds": 2, "trajectories_per_round": 3, "minibatch_prefixes": 4, "micro_batch_prefixes": 2,
             "engine": "deepspeed", "zero_stage": 2}
    src = tmp_path / "src"  # the committed inputs: prefixes, scored rounds 0 and 1, checkpoint 0
    run_pipeline(config_from_dict(tiny_config(str(src), *models, train={**train, "engine": "torch"})),
                 log=lambda s: None, show_progress=False)
    ds = tmp_path / "ds"  # checkpoint 1 as a 2-process pod writes it: the optimizer state in two shards
    for part in ("prefixes", "rounds/000000", "checkpoints/000000"):
        shutil.copytree(src / part, ds / part)
    cfg = tmp_path / "ds.yaml"
    cfg.write_text(yaml.safe_dump(tiny_config(str(ds), *models, train=train)))
    _pod_round(s3_server, cfg, 0, tmp_path / "cache-ds", tmp_path / "stats-ds", per_rank_cache=False)
    measured = {}
    for how in ("every rank fetches (before)", "one fetch per pod (now)"):
        root = storage.join(s3_storage, "before" if "before" in how else "now")
        for part in ("prefixes", "rounds/000001"):
            _upload(src / part, storage.join(root, part))
        for part in ("checkpoints/000000", "checkpoints/000001"):
            _upload(ds / part, storage.join(root, part))
        if "before" in how:
            _make_whole(root, 1)
        cfg = tmp_path / f"{len(measured)}.yaml"
        cfg.write_text(yaml.safe_dump(tiny_config(root, *models, train=train)))
        measured[how] = _pod_round(s3_server, cfg, 1, tmp_path / f"cache{len(measured)}",
                                   tmp_path / f"stats{len(measured)}", per_rank_cache="before" in how)
        assert checkpoints.is_committed(root, 2)
    before, now = measured.values()
    print(f"\nS3 bytes read for round 1 by a 2-process training pod: before {before:,} (each rank fetched "
          f"checkpoint 1 and the whole optimizer state), now {now:,} (one fetch per pod, one optimizer shard per "
          f"rank): {now / before:.2f} of before; above one half only the round's scored data and config, which "
          f"every rank reads ({now - before / 2:,.0f} bytes)")
    assert now <= 0.55 * before
    shutil.rmtree(tmp_path / "cache0", ignore_errors=True)
