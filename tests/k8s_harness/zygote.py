"""A warm start for the harness's Python pods: one process per image environment that has imported torch (and the
other heavy libraries the stages import, :data:`PRELOAD`) and forks a pod's process from there, instead of each pod
importing them afresh (≈ 2–4 s of CPU per pod on a loaded 2-core machine; ``import torch`` alone took 3.0 s user +
0.6 s system there).

    python zygote.py SOCKET     # started by the kubelet (``Zygotes``), one per environment and start-up settings

What a pod's process is, is kept: the child makes a session of its own (as ``start_new_session``: the kubelet
signals its process group), sets up the container's mounts and identity exactly as ``sandbox.py`` does (the same
``confine``), takes the pod's stdout/stderr (its log file, passed over the socket) and environment, changes to the
container's working directory, and runs ``python -m MODULE ARGS`` (or ``torchrun ARGS``) as the interpreter would:
``__main__`` a fresh module, ``sys.argv`` and ``sys.path[0]`` as ``-m`` sets them, its exit code, traceback and
``atexit`` handlers those of the normal interpreter exit. The zygote reaps it and sends its exit status (``-N`` for
signal N, as ``Popen.returncode``) over the pod's connection.

What the imported libraries read from the environment at import time is the zygote's, so a zygote serves only
pods whose start-up settings are its own (:data:`STARTUP_VARS`: ``PATH``, ``PYTHON*``, thread counts, locale,
``TORCH*``, but not what is read when used: :data:`READ_WHEN_USED`); Hugging Face's libraries, which read their
cache folders from the environment at import time, are not preloaded. The random generators are seeded afresh in each child (a fresh interpreter seeds them from the
OS).
"""

from __future__ import annotations

import atexit
import json
import os
import select
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# What every stage imports, then the parts of torch and the third-party modules transformers imports (measured with
# -X importtime: after the first line, a stage pod's imports took 3.2 s, transformers' own modules 1.2 s of it).
# Not Hugging Face's libraries (see above), nor botocore: it keeps folders under HOME from its import (~/.aws/…).
PRELOAD = ("torch", "numpy", "yaml", "pyarrow", "pyarrow.parquet", "safetensors.torch", "jinja2", "tokenizers",
           "sympy", "torch._dynamo", "torch._functorch._aot_autograd", "torch.distributed.tensor",
           "torch.distributed.fsdp", "torch.distributed._functional_collectives", "torch._inductor.config",
           "torch.onnx", "urllib3", "filelock", "h11", "httpx", "PIL.Image", "regex", "packaging.version")
# environment variables read at interpreter start or at the preloaded libraries' import: a zygote serves pods whose
# values of these are its own (exact names, then prefixes)
STARTUP_VARS = ("PATH", "LANG", "TZ")
STARTUP_PREFIXES = ("PYTHON", "LC_", "OMP_", "MKL_", "KMP_", "OPENBLAS_", "GOTO_", "TORCH", "PYTORCH", "CUDA_",
                    "NVIDIA_", "LD_", "MALLOC_", "GOMP_", "ARROW_", "SYMPY_")
# read when used, not at import: not a reason for another zygote (each journey's node cache has its own folder)
READ_WHEN_USED = ("TORCH_EXTENSIONS_DIR",)


def startup_env(env: dict[str, str]) -> dict[str, str]:
    """The part of a pod's environment a zygote must share with it (:data:`STARTUP_VARS`)."""
    return {k: v for k, v in env.items()
            if (k in STARTUP_VARS or k.startswith(STARTUP_PREFIXES)) and k not in READ_WHEN_USED}


