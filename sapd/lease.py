"""One writer per run root: a lease object in the run root (``_LEASE.json``), taken before a run writes
anything there, renewed while it works, expiring ``storage.lease_ttl_s`` after its last renewal
(docs/FAULTS.md, "A second writer").

The object names its holder: the **owner** — what is compared — and, for people, the process that last
renewed it, the command and the start time. Processes of one owner share the lease: a release's pipeline
driver, the driver that replaces it after a restart or a ``helm upgrade``, its gate Jobs and its stage
Jobs all claim it as ``release R in namespace N`` (the chart sets ``SAPD_LEASE_OWNER`` in every pod), so
none of them waits for another. Anyone else — a second ``sapd run``, another release on the same root —
is refused with one line naming the holder and how to take over, until the lease expires (a crashed
holder stops renewing), its holder is a process of this machine that is gone, or they pass
``--force-takeover``.

How a race between two takers is decided: the lease is created with a conditional PUT (``If-None-Match:
*``) and replaced only with ``If-Match`` the version that was read (locally: ``O_EXCL``-like checks and an
atomic rename under an ``flock``), so of two runs taking it at once exactly one write lands; every taker
then reads the object back and holds the lease only if it finds its own token. Expiry is judged by one
clock, the store's (the S3 answer's ``Date`` against the object's ``Last-Modified``; a file's mtime against
this machine's time), so two hosts whose clocks differ agree. A store that ignores conditional writes
(some S3-compatible servers do) is detected when the lease is taken — a second ``If-None-Match`` PUT must
fail — and reported; there two runs starting within the same moment can both believe they hold it until
the loser's first renewal (a quarter of the lease time) shows it another run's token.

A holder that could not renew on time (a paused or stalled process, an outage) must not go on writing
after someone else may have taken over: every write under the run root first checks the lease
(:func:`sapd.storage.add_write_check`), and once 40 % of the lease time has passed since the last renewal
began (renewals come every 25 %), the check renews synchronously before the write — finding another owner
there, or no lease at all, the write is refused (:class:`LeaseLost`, exit 2). What that leaves: a write
that began before that and lands after (at most one request's duration), and the writes of a live holder
within 40 % of the lease time of someone forcing a takeover (``--force-takeover`` is for a run known to be
dead or stuck).
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

from sapd import layout, storage

LEASE_VERSION = 1
OWNER_ENV = "SAPD_LEASE_OWNER"  # processes given one owner share the lease (the chart: every pod of a release)
# a holder renews every quarter of the lease time, and writes within this share of it after its last renewal
# began; past it (its renewals are late: a paused process, an outage) the next write renews first
SAFE_SHARE = 0.4
_TAKE_ATTEMPTS = 8


class LeaseError(storage.StorageError):
    """A run root's lease stops this process: a user decision is needed, so not retried (exit 2)."""

    exit_code = 2


class LeaseHeld(LeaseError):
    """Another run holds the run root's lease."""


class LeaseLost(LeaseError):
    """This process held the lease and another run has taken it over since."""


def release_owner(release: str, namespace: str) -> str:
    """The owner every process of a Helm release claims the lease as (the chart's ``SAPD_LEASE_OWNER``)."""
    return f"release {release} in namespace {namespace}"


def _release_of_older_chart() -> str:
    """The owner a pod of a chart version without ``SAPD_LEASE_OWNER`` shares with its release's driver:
    such pods set ``SAPD_RELEASE`` and ``SAPD_NAMESPACE`` (every chart version does), a process run by hand
    does not set both."""
    release, namespace = os.environ.get("SAPD_RELEASE", "").strip(), os.environ.get("SAPD_NAMESPACE", "").strip()
    return release_owner(release, namespace) if release and namespace else ""


def _process_name() -> str:
    # a pod's HOSTNAME is its name; a machine's is its host name
    return f"{os.environ.get('HOSTNAME') or socket.gethostname()} pid {os.getpid()}"


def _read(path: str) -> str | None:
    try:
        return Path(path).read_text().strip()
    except OSError:
        return None


