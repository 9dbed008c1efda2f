"""One download per pod (sapd/models/loading.py ``fetch_once``), against a real S3 server (SeaweedFS): the
processes sharing a cache (the ranks of a training pod, its scratch or the node's model cache) fetch a
model folder once; a rank killed mid-download hands the rest to a waiting rank; a downloader that makes
no progress makes the waiters fail after a deadline, naming it. And the S3 bytes a 2-process training pod
reads for one round, measured both ways: every rank fetching checkpoint k and the whole optimizer state
itself (before), against one fetch per pod and one optimizer shard per rank (now).

On a file system without ``flock`` (NFSv3 mounted ``nolock``, some FUSE and CSI drivers; simulated here:
every ``flock`` of the process fails with ENOLCK, as such a file system answers) the same holds with a
lock file and its heartbeat: one download, a killed holder's lock taken over, and where not even a lock
file can be made, one line naming the folder."""

from __future__ import annotations

import errno
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
from sapd.models.loading import DownloadLock, FetchStalled, ModelCacheLockError, fetch_once
from sapd.run.local import run_pipeline
from tests.conftest import free_port
from tests.pipeline_util import make_models, ranks_failed, tiny_config

REPO = Path(__file__).resolve().parents[2]


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


def _resolve(s3, uri: str, cache: Path, out: Path, *extra: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "tests/fetch_worker.py", "resolve", uri, str(cache), str(out), *extra],
                            cwd=REPO, env={**_env(s3), **(env or {})}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


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


def download_by_hand(dest: Path, uri: str, files: dict[str, bytes], *, steps: int, pause: float) -> None:
    """Another process's download into ``dest``, slow: a temp file growing for ``steps`` × ``pause``
    seconds, then the files and the completion marker."""
    with open(dest / ".part.sapd-tmp", "wb") as part:
        for _ in range(steps):
            part.write(b"x" * 1000)
            part.flush()
            time.sleep(pause)
    (dest / ".part.sapd-tmp").unlink()
    for name, data in files.items():
        (dest / name).write_bytes(data)
    (dest / ".sapd-sync-complete").write_text(uri)


def test_a_slow_downloader_making_progress_is_waited_for(model_on_s3, tmp_path):
    uri, files = model_on_s3
    dest = tmp_path / "scratch" / "m"
    dest.mkdir(parents=True)

    def slow_holder(lock) -> None:  # a download that takes 2.5 s, its bytes growing all the while
        try:
            download_by_hand(dest, uri, files, steps=8, pause=0.3)
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
# a file system without flock

NO_FLOCK = {"SAPD_TEST_FLOCK_ERRNO": "ENOLCK"}  # what flock answers on NFSv3 mounted `nolock`


def test_without_flock_the_ranks_of_a_pod_still_download_once(s3_server, model_on_s3, tmp_path):
    """Two ranks at once, each downloading slowly (0.4 s a file, so the second meets the first's lock and
    its heartbeat, beating every 0.25 s against a 1 s staleness): one downloads everything, the other waits
    and reads nothing, and each says once why it does not use flock."""
    uri, files = model_on_s3
    cache = tmp_path / "scratch"
    env = {**NO_FLOCK, "SAPD_FETCH_LOCK_STALE_S": "1"}
    procs = [_resolve(s3_server, uri, cache, tmp_path / f"r{r}.json", "--hold-seconds", "0.4", env=env)
             for r in range(2)]
    outputs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outputs
    read = sorted(json.loads((tmp_path / f"r{r}.json").read_text())["s3_read_bytes"] for r in range(2))
    assert read == [0, sum(len(b) for b in files.values())], outputs  # once, although the heartbeat's stale time
    for out in outputs:  # (1 s) is shorter than the download (0.4 s × files): the holder's beat kept it
        assert "this file system refuses flock (ENOLCK); locking the download with" in out, out
        assert "taking it over" not in out, out
    (dest,) = [d for d in (cache / "models").iterdir() if d.is_dir()]
    assert {f.name: f.read_bytes() for f in dest.iterdir() if not f.name.startswith(".")} == files
    assert not list(cache.rglob("*.lock.owner*"))  # released: the lock file is gone


