"""The run root's lease (sapd/lease.py), locally and on a real S3 server (SeaweedFS, which enforces
conditional PUTs): one owner writes a run root at a time; the others are refused with one line naming the
holder, take it over once it expires or its process is gone, or force it; a holder that lost it writes
nothing more there. (The doors that take it — `sapd run`, the stage jobs, the pipeline driver — are
tested running: tests/run/test_faults.py, tests/cluster/test_journeys_lifecycle.py.)"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from sapd import layout, lease, storage
from sapd.lease import Claimant, LeaseHeld, LeaseLost, RunLease

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(params=["local", "s3"])
def root(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "local":
        return str(tmp_path / "run")
    return request.getfixturevalue("s3_storage") + "/run"


def who(owner: str) -> Claimant:
    return Claimant(owner, f"host-{owner.split()[-1]} pid 7", "sapd run")


class Clock:
    """A monotonic clock the test moves."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_second_owner_is_refused_in_one_line_naming_the_holder(root: str) -> None:
    lines: list[str] = []
    a = RunLease(root, who("run A"), ttl_s=60, log=lines.append).acquire()
    with pytest.raises(LeaseHeld) as info:
        RunLease(root, who("run B"), ttl_s=60, takeover_hint="run `sapd run` again with --force-takeover").acquire()
    message = str(info.value)
    assert "\n" not in message and info.value.exit_code == 2
    assert message.startswith(f"run root {root} is held by run A (sapd run on host-A pid 7, since ")
    # the ages come from the store's clock (S3 dates step by whole seconds) and this machine's pace: a few seconds
    m = re.search(r"renewed (\d+) s ago, expires in (\d+) s unless renewed\): let that run finish; if it is dead, "
                  r"its lease expires by itself, or take over now: run `sapd run` again with --force-takeover$", message)
    assert m and int(m[1]) <= 5 and 55 <= int(m[2]) <= 60, message
    # processes of one owner share it: a restarted driver, the stage Jobs of a release
    RunLease(root, Claimant("run A", "host-A2 pid 9", "python -m sapd.jobs.train"), ttl_s=60, log=lines.append).acquire()
    assert len(lines) == 1 and re.fullmatch(rf"lease: run A holds {re.escape(root)} already \(renewed [0-5] s ago by "
                                            r"host-A pid 7\); this process shares it", lines[0]), lines
    a.release(for_owner=True)
    assert storage.read_versioned(layout.lease_uri(root)) is None
    RunLease(root, who("run B"), ttl_s=60).acquire()  # given back: the next run takes it at once


def test_an_expired_lease_is_taken_over_and_its_old_holder_writes_nothing_more(root: str) -> None:
    clock = Clock()
    a = RunLease(root, who("run A"), ttl_s=4, clock=clock).acquire().start()  # renews every 1 s …
    try:
        a._stop.set()  # … but stalls: no renewal from now on (a stopped process, a partition)
        storage.write_text(storage.join(root, "config.yaml"), "a writes while it holds the lease\n")
        time.sleep(5.5)  # the store's clock says: expired (S3 dates have one-second steps: age 5 s at least)
        lines: list[str] = []
        RunLease(root, who("run B"), ttl_s=4, log=lines.append).acquire()
        assert len(lines) == 1 and lines[0].startswith(f"lease: taking over {root} from run A (") and " ago)" in lines[0]
        # A's own clock says its lease ran out too: before its next write it renews, finds B, and stops
        clock.now += 4 * lease.SAFE_SHARE + 1
        with pytest.raises(LeaseLost, match=f"^run root {root}: this run's lease is held by run B .* writes nothing "
                                            "more there$"):
            storage.write_text(storage.join(root, "config.yaml"), "a again\n")
        assert storage.read_text(storage.join(root, "config.yaml")) == "a writes while it holds the lease\n"
        storage.write_text(storage.join(root + "-elsewhere", "x"), "other roots are not its business\n")
    finally:
        a.stop()