def _load_sandbox():
    import importlib.util
    spec = importlib.util.spec_from_file_location("_harness_sandbox", os.path.join(HERE, "sandbox.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


HERE = os.path.dirname(os.path.abspath(__file__))


def serve(path: str):
    """Accept requests until a child is forked (returned in the child: its request and log fd) or the kubelet's
    process is gone (exit)."""
    parent = os.getppid()  # checked each second: the zygote goes with the test process (not PR_SET_PDEATHSIG,
    # which fires when the starting *thread* ends: a cluster's kubelet thread, while the process goes on)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(path)
    listener.listen(64)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    sel = selectors.DefaultSelector()
    sel.register(listener, selectors.EVENT_READ, "accept")
    sel.register(wake_r, selectors.EVENT_READ, "wake")
    children: dict[int, socket.socket] = {}
    conns: list[socket.socket] = []
    print("ready", flush=True)
    while True:
        for key, _ in sel.select(timeout=1.0):
            if key.data == "accept":
                conn, _ = listener.accept()
                conns.append(conn)
                sel.register(conn, selectors.EVENT_READ, "request")
            elif key.data == "wake":
                try:
                    os.read(wake_r, 4096)
                except BlockingIOError:
                    pass
            else:
                conn = key.fileobj
                try:
                    msg, fds, _, _ = socket.recv_fds(conn, 1 << 20, 1)
                except OSError:
                    msg, fds = b"", []
                sel.unregister(conn)
                if not msg or len(fds) != 1:  # the kubelet gave up on it before asking
                    for fd in fds:
                        os.close(fd)
                    conns.remove(conn)
                    conn.close()
                    continue
                sys.stdout.flush()
                sys.stderr.flush()
                pid = os.fork()
                if pid == 0:
                    signal.set_wakeup_fd(-1)
                    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                    sel.close()
                    for c in conns:
                        c.close()
                    listener.close()
                    os.close(wake_r)
                    os.close(wake_w)
                    return json.loads(msg), fds[0]
                os.close(fds[0])
                children[pid] = conn
                try:
                    conn.send(f"pid {pid}".encode())
                except OSError:
                    pass
        while children:  # reap: each child's status to its pod's connection
            try:
                pid, status, usage = os.wait4(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            conn = children.pop(pid, None)
            if conn is not None:
                try:  # its CPU seconds too (and its children's it waited for): what the test process is charged
                    conn.send(f"exit {os.waitstatus_to_exitcode(status)} {usage.ru_utime + usage.ru_stime}".encode())
                except OSError:
                    pass
                conns.remove(conn)
                conn.close()
        if os.getppid() != parent:
            os._exit(0)


def become(req: dict, log_fd: int, sandbox) -> None:
    """In the child: the container's process (see the module docstring), up to running its command."""
    os.setsid()
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(log_fd, 1)
    os.dup2(log_fd, 2)
    os.close(null)
    os.close(log_fd)
    os.closerange(3, 4096)  # what exec with close_fds leaves: nothing of the zygote's
    failed = sandbox.become(req["spec"], [req["program"], *req["argv"]])  # as sandbox.py does before exec
    if failed is not None:
        os._exit(failed)
    os.environ.clear()
    os.environ.update(req["env"])
    sys.orig_argv = [req["program"], *(["-m"] if req["kind"] == "module" else []), *req["argv"]]
    import multiprocessing.process
    import random
    multiprocessing.process.ORIGINAL_DIR = os.getcwd()  # what a spawned child resolves __main__'s path from
    random.seed()
    tempfile.tempdir = None  # found again from the pod's TMPDIR at first use
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()


def run(req: dict) -> None:
    """Run the pod's command as the interpreter would (``python -m MODULE ARGS`` or ``torchrun ARGS``)."""
    import runpy
    import types
    kind, argv = req["kind"], req["argv"]
    sys.modules["__main__"] = types.ModuleType("__main__")
    if kind == "torchrun":
        sys.argv = [req["program"], *argv]
        from torch.distributed.run import main
        sys.exit(main())
    sys.argv = ["-m", *argv[1:]]
    sys.path[0] = os.getcwd()  # what -m puts first (the zygote's own folder was there)
    runpy._run_module_as_main(argv[0])  # type: ignore[attr-defined]  # exactly what `python -m` calls


# --------------------------------------------------------------------------------------------------
# the kubelet's side


def pod_command(argv: list[str], env: dict[str, str]) -> dict | None:
    """How a zygote would run a container's command: ``python -m MODULE ARGS`` or ``torchrun ARGS`` with the
    image environment's interpreter first on the container's PATH; None for anything else (run as it is)."""
    path = env.get("PATH", "")
    if len(argv) >= 3 and argv[0] in ("python", "python3") and argv[1] == "-m":
        program = shutil.which(argv[0], path=path)
        kind, rest = "module", argv[2:]
    elif argv[:1] == ["torchrun"]:
        program = shutil.which("torchrun", path=path)
        kind, rest = "torchrun", argv[1:]
    else:
        return None
    if not program:
        return None
    python = Path(program).parent / "python"
    if not python.is_file() or not os.access(python, os.X_OK):
        return None
    return {"kind": kind, "program": program, "python": str(python), "argv": rest}


class ForkedProcess:
    """What the kubelet uses of ``subprocess.Popen`` (``pid``, ``poll``, ``wait``, ``returncode``) for a process a
    zygote forked: its exit status comes over the pod's connection."""

    # user + system CPU seconds of every process the zygotes forked for this test process and that ended: a
    # subprocess's are the test process's once it waits for it; a zygote's child is not its child, so
    # tests/conftest.py adds these (the per-file durations table)
    cpu_seconds = 0.0

    def __init__(self, conn: socket.socket, pid: int, args: list[str]):
        self.conn, self.pid, self.args, self.returncode = conn, pid, args, None

    def _receive(self, timeout: float) -> None:
        if not select.select([self.conn], [], [], max(0.0, timeout))[0]:
            return
        try:
            msg = self.conn.recv(256)
        except OSError:
            msg = b""
        # the zygote gone without a word: the process went with it (its death signal)
        words = msg.split() if msg.startswith(b"exit ") else [b"exit", str(-signal.SIGKILL).encode(), b"0"]
        self.returncode = int(words[1])
        ForkedProcess.cpu_seconds += float(words[2])
        self.conn.close()

    def poll(self) -> int | None:
        if self.returncode is None:
            self._receive(0.0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.returncode is None:
            left = 3600.0 if deadline is None else deadline - time.monotonic()
            if left <= 0:
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
            self._receive(left)
        return self.returncode


class Zygotes:
    """This test process's zygotes, one per image environment and start-up settings (:func:`startup_env`),
    started at their first pod and stopped when the process ends. ``SAPD_HARNESS_ZYGOTE=0`` turns them off (every
    pod then starts its interpreter afresh, as before)."""

    LIMIT = 8  # zygotes at once (≈ 0.35 GB each): past it, one idle for IDLE_SECONDS goes, or pods start afresh
    IDLE_SECONDS = 120.0

    def __init__(self) -> None:
        self.folder: Path | None = None
        self.servers: dict[tuple, tuple[subprocess.Popen, str] | None] = {}
        self.forked: dict[tuple, list[ForkedProcess]] = {}  # by zygote: what it forked and may still run
        self.used: dict[tuple, float] = {}  # by zygote: when it last forked
        self.started = 0
        atexit.register(self.stop)

    def _retire_idle(self) -> None:
        """Stop the zygotes that forked nothing for IDLE_SECONDS and whose every child ended (a zygote carries its
        children's exit statuses: it must outlive them)."""
        for key, got in list(self.servers.items()):
            if got is None:
                continue
            live = [p for p in self.forked.get(key, []) if p.poll() is None]
            self.forked[key] = live
            if not live and time.monotonic() - self.used.get(key, 0.0) > self.IDLE_SECONDS:
                got[0].kill()
                got[0].wait()
                del self.servers[key]

    @staticmethod
    def enabled() -> bool:
        return os.environ.get("SAPD_HARNESS_ZYGOTE", "1") != "0"

    @staticmethod
    def key(python: str, env: dict[str, str]) -> tuple:
        """Which zygote serves a pod: its interpreter and its start-up settings."""
        return python, tuple(sorted(startup_env(env).items()))

    def _server(self, key: tuple) -> str | None:
        """The socket of the zygote for ``key`` (:meth:`key`), started if need be; None if none can serve."""
        python, startup = key[0], dict(key[1])
        if key in self.servers:
            got = self.servers[key]
            if got is None:  # it could not start: no second try
                return None
            if got[0].poll() is None:
                return got[1]
            del self.servers[key]  # gone (killed?): start another
        if len(self.servers) >= self.LIMIT:
            self._retire_idle()
        if len(self.servers) >= self.LIMIT:
            return None
        if self.folder is None:
            self.folder = Path(tempfile.mkdtemp(prefix="sapd-zygotes-"))
        n, self.started = self.started, self.started + 1
        sock = str(self.folder / f"z{n}.sock")
        home = str(self.folder / "no-home")  # not a folder: nothing is read from the zygote's HOME
        with open(self.folder / f"z{n}.log", "wb") as err:
            proc = subprocess.Popen([python, __file__, sock], env={**startup, "HOME": home}, cwd=self.folder,
                                    stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=err)
        assert proc.stdout is not None
        ready = bool(select.select([proc.stdout], [], [], 300)[0]) and proc.stdout.readline() == b"ready\n"
        proc.stdout.close()
        self.servers[key] = (proc, sock) if ready else None
        if not ready:
            proc.kill()
        return sock if ready else None

    def spawn(self, argv: list[str], env: dict[str, str], spec: dict, log: Path) -> ForkedProcess | None:
        """Fork the container's process from a zygote (None: not a command a zygote runs, or none could start;
        the kubelet then starts it afresh)."""
        cmd = pod_command(argv, env) if self.enabled() else None
        if cmd is None:
            return None
        key = self.key(cmd["python"], env)
        sock = self._server(key)
        if sock is None:
            return None
        self.used[key] = time.monotonic()
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            conn.connect(sock)
            with open(log, "ab") as f:
                socket.send_fds(conn, [json.dumps({**cmd, "env": env, "spec": spec}).encode()], [f.fileno()])
        except OSError:  # nothing was started: start it afresh
            conn.close()
            return None
        # asked: from here a failure is the container's (the kubelet's "cannot start", exit 128), never a second start
        msg = conn.recv(256) if select.select([conn], [], [], 120)[0] else b""
        if not msg.startswith(b"pid "):
            conn.close()
            raise OSError(f"the harness's zygote for {cmd['python']} did not start it (answered {msg!r})")
        child = ForkedProcess(conn, int(msg.split()[1]), argv)
        self.forked.setdefault(key, []).append(child)
        return child

    def stop(self) -> None:
        for got in self.servers.values():
            if got is not None and got[0].poll() is None:
                got[0].kill()
                got[0].wait()
        self.servers.clear()
        if self.folder is not None:
            shutil.rmtree(self.folder, ignore_errors=True)
            self.folder = None


def main() -> None:
    sys.path[0] = os.getcwd()
    import importlib
    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except ImportError:  # an environment without it: its pods import it (or not) themselves
            pass
    sandbox = _load_sandbox()  # once, for every child
    req, log_fd = serve(sys.argv[1])
    become(req, log_fd, sandbox)
    run(req)


if __name__ == "__main__":
    main()