def _start_time(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (``/proc/PID/stat`` field 22), None if no such process."""
    stat = _read(f"/proc/{pid}/stat")
    if stat is None:
        return None
    return stat.rsplit(")", 1)[-1].split()[19]


def _this_process() -> dict[str, Any]:
    """What tells this process apart on its machine, even after its pid is reused: host, boot and start time."""
    return {"host": socket.gethostname(), "boot_id": _read("/proc/sys/kernel/random/boot_id"), "pid": os.getpid(),
            "start": _start_time(os.getpid())}


@dataclass(frozen=True)
class Claimant:
    """Who asks for a run root's lease. ``owner`` is what is compared (processes of one owner share the
    lease); ``holder`` names this process for people; ``local``: the owner is this one process (no
    ``SAPD_LEASE_OWNER``), so a taker on the same machine may check whether it is still alive."""

    owner: str
    holder: str
    command: str
    local: bool = False

    @classmethod
    def this_process(cls, command: str) -> Claimant:
        """A door run by hand (``sapd run``, ``python -m sapd.jobs.train`` …): its owner is ``SAPD_LEASE_OWNER``
        when set (the chart's pods; processes a user starts side by side for one run), else the release of a
        pod that names its release and namespace but no owner (a stage Job rendered by a chart version
        before the lease, 0.2.0, adopted by a driver of this one across `helm upgrade`), else this process."""
        shared = os.environ.get(OWNER_ENV, "").strip() or _release_of_older_chart()
        name = _process_name()
        return cls(shared or f"{command} on {name}", name, command, local=not shared)

    @classmethod
    def of_release(cls, release: str, namespace: str, command: str) -> Claimant:
        """The pipeline driver and its gates: the release (``SAPD_LEASE_OWNER`` wins when set)."""
        shared = os.environ.get(OWNER_ENV, "").strip()
        return cls(shared or release_owner(release, namespace), _process_name(), command)


def _parse(data: bytes) -> dict[str, Any] | None:
    try:
        rec = json.loads(data)
    except ValueError:
        return None
    return rec if isinstance(rec, dict) and isinstance(rec.get("owner"), str) else None


def _gone(rec: dict[str, Any]) -> bool:
    """The holder was a process of this machine (this boot) that no longer runs."""
    proc = rec.get("process") or {}
    mine = _this_process()
    if not proc or proc.get("host") != mine["host"] or not mine["boot_id"] or proc.get("boot_id") != mine["boot_id"]:
        return False
    try:
        return _start_time(int(proc["pid"])) != proc.get("start")
    except (KeyError, TypeError, ValueError):
        return False


def _now_iso() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def _below(uri: str, root: str) -> bool:
    if storage.is_s3(root):
        return uri.startswith(root.rstrip("/") + "/")
    path = os.path.abspath(uri.removeprefix("file://"))
    return path.startswith(os.path.abspath(root.removeprefix("file://")).rstrip(os.sep) + os.sep)


def describe(rec: dict[str, Any], age_s: float) -> str:
    """One line about a lease: its owner, process, command, start, last renewal and expiry."""
    ttl = float(rec.get("ttl_s") or 0)
    left = ttl - age_s
    when = f"expires in {left:.0f} s unless renewed" if left > 0 else f"expired {-left:.0f} s ago"
    return (f"{rec.get('owner')} ({rec.get('command', '?')} on {rec.get('holder', '?')}, since "
            f"{rec.get('started_at', '?')}; renewed {age_s:.0f} s ago, {when})")


class RunLease:
    """This process's claim on the lease of ``root`` (see the module docstring). :meth:`acquire` takes it
    (or refuses with :class:`LeaseHeld`), :meth:`start` renews it every quarter of ``ttl_s`` in a thread
    and checks it before every write under the root, :meth:`release` gives it back."""

    def __init__(self, root: str, claimant: Claimant, *, ttl_s: float = 120.0, log: Callable[[str], None] = print,
                 takeover_hint: str = "pass --force-takeover", clock: Callable[[], float] = time.monotonic) -> None:
        if ttl_s < 4:
            raise ValueError(f"lease time {ttl_s} s: must be at least 4 s")
        self.root, self.uri, self.claimant = root, layout.lease_uri(root), claimant
        self.ttl_s, self.log, self.hint, self.clock = float(ttl_s), log, takeover_hint, clock
        self.token = uuid.uuid4().hex
        self.conditional: bool | None = None  # whether the store enforces conditional writes (S3: probed)
        self._started_at = _now_iso()
        self._valid_until = -float("inf")
        self._lost: str | None = None
        self._lock = threading.RLock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._remove_check: Callable[[], None] | None = None

    # ------------------------------------------------------------------------------------ taking it

    def acquire(self, *, force: bool = False) -> RunLease:
        """Take the lease, or join it when this owner holds it; refuse (:class:`LeaseHeld`) when another
        owner holds a live one, unless ``force``."""
        with self._lock:
            for _ in range(_TAKE_ATTEMPTS):
                began = self.clock()
                cur = storage.read_versioned(self.uri)
                if cur is None:
                    if self._put(None, began):
                        break
                    continue
                rec = _parse(cur.data)
                why = self._may_take(rec, cur.age_s, force)
                if rec is not None and rec["owner"] == self.claimant.owner:
                    self._started_at = str(rec.get("started_at") or self._started_at)
                if self._put(cur.etag, began):
                    if why:
                        self.log(why)
                    break
            else:
                raise LeaseHeld(f"{self.uri}: the lease kept changing while this run tried to take it (another run "
                                "is taking it at the same moment); run again once that one says it holds it")
            self._confirm()
        return self

    def _may_take(self, rec: dict[str, Any] | None, age_s: float, force: bool) -> str | None:
        """Why this claimant may write over the lease object now (a line to log), "" to join its own owner's,
        or :class:`LeaseHeld`."""
        if rec is None:
            if force:
                return f"lease: replacing {self.uri}, which is not a lease this sapd reads (--force-takeover)"
            raise LeaseHeld(f"{self.uri} is not a lease this sapd reads (another program wrote it?); if no run writes "
                            f"{self.root}, take over: {self.hint}")
        if rec["owner"] == self.claimant.owner:
            return (f"lease: {rec['owner']} holds {self.root} already (renewed {age_s:.0f} s ago by "
                    f"{rec.get('holder')}); this process shares it")
        if age_s > float(rec.get("ttl_s") or 0):
            return f"lease: taking over {self.root} from {describe(rec, age_s)}"
        if rec.get("process") and _gone(rec):
            return f"lease: taking over {self.root} from {rec['owner']}: that process is gone from this machine"
        if force:
            return f"lease: forcing a takeover of {self.root} from {describe(rec, age_s)} (--force-takeover)"
        raise LeaseHeld(f"run root {self.root} is held by {describe(rec, age_s)}: let that run finish; if it is dead, "
                        f"its lease expires by itself, or take over now: {self.hint}")

    def _record(self) -> bytes:
        rec = {"version": LEASE_VERSION, "owner": self.claimant.owner, "holder": self.claimant.holder,
               "command": self.claimant.command, "started_at": self._started_at, "renewed_at": _now_iso(),
               "ttl_s": self.ttl_s, "token": self.token,
               "process": _this_process() if self.claimant.local else None}
        return (json.dumps(rec, indent=2, sort_keys=True) + "\n").encode()

    def _put(self, etag: str | None, began: float, *, retry: bool = True) -> bool:
        """Write this claimant's lease over version ``etag`` (None: where there is none) → whether it landed."""
        body = self._record()
        try:
            if etag is None:
                storage.write_conditional(self.uri, body, if_absent=True, retry=retry)
            else:
                storage.write_conditional(self.uri, body, if_match=etag, retry=retry)
        except storage.PreconditionFailed:
            back = storage.read_versioned(self.uri, retry=retry)  # a retried PUT whose first attempt landed, too
            rec = _parse(back.data) if back is not None else None
            if rec is None or rec.get("token") != self.token:
                return False
        self._valid_until = began + self.ttl_s * SAFE_SHARE
        return True

    def _confirm(self) -> None:
        """Read the lease back: it must carry this claimant's token (or its owner's). On S3, also ask whether
        the server enforces conditional writes: a second create-if-absent of the same object must fail."""
        back = storage.read_versioned(self.uri)
        rec = _parse(back.data) if back is not None else None
        # this claimant's token, or (processes of one owner taking it at once: a release's Jobs) its owner's
        if back is None or rec is None or (rec.get("token") != self.token and rec["owner"] != self.claimant.owner):
            what = describe(rec, back.age_s) if back is not None and rec is not None else "nobody"
            raise LeaseHeld(f"run root {self.root}: another run took the lease at the same moment; it is held by "
                            f"{what}")
        if storage.is_s3(self.uri) and self.conditional is None:
            try:
                storage.write_conditional(self.uri, back.data, if_absent=True)
                self.conditional = False
                self.log(f"lease: WARNING: the S3 server of {self.root} ignores conditional writes (If-None-Match); "
                         "two runs that take this lease at the same moment may both start, the loser stopping at "
                         "its first renewal (docs/FAULTS.md)")
            except storage.PreconditionFailed:
                self.conditional = True

    # ------------------------------------------------------------------------------------ keeping it

    def renew(self, *, retry: bool = True) -> None:
        """Write the lease again (its renewal time is the store's clock at the write); :class:`LeaseLost`
        when another owner holds it now."""
        with self._lock:
            if self._lost:
                raise LeaseLost(self._lost)
            for _ in range(_TAKE_ATTEMPTS):
                began = self.clock()
                cur = storage.read_versioned(self.uri, retry=retry)
                rec = _parse(cur.data) if cur is not None else None
                if cur is None or rec is None or rec["owner"] != self.claimant.owner:
                    # the owner's own processes never delete a lease another of them still uses (the driver
                    # gives it back when its run is done): gone means taken over (and given back) or deleted
                    who = (describe(rec, cur.age_s) if rec is not None else "an unreadable lease object") \
                        if cur is not None else "nobody: the lease object was deleted"
                    self._lost = (f"run root {self.root}: this run's lease is held by {who} — it was taken over "
                                  "(it expired while this process could not renew it, or someone forced a takeover) "
                                  "or removed; this process writes nothing more there")
                    self.log(f"lease: {self._lost}")
                    raise LeaseLost(self._lost)
                if self._put(cur.etag, began, retry=retry):
                    return
            raise storage.StorageUnavailable(f"{self.uri}: the lease kept changing while this process renewed it")

    def check(self) -> None:
        """Before a write: :class:`LeaseLost` when the lease is lost; renewed first (synchronously, no retry
        of its own: the write's retries cover an outage) when its safe share has run out."""
        if self._lost:
            raise LeaseLost(self._lost)
        if self.clock() > self._valid_until:
            self.renew(retry=False)

    def _check_write(self, uri: str) -> None:
        if uri != self.uri and _below(uri, self.root):
            self.check()

    def start(self) -> RunLease:
        """Renew every quarter of the lease time in a daemon thread, and check the lease before every write
        under the run root."""
        self._remove_check = storage.add_write_check(self._check_write)
        self._thread = threading.Thread(target=self._renew_loop, name=f"lease {self.root}", daemon=True)
        self._thread.start()
        return self

    def _renew_loop(self) -> None:
        wait, told = self.ttl_s / 4, False
        while not self._stop.wait(wait):
            try:
                self.renew(retry=False)
                wait, told = self.ttl_s / 4, False
            except LeaseLost:
                return
            except storage.StorageError as e:
                if not told:  # one line per outage; the writes' own retries log theirs
                    self.log(f"lease: cannot renew {self.uri} now ({e}); retrying — this process writes nothing "
                             f"there after {max(0.0, self._valid_until - self.clock()):.0f} s unless it renews")
                    told = True
                wait = min(self.ttl_s / 4, 5.0)

    def stop(self) -> None:
        """Stop renewing and checking writes; the lease object stays (it expires by itself)."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        if self._remove_check is not None:
            self._remove_check()
            self._remove_check = None

    def release(self, *, for_owner: bool = False) -> None:
        """:meth:`stop`, and delete the lease if this process wrote it last (``for_owner``: if its owner
        holds it, whoever of the owner's processes renewed it last — the driver at the end of a run). One
        try: a lease that cannot be deleted now expires by itself."""
        self.stop()
        if self._lost:
            return
        try:
            cur = storage.read_versioned(self.uri, retry=False)
            rec = _parse(cur.data) if cur is not None else None
            if cur is not None and rec is not None and rec["owner"] == self.claimant.owner and \
                    (for_owner or rec.get("token") == self.token):
                storage.delete_conditional(self.uri, cur.etag, retry=False)
        except storage.PreconditionFailed:
            pass  # renewed by another process of this owner meanwhile: theirs now
        except storage.StorageError as e:  # it expires by itself
            self.log(f"lease: could not give back {self.uri} ({e}); it expires {self.ttl_s:.0f} s after its last "
                     "renewal")


@contextlib.contextmanager
def holding(root: str, claimant: Claimant, *, ttl_s: float, log: Callable[[str], None] = print, force: bool = False,
            takeover_hint: str = "pass --force-takeover", give_back: str = "mine") -> Iterator[RunLease]:
    """The lease of ``root`` for the ``with`` block: taken (or refused), renewed and checked before every
    write while the block runs, given back after it (``give_back``: "mine" — if this process renewed it
    last —, "owner" — whichever process of this owner did —, or "no": left to expire, for the many
    processes of one owner that come and go)."""
    lease = RunLease(root, claimant, ttl_s=ttl_s, log=log, takeover_hint=takeover_hint).acquire(force=force)
    lease.start()
    try:
        yield lease
    except BaseException:
        if give_back == "mine":  # this process was the run: nothing of it goes on
            lease.release()
        else:  # the owner's other processes may (a restarted driver's stage Jobs): leave it to them
            lease.stop()
        raise
    if give_back == "no":
        lease.stop()
    else:
        lease.release(for_owner=give_back == "owner")


def check_not_held(root: str, claimant: Claimant, *,
                   hint: str = "this process belongs to another run: point it at its own run root") -> None:
    """For a process that writes beside the run without holding the lease (an evaluation of committed
    checkpoints): :class:`LeaseHeld` when another owner holds a live lease on ``root``."""
    cur = storage.read_versioned(layout.lease_uri(root))
    rec = _parse(cur.data) if cur is not None else None
    if cur is None or rec is None or rec["owner"] == claimant.owner:
        return
    if cur.age_s <= float(rec.get("ttl_s") or 0) and not (rec.get("process") and _gone(rec)):
        raise LeaseHeld(f"run root {root} is held by {describe(rec, cur.age_s)}, not by {claimant.owner}: {hint}")