def test_renewals_keep_a_live_holder_and_the_next_run_takes_it_once_given_back(root: str) -> None:
    with lease.holding(root, who("run A"), ttl_s=4, give_back="mine"):
        time.sleep(6)  # longer than the lease: renewed every second meanwhile
        with pytest.raises(LeaseHeld, match="held by run A"):
            RunLease(root, who("run B"), ttl_s=4).acquire()
    RunLease(root, who("run B"), ttl_s=4).acquire()


def test_a_forced_takeover_stops_the_holder_at_its_next_renewal(root: str) -> None:
    lines: list[str] = []
    a = RunLease(root, who("run A"), ttl_s=4, log=lines.append).acquire().start()
    try:
        RunLease(root, who("run B"), ttl_s=60, log=lines.append).acquire(force=True)
        assert lines[0].startswith(f"lease: forcing a takeover of {root} from run A (") and "(--force-takeover)" in lines[0]
        deadline = time.monotonic() + 10
        while a._lost is None and time.monotonic() < deadline:
            time.sleep(0.1)  # A renews every second
        with pytest.raises(LeaseLost):
            storage.write_text(storage.join(root, "prefixes", "_MANIFEST.json"), "{}")
        assert not storage.exists(storage.join(root, "prefixes", "_MANIFEST.json"))
        assert any(line.startswith(f"lease: run root {root}: this run's lease is held by run B") for line in lines)
    finally:
        a.stop()
    a.release()  # a lost lease is not given back: it is B's
    assert "run B" in storage.read_text(layout.lease_uri(root))