def test_without_flock_a_killed_downloaders_lock_is_taken_over(s3_server, model_on_s3, tmp_path):
    uri, files = model_on_s3
    cache = tmp_path / "scratch"
    env = {**NO_FLOCK, "SAPD_FETCH_LOCK_STALE_S": "1"}
    killed = _resolve(s3_server, uri, cache, tmp_path / "a.json", "--die-after-files", "2", env=env)
    assert killed.wait(timeout=300) == -9
    (owner,) = list((cache / "models").glob("*.lock.owner"))  # the dead holder's lock stays behind
    assert owner.read_text().startswith(f"pid {killed.pid} on ")
    t0 = time.monotonic()
    survivor = _resolve(s3_server, uri, cache, tmp_path / "b.json", env=env)
    out = survivor.communicate(timeout=300)[0]
    assert survivor.returncode == 0, out
    assert time.monotonic() - t0 >= 1.0  # it waited for the lock to go stale, no longer than it had to
    assert f"pid {killed.pid} on " in out and "has shown no heartbeat for 1 s; taking it over" in out, out
    first_two = sorted(files)[:2]
    b = json.loads((tmp_path / "b.json").read_text())
    assert b["s3_read_bytes"] == sum(len(files[n]) for n in files if n not in first_two)  # kept what was there
    dest = owner.with_name(owner.name.removesuffix(".lock.owner"))
    assert {f.name: f.read_bytes() for f in dest.iterdir() if not f.name.startswith(".")} == files
    assert not list(cache.rglob("*.lock.owner*"))


def test_a_live_holders_heartbeat_keeps_its_lock(model_on_s3, tmp_path, monkeypatch):
    """In-process: a holder (a thread) keeps the lock file for 3 stale periods while its bytes grow; the
    waiter neither takes it over nor gives up, and finds the holder's download."""
    from tests.fetch_worker import refuse_flock
    uri, files = model_on_s3
    dest = tmp_path / "scratch" / "m"
    dest.mkdir(parents=True)
    monkeypatch.setattr(fcntl, "flock", fcntl.flock)  # restored after the test
    refuse_flock("EOPNOTSUPP")  # what some FUSE and CSI drivers answer
    holder_lock = DownloadLock(dest, stale_s=0.4, log=lambda line: None)
    assert holder_lock.acquire() and not holder_lock.flock

    def hold() -> None:
        try:
            download_by_hand(dest, uri, files, steps=12, pause=0.1)  # 1.2 s: three stale periods
        finally:
            holder_lock.release()
            holder_lock.close()

    thread = threading.Thread(target=hold)
    thread.start()
    storage.reset_transfer_stats()
    seen: list[str] = []
    try:
        assert fetch_once(uri, dest, stall_s=5.0, poll_s=0.05, log=seen.append, lock_stale_s=0.4) == dest
    finally:
        thread.join()
    assert storage.transfer_stats()["s3_read_bytes"] == 0
    # (EOPNOTSUPP and ENOTSUP are one number on Linux, whose name errno gives)
    assert any(f"refuses flock ({errno.errorcode[errno.EOPNOTSUPP]})" in line for line in seen) and not any("taking it over" in s for s in seen)
    assert any("waiting for pid" in line for line in seen), seen


def test_no_flock_and_no_lock_file_is_one_line(model_on_s3, tmp_path, monkeypatch):
    """A cache where flock is refused and no lock file can be created either (a read-only or
    O_EXCL-less mount, simulated): one line naming the folder and what to do, exit code 2."""
    from sapd.entry import exit_code
    from tests.fetch_worker import refuse_flock
    uri, _ = model_on_s3
    dest = tmp_path / "cache" / "m"
    monkeypatch.setattr(fcntl, "flock", fcntl.flock)
    refuse_flock("ENOLCK")
    real_open = os.open

    def no_exclusive_create(path, flags, *args):
        if flags & os.O_EXCL:
            raise OSError(errno.EROFS, os.strerror(errno.EROFS))
        return real_open(path, flags, *args)

    monkeypatch.setattr(os, "open", no_exclusive_create)
    with pytest.raises(ModelCacheLockError) as e:
        fetch_once(uri, dest, stall_s=1.0, poll_s=0.05, log=lambda line: None)
    message = str(e.value)
    assert "\n" not in message and message.startswith(f"{dest}: cannot lock the model cache: flock is refused")
    assert "Read-only file system" in message and "SAPD_CACHE_DIR" in message and exit_code(e.value) == 2


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
    assert proc.returncode == 0, ranks_failed(proc)
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