def test_of_many_runs_taking_it_at_once_exactly_one_holds_it(root: str) -> None:
    barrier = threading.Barrier(6)

    def take(i: int) -> str:
        barrier.wait()
        try:
            RunLease(root, who(f"run {i}"), ttl_s=60).acquire()
            return "held"
        except LeaseHeld:
            return "refused"

    with_threads: list[str] = [""] * 6
    threads = [threading.Thread(target=lambda i=i: with_threads.__setitem__(i, take(i))) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert sorted(with_threads) == ["held"] + ["refused"] * 5
    winner = with_threads.index("held")
    assert f'"owner": "run {winner}"' in storage.read_text(layout.lease_uri(root))


def test_a_holder_whose_process_is_gone_from_this_machine_is_taken_over_at_once(tmp_path: Path,
                                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """`sapd run` killed with SIGKILL leaves its lease behind; the next `sapd run` on the same machine sees
    that process gone (host, boot, pid and start time recorded) and does not wait for the lease to expire."""
    monkeypatch.delenv(lease.OWNER_ENV, raising=False)
    root = str(tmp_path / "run")
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from sapd import lease; "
         "lease.RunLease(sys.argv[1], lease.Claimant.this_process('sapd run'), ttl_s=600).acquire(); "
         "print('held', flush=True); time.sleep(600)", root],
        cwd=REPO, stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        me = Claimant.this_process("sapd run")
        assert me.local and me.owner == f"sapd run on {me.holder}"
        with pytest.raises(LeaseHeld, match=f"held by sapd run on .* pid {holder.pid} "):  # alive: refused
            RunLease(root, me, ttl_s=600).acquire()
        os.kill(holder.pid, signal.SIGKILL)
        holder.wait(10)
    finally:
        holder.kill()
    lines: list[str] = []
    RunLease(root, me, ttl_s=600, log=lines.append).acquire()
    assert lines == [f"lease: taking over {root} from sapd run on {me.holder.split(' pid ')[0]} pid {holder.pid}: "
                     "that process is gone from this machine"]


def test_an_evaluation_beside_a_run_checks_the_owner_only(root: str) -> None:
    RunLease(root, who("release a in namespace x"), ttl_s=60).acquire()
    lease.check_not_held(root, who("release a in namespace x"))  # its own release's run: fine
    with pytest.raises(LeaseHeld, match="held by release a in namespace x .*, not by release b in namespace x"):
        lease.check_not_held(root, who("release b in namespace x"))
    lease.check_not_held(root + "-other", who("release b in namespace x"))  # no lease there: fine


def test_a_store_that_ignores_conditional_writes_is_reported(s3_storage: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Some S3-compatible servers ignore If-None-Match: the lease says so when it is taken."""
    real = storage.write_conditional

    def ignoring(uri: str, data: bytes, **kwargs: Any) -> str:
        storage.write_bytes(uri, data)
        return ""

    monkeypatch.setattr(storage, "write_conditional", ignoring)
    lines: list[str] = []
    held = RunLease(s3_storage + "/run", who("run A"), ttl_s=60, log=lines.append).acquire()
    assert held.conditional is False
    assert lines == [f"lease: WARNING: the S3 server of {s3_storage}/run ignores conditional writes (If-None-Match); "
                     "two runs that take this lease at the same moment may both start, the loser stopping at its "
                     "first renewal (docs/FAULTS.md)"]
    monkeypatch.setattr(storage, "write_conditional", real)
    assert RunLease(s3_storage + "/run2", who("run A"), ttl_s=60).acquire().conditional is True  # SeaweedFS enforces


def test_processes_of_one_owner_taking_it_at_once_all_hold_it(root: str) -> None:
    """A release's Jobs start together (an Indexed Job's workers, a restarted driver): when one writes the
    lease between another's write and its read-back, both hold it (the owner's, not a stranger's)."""
    owner = "release a in namespace x"
    first = RunLease(root, Claimant(owner, "pod-0 pid 1", "teacher_scores"), ttl_s=60)
    assert first._put(None, time.monotonic())  # the first worker's write lands …
    RunLease(root, Claimant(owner, "pod-1 pid 1", "teacher_scores"), ttl_s=60).acquire()  # … the second's over it
    first._confirm()  # the first reads back the second's token: its owner's, so it holds the lease too
    with pytest.raises(LeaseHeld, match="another run took the lease at the same moment"):
        stranger = RunLease(root, who("run B"), ttl_s=60)
        stranger._confirm()  # a stranger reading back someone else's token does not


def test_a_pod_of_a_chart_before_the_lease_shares_its_release_s_lease(tmp_path: Path, monkeypatch) -> None:
    """A stage Job rendered by chart 0.2.0 (no SAPD_LEASE_OWNER, but SAPD_RELEASE and SAPD_NAMESPACE, as every
    chart version sets) and adopted by this version's driver across `helm upgrade` claims the lease as its
    release, which the driver holds: it works beside it instead of being refused. A process run by hand
    (no release and namespace both) stays itself, and another release's pod is refused."""
    root = str(tmp_path / "run")
    monkeypatch.delenv(lease.OWNER_ENV, raising=False)
    monkeypatch.delenv("SAPD_NAMESPACE", raising=False)
    monkeypatch.setenv("SAPD_RELEASE", "sapd-upg")
    assert Claimant.this_process("python -m sapd.jobs.train").local  # a release alone is not a pod of one
    driver = RunLease(root, Claimant.of_release("sapd-upg", "sapd", "python -m sapd.jobs.pipeline"), ttl_s=600)
    driver.acquire()
    monkeypatch.setenv("SAPD_NAMESPACE", "sapd")
    old_pod = Claimant.this_process("python -m sapd.jobs.train")
    assert not old_pod.local and old_pod.owner == lease.release_owner("sapd-upg", "sapd")
    RunLease(root, old_pod, ttl_s=600).acquire()  # shared, not refused
    monkeypatch.setenv("SAPD_RELEASE", "sapd-other")
    with pytest.raises(LeaseHeld, match="held by release sapd-upg in namespace sapd"):
        RunLease(root, Claimant.this_process("python -m sapd.jobs.train"), ttl_s=600).acquire()
