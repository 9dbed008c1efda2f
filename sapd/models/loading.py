"""Loading HF-format models and tokenizers, from a local folder or an ``s3://`` prefix synced into a
local cache, and the hard check that student and teacher share one tokenizer (docs/SAPD.md §2: the token
signal d = log π_T − log π_old is only meaningful over the same token ids)."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import sys
from pathlib import Path
from typing import Any, Callable, Literal

import torch

from sapd import layout, storage

DType = Literal["float32", "bfloat16", "float16"]
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_COMPLETE = ".sapd-sync-complete"


def name_the_accelerator() -> None:
    """transformers imports DeepSpeed to load any model when DeepSpeed is installed, and DeepSpeed, left to
    guess, warns "Setting accelerator to CPU. If you have GPU …" in every process of a machine without one,
    commands that never train included: nothing a user can act on. Tell it (``DS_ACCELERATOR=cpu``, which
    torchrun's workers inherit) when this process sees no accelerator; an explicit ``DS_ACCELERATOR`` wins,
    and on a GPU machine DeepSpeed finds CUDA silently."""
    if "DS_ACCELERATOR" in os.environ:
        return
    xpu = getattr(torch, "xpu", None)
    if not (torch.cuda.is_available() or torch.backends.mps.is_available()
            or (xpu is not None and xpu.is_available())):
        os.environ["DS_ACCELERATOR"] = "cpu"


name_the_accelerator()


class TokenizerMismatch(ValueError):
    """Student and teacher tokenizers differ; the message names the first difference."""


def default_cache_dir() -> Path:
    return Path(os.environ.get("SAPD_CACHE_DIR", Path.home() / ".cache" / "sapd"))


def model_folder(path_or_uri: str) -> str:
    """The model folder ``path_or_uri`` names: itself when it holds a ``config.json``; for a sapd run root
    (what ``sapd run``, ``sapd demo`` and the research studies write, e.g. ``demo-out/models/teacher``) the
    model folder of its newest committed checkpoint, so what one command writes is what the next one takes;
    a run root without a committed checkpoint is an error saying so."""
    if storage.is_s3(path_or_uri) or Path(path_or_uri.removeprefix("file://")).is_dir():
        if storage.exists(storage.join(path_or_uri, "config.json")):
            return path_or_uri
        if storage.exists(layout.config_uri(path_or_uri)) or storage.list_files(storage.join(path_or_uri,
                                                                                            "checkpoints")):
            committed = layout.committed_checkpoints(path_or_uri)
            if not committed:
                raise FileNotFoundError(f"{path_or_uri}: a sapd run root without a committed checkpoint, not a "
                                        "model folder; finish its first round, or name a model folder")
            return layout.checkpoint_model_dir(path_or_uri, committed[-1])
    return path_or_uri


def pin_model_path(path_or_uri: str, field: str, log: Callable[[str], None]) -> str:
    """The model folder ``path_or_uri`` stands for (:func:`model_folder`), fixed once for a stage so a run
    root that commits a newer checkpoint meanwhile does not change it halfway; a run root is logged as
    one line naming the checkpoint it resolved to (``model.teacher: ROOT → checkpoint 12``)."""
    folder = model_folder(path_or_uri)
    if folder != path_or_uri:
        k = folder.rstrip("/").split("/")[-2]
        log(f"{field}: {path_or_uri} → checkpoint {int(k) if k.isdigit() else k} ({folder})")
    return folder


def resolve_model_dir(path_or_uri: str, cache_dir: str | Path | None = None, cache_key: str = "",
                      marker: dict | None = None) -> Path:
    """A local folder as is; an ``s3://`` prefix downloaded into the cache **once per cache**, whichever
    of the processes sharing that cache asks first (:func:`fetch_once`): the ranks of a training pod
    share its scratch (or the node's model cache), so checkpoint k and the teacher cross the network once
    per pod (or node), not once per rank. ``cache_key`` distinguishes versions of one URI (a checkpoint's
    commit id). A run root stands for its newest committed checkpoint's model (:func:`model_folder`). A
    checkpoint's model folder is checked file by file against the digests its commit recorded
    (:func:`verify_checkpoint_model`; ``marker``: its commit marker, when the caller has read it) before it
    is handed out."""
    path_or_uri = model_folder(path_or_uri)
    if not storage.is_s3(path_or_uri):
        p = Path(path_or_uri.removeprefix("file://"))
        if not p.is_dir():
            raise FileNotFoundError(f"{path_or_uri}: model folder does not exist")
    else:
        key = hashlib.sha256(f"{path_or_uri}|{cache_key}".encode()).hexdigest()[:16]
        p = fetch_once(path_or_uri, Path(cache_dir or default_cache_dir()) / "models" / key)
    if (checkpoint := layout.checkpoint_of_model_dir(path_or_uri)) is not None:
        verify_checkpoint_model(path_or_uri, p, *checkpoint, marker=marker)
    return p


# ----------------------------------------------------------------------------------------- checked loads

_unverified_told: set[tuple[str, int]] = set()
_verified: dict[str, tuple[int, int, int, str]] = {}  # path → (inode, mtime_ns, size, sha256) already hashed here


def note_unverified(root: str, k: int) -> None:
    """One line per checkpoint and process: it was committed without digests (by an earlier sapd)."""
    if (root, k) not in _unverified_told:
        _unverified_told.add((root, k))
        print(f"checkpoint {k} of {root} was committed without file digests (by an earlier sapd): its files are "
              "loaded unverified", file=sys.stderr, flush=True)


def checkpoint_files(root: str, k: int, marker: dict) -> dict[str, dict] | None:
    """The size and SHA-256 of every file of checkpoint ``k`` as its commit ``marker`` recorded them, by path
    in the checkpoint folder (``model/config.json``, ``state/trainer.pt`` …); None for a checkpoint committed
    before digests existed (said once: :func:`note_unverified`)."""
    files = marker.get("files")
    if files is None:
        note_unverified(root, k)
    return files


def _local_digest(path: Path) -> dict:
    st = path.stat()
    known = _verified.get(str(path))
    if known is not None and known[:3] == (st.st_ino, st.st_mtime_ns, st.st_size):
        return {"bytes": st.st_size, "sha256": known[3]}
    found = storage.file_digest(path)
    _verified[str(path)] = (st.st_ino, st.st_mtime_ns, st.st_size, found["sha256"])
    return found


def verify_checkpoint_model(uri: str, local: Path, root: str, k: int, marker: dict | None = None) -> None:
    """Checkpoint ``k``'s model folder ``uri`` (its local copy ``local``, or itself) holds exactly the files
    its commit recorded, each of the recorded size and SHA-256; else :class:`sapd.storage.CorruptObject`
    naming the file. A copy fetched from S3 that differs is fetched once more before it is refused (the copy
    may be what was damaged). Hashing is skipped for a file this process hashed already, unchanged since."""
    marker_uri = layout.checkpoint_marker(root, k)
    if marker is None:
        if not storage.exists(marker_uri):
            raise FileNotFoundError(f"{uri}: checkpoint {k} of {root} is not committed (no {marker_uri}); a "
                                    "checkpoint is used only once committed")
        marker = storage.read_json(marker_uri)
    files = checkpoint_files(root, k, marker)
    if files is None:
        return
    expected = {name.removeprefix("model/"): d for name, d in files.items() if name.startswith("model/")}
    present = {f.relative_to(local).as_posix() for f in local.rglob("*")
               if f.is_file() and not any(part.startswith(".") for part in f.relative_to(local).parts)}
    copied = storage.is_s3(uri)
    where = f" (its copy {local})" if copied else ""
    for name in sorted(present - set(expected)):
        raise storage.CorruptObject(f"{storage.join(uri, name)}{where}: not one of the files {marker_uri} records; "
                                    "refusing to load the checkpoint with it there")
    for name in sorted(set(expected) - present):
        raise storage.CorruptObject(f"{storage.join(uri, name)}{where}: recorded in {marker_uri} but missing")
    for name in sorted(expected):
        target = local / name
        found = _local_digest(target)
        if copied and (found["bytes"], found["sha256"]) != (expected[name]["bytes"], expected[name]["sha256"]):
            storage.download_to(storage.join(uri, name), target)  # atomically replaced: readers keep the old one
            found = _local_digest(target)
        storage.check_digest(f"{storage.join(uri, name)}{where}", found, expected[name], marker_uri)


class FetchStalled(RuntimeError):
    """Another process holds a download this one waits for, and it has made no progress for too long.
    Transient as far as the stage is concerned: its front door exits 75 (retried), with this one line."""

    exit_code = 75


def _seconds_from_env(name: str, default: str) -> float:
    """A positive number of seconds from the environment variable ``name`` (unset or empty: ``default``); a
    bad value is one line."""
    raw = os.environ.get(name) or default
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r}: not a number of seconds") from None
    if value <= 0:
        raise ValueError(f"{name}={raw!r}: must be > 0")
    return value


def fetch_stall_seconds() -> float:
    """How long a process waits on another's download that makes no progress (``SAPD_FETCH_STALL_S``,
    default 600 s, or a minute more than storage operations retry through an outage, if that is longer:
    a downloader riding one out makes no progress meanwhile) before it gives up with :class:`FetchStalled`."""
    return _seconds_from_env("SAPD_FETCH_STALL_S", str(max(600.0, storage.retry_deadline_s() + 60)))


def _bytes_under(folder: Path) -> int:
    """Bytes in ``folder`` (in-flight temp files included: they grow as a download goes)."""
    total = 0
    for dirpath, _, names in os.walk(folder):
        for name in names:
            try:
                total += os.stat(os.path.join(dirpath, name)).st_size
            except OSError:  # renamed or removed under us
                pass
    return total


def fetch_lock_stale_seconds() -> float:
    """How long a lock file without a heartbeat (the lock of a file system without ``flock``, see
    :class:`DownloadLock`) stands before a waiter takes it over (``SAPD_FETCH_LOCK_STALE_S``, default
    120 s: NFS clients may cache a file's times for up to a minute)."""
    return _seconds_from_env("SAPD_FETCH_LOCK_STALE_S", "120")


class ModelCacheLockError(OSError):
    """The model cache cannot be locked at all (neither ``flock`` nor a lock file can be made there): one
    line naming the folder and what to do; exit code 2 (the cache's file system, not a transient fault)."""

    exit_code = 2


# what flock(2) answers on a file system that does not do it: NFSv3 mounted with `nolock` (ENOLCK), some
# FUSE and CSI drivers (EOPNOTSUPP / ENOTSUP, ENOSYS)
_NO_FLOCK = frozenset({errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOSYS})


class DownloadLock:
    """The exclusive right to download into ``dest``, shared by every process that can see ``dest``.

    ``flock`` on ``dest.lock`` where the file system does it: the kernel drops it when its holder dies.
    Where ``flock`` fails with :data:`_NO_FLOCK` (logged once), a lock file instead: ``dest.lock.owner``
    created with ``O_EXCL`` (atomic on local file systems and on NFSv3+), holding its owner's name and a
    nonce, its modification time renewed every ``stale_s / 4`` by a heartbeat thread while the owner
    holds it. A waiter takes a lock file over when it has seen neither its time nor its content change
    for ``stale_s`` seconds of its own clock (no comparison across machines' clocks): it renames the file
    aside, and deletes it only if it is still the one it judged dead (else it puts it back)."""

    def __init__(self, dest: Path, *, stale_s: float | None = None, log: Callable[[str], None] | None = None):
        import socket
        import uuid
        self.dest = dest
        # the two lines a user must see (no flock here; a dead holder's lock taken over) go to stderr when
        # the caller logs nowhere
        self.log = log if log is not None else (lambda line: print(line, file=sys.stderr, flush=True))
        self.stale_s = fetch_lock_stale_seconds() if stale_s is None else stale_s
        self.path = dest.with_name(dest.name + ".lock")
        self.owner_path = dest.with_name(dest.name + ".lock.owner")
        self.name = f"pid {os.getpid()} on {socket.gethostname()}"
        self.token = f"{self.name} [{uuid.uuid4().hex[:12]}]"
        self.flock = True
        try:
            self.file = open(self.path, "a+")
        except OSError as e:
            raise ModelCacheLockError(f"{dest}: cannot lock the model cache: {self.path}: {e.strerror or e}; "
                                      "give the pods a writable cache (modelCache, SAPD_CACHE_DIR)") from e
        self._seen: tuple[int, str] | None = None  # the lock file's (mtime, content) last seen, and since when
        self._seen_since = 0.0
        self._beat: Any = None

    def acquire(self) -> bool:
        """Take the lock if it is free (never blocks)."""
        import fcntl
        if self.flock:
            try:
                fcntl.flock(self.file, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return False
            except OSError as e:
                if e.errno not in _NO_FLOCK:
                    raise
                self.flock = False
                self.log(f"{self.dest}: this file system refuses flock ({errno.errorcode.get(e.errno, e.errno)}); "
                         f"locking the download with {self.owner_path.name} and a heartbeat instead")
            else:
                self.file.seek(0)
                self.file.truncate()
                self.file.write(self.name)
                self.file.flush()
                return True
        return self._acquire_file()

    def holder(self) -> str:
        """Who holds the lock, as it wrote itself down ("another process" if unknown)."""
        try:
            if self.flock:
                self.file.seek(0)
                text = self.file.read()
            else:
                text = self.owner_path.read_text()
        except OSError:
            text = ""
        return text.split(" [")[0].strip() or "another process"

    def release(self) -> None:
        import fcntl
        if self.flock:
            fcntl.flock(self.file, fcntl.LOCK_UN)
            return
        if self._beat is not None:
            self._beat[1].set()
            self._beat[0].join()
            self._beat = None
        try:
            if self.owner_path.read_text() == self.token:  # still ours (not taken over after a stalled beat)
                self.owner_path.unlink()
        except OSError:
            pass

    def close(self) -> None:
        self.file.close()

    def _acquire_file(self) -> bool:
        import threading
        import time
        try:
            fd = os.open(self.owner_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            self._take_over_if_dead(time.monotonic())
            return False
        except OSError as e:
            raise ModelCacheLockError(f"{self.dest}: cannot lock the model cache: flock is refused and the lock "
                                      f"file {self.owner_path} cannot be created ({e.strerror or e}); give the pods "
                                      "a cache on a file system with flock or O_EXCL (modelCache, SAPD_CACHE_DIR)"
                                      ) from e
        with os.fdopen(fd, "w") as f:
            f.write(self.token)
        stop = threading.Event()

        def beat() -> None:  # the owner is alive: its lock file's time moves
            while not stop.wait(self.stale_s / 4):
                try:
                    os.utime(self.owner_path)
                except OSError:
                    pass

        thread = threading.Thread(target=beat, name="sapd-fetch-lock-heartbeat", daemon=True)
        thread.start()
        self._beat = (thread, stop)
        self._seen = None
        return True

    def _take_over_if_dead(self, now: float) -> None:
        try:
            state = (self.owner_path.stat().st_mtime_ns, self.owner_path.read_text())
        except FileNotFoundError:
            return  # released meanwhile: the next acquire may get it
        if state != self._seen:
            self._seen, self._seen_since = state, now
            return
        if now - self._seen_since <= self.stale_s:
            return
        aside = self.owner_path.with_name(f"{self.owner_path.name}.dead-{self.token.rsplit('[', 1)[1][:-1]}")
        try:
            os.rename(self.owner_path, aside)
        except FileNotFoundError:
            return
        if aside.read_text() == state[1]:
            self.log(f"{self.dest}: {state[1].split(' [')[0]} holds the download lock but has shown no heartbeat "
                     f"for {self.stale_s:.0f} s; taking it over")
            aside.unlink()
        else:  # a new owner's lock, taken between our look and the rename: give it back
            try:
                os.link(aside, self.owner_path)
            except FileExistsError:
                pass
            aside.unlink()
        self._seen = None


def fetch_once(uri: str, dest: Path, *, stall_s: float | None = None, poll_s: float = 0.5,
               log: Callable[[str], None] | None = None, lock_stale_s: float | None = None) -> Path:
    """``uri``'s files in ``dest``, downloaded by exactly one of the processes that share ``dest``.

    The protocol: a complete download has ``dest/.sapd-sync-complete``, written last. A process that
    finds it returns at once. Otherwise it takes the download lock (:class:`DownloadLock`: an exclusive
    ``flock`` on ``dest.lock``, or where the file system refuses ``flock``, a lock file with a heartbeat)
    and downloads (files already there — atomically renamed, so whole — are kept; leftover temp files of
    a killed downloader are removed); the others wait for the marker. A lock dies with its holder (the
    kernel drops a flock at once; a lock file's heartbeat stops, and a waiter takes it over after
    ``lock_stale_s``, :func:`fetch_lock_stale_seconds`), so a rank killed mid-download hands the work to
    a waiting rank, which goes on from the files already there — nobody waits on a dead downloader
    for good. A holder that is alive but makes no progress (the bytes under ``dest`` do not grow) for
    ``stall_s`` seconds (:func:`fetch_stall_seconds`) makes the waiters fail with :class:`FetchStalled`,
    naming it."""
    import time

    if (dest / _COMPLETE).is_file():
        return dest
    stall = fetch_stall_seconds() if stall_s is None else stall_s
    dest.parent.mkdir(parents=True, exist_ok=True)
    lock = DownloadLock(dest, stale_s=lock_stale_s, log=log)
    try:
        seen, since, told = -1, time.monotonic(), False
        while True:
            if (dest / _COMPLETE).is_file():
                return dest
            if not lock.acquire():
                size = _bytes_under(dest)
                now = time.monotonic()
                holder = lock.holder()
                if size != seen:
                    seen, since = size, now
                elif now - since > stall:
                    raise FetchStalled(f"{uri}: the download into {dest} by {holder} made no progress for "
                                       f"{stall:.0f} s; giving up (SAPD_FETCH_STALL_S sets how long to wait)")
                if log is not None and not told:
                    log(f"{uri}: waiting for {holder} to download it into {dest}")
                    told = True
                time.sleep(poll_s)
                continue
            try:
                if (dest / _COMPLETE).is_file():
                    return dest
                _download_folder(uri, dest)
                return dest
            finally:
                lock.release()
    finally:
        lock.close()


def _download_folder(uri: str, dest: Path) -> None:
    """Every file below ``uri`` into ``dest`` (those already there kept), then the completion marker."""
    for leftover in dest.rglob(f"*{storage.TMP_SUFFIX}") if dest.is_dir() else []:
        leftover.unlink(missing_ok=True)  # a killed downloader's partial file
    files = storage.list_files(uri)
    if not files:
        raise FileNotFoundError(f"{uri}: no files under this model prefix")
    base = uri.rstrip("/") + "/"
    for file_uri in files:
        target = dest / file_uri[len(base):]
        if not target.is_file():
            storage.download_to(file_uri, target)
    (dest / _COMPLETE).write_text(uri + "\n")


def quiet_progress_off_terminal() -> None:
    """transformers' own bars (loading weights, writing shards) print a line per update where stderr is
    no terminal (``kubectl logs``, CI, a log file), burying the job's log lines: keep them to terminals,
    as our own tqdm bars do (``disable=None``)."""
    import sys

    from transformers.utils import logging as hf_logging
    if not sys.stderr.isatty():
        hf_logging.disable_progress_bar()


def load_tokenizer(path_or_uri: str, cache_dir: str | Path | None = None, *, without_weights: bool = False):
    """The tokenizer of a model folder (local or ``s3://``); ``without_weights``: from an S3 prefix, fetch
    only the files that are not weights."""
    from transformers import AutoTokenizer
    quiet_progress_off_terminal()
    p = (model_files_but_weights(path_or_uri, cache_dir) if without_weights
         else resolve_model_dir(path_or_uri, cache_dir))
    if not (p / "tokenizer_config.json").is_file() and not (p / "tokenizer.json").is_file():
        raise FileNotFoundError(f"{path_or_uri}: not a Hugging Face tokenizer folder (no tokenizer.json or "
                                "tokenizer_config.json)")
    tok = AutoTokenizer.from_pretrained(str(p))
    if not getattr(tok, "chat_template", None):
        raise ValueError(f"{path_or_uri}: the tokenizer has no chat template; prompts are rendered through it")
    if tok.pad_token_id is None:  # batched generation and scoring pad; EOS is the usual stand-in
        tok.pad_token = tok.eos_token
    return tok


WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".h5", ".msgpack", ".ckpt")


def model_files_but_weights(path_or_uri: str, cache_dir: str | Path | None = None) -> Path:
    """A local folder with a model folder's files except its weights (config, generation config,
    tokenizer, chat template): the folder itself when local, else those files of an ``s3://`` prefix
    downloaded into the cache — what ``sapd check`` reads without fetching gigabytes of weights."""
    path_or_uri = model_folder(path_or_uri)
    if not storage.is_s3(path_or_uri):
        return resolve_model_dir(path_or_uri, cache_dir)
    files = [u for u in storage.list_files(path_or_uri) if not u.endswith(WEIGHT_SUFFIXES)]
    if not files:
        raise FileNotFoundError(f"{path_or_uri}: no files under this model prefix")
    base = path_or_uri.rstrip("/") + "/"
    key = hashlib.sha256(f"{path_or_uri}|no-weights".encode()).hexdigest()[:16]
    root = Path(cache_dir or default_cache_dir()) / "model-configs" / key
    for uri in files:
        if "/" not in uri[len(base):]:  # the top level is all a model folder has
            storage.download_to(uri, root / uri[len(base):])
    return root


def read_model_config(path_or_uri: str, cache_dir: str | Path | None = None) -> dict:
    """A model folder's ``config.json`` (no weights are read); a missing one is an error naming the folder."""
    import json
    p = model_files_but_weights(path_or_uri, cache_dir) / "config.json"
    if not p.is_file():
        raise FileNotFoundError(f"{path_or_uri}: no config.json (not a Hugging Face model folder)")
    return json.loads(p.read_text(encoding="utf-8"))


# flags that only matter when sampling / in beam search: a model folder's generation_config.json that sets
# them without do_sample / num_beams > 1 makes transformers print "generation flags are not valid and
# may be ignored" at every load (and refuse to save it again); sapd never calls ``generate`` with them
SAMPLING_ONLY = ("temperature", "top_p", "top_k", "min_p", "typical_p", "epsilon_cutoff", "eta_cutoff")
BEAM_ONLY = ("early_stopping", "length_penalty")


def generation_config_of(folder: str | Path):
    """The folder's ``generation_config.json`` as a consistent ``GenerationConfig`` (None when there is
    none): sampling-only flags dropped when ``do_sample`` is not set, beam-only ones when ``num_beams`` ≤ 1
    — what transformers' own notice says to do — so loading is quiet and the checkpoints sapd writes
    from it save and load cleanly."""
    from transformers import GenerationConfig
    f = Path(folder) / "generation_config.json"
    if not f.is_file():
        return None
    try:
        raw = json.loads(f.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{f}: not a readable JSON generation config ({e}); fix or delete it") from e
    if not raw.get("do_sample"):
        for k in SAMPLING_ONLY:
            raw.pop(k, None)
    if (raw.get("num_beams") or 1) <= 1:
        for k in BEAM_ONLY:
            raw.pop(k, None)
    return GenerationConfig.from_dict(raw)


def load_causal_lm(path_or_uri: str, dtype: DType = "float32", device: str = "cpu",
                   cache_dir: str | Path | None = None, trainable: bool = False):
    from transformers import AutoModelForCausalLM
    quiet_progress_off_terminal()
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, not {dtype!r}")
    p = resolve_model_dir(path_or_uri, cache_dir)
    gen = generation_config_of(p)
    model = AutoModelForCausalLM.from_pretrained(str(p), dtype=_DTYPES[dtype],
                                                 **({"generation_config": gen} if gen is not None else {}))
    model = model.to(device)  # type: ignore[arg-type]  # transformers' stub types .to's self badly
    model.train(trainable)
    if not trainable:
        model.requires_grad_(False)
    return model


def check_same_tokenizer(student, teacher, names: tuple[str, str] = ("student", "teacher")) -> None:
    """Refuse to go on unless both tokenizers map every string to the same ids: same vocabulary, same
    special tokens. Raises :class:`TokenizerMismatch` naming the first difference."""
    a, b = names
    va, vb = student.get_vocab(), teacher.get_vocab()
    if len(va) != len(vb):
        raise TokenizerMismatch(f"{a} vocabulary has {len(va)} tokens, {b} has {len(vb)}")
    by_id_a = {i: t for t, i in va.items()}
    by_id_b = {i: t for t, i in vb.items()}
    for i in sorted(by_id_a):
        if by_id_a[i] != by_id_b.get(i):
            raise TokenizerMismatch(f"token id {i} is {by_id_a[i]!r} for the {a} but {by_id_b.get(i)!r} "
                                    f"for the {b}")
    for attr in ("eos_token", "pad_token", "bos_token", "unk_token"):
        sa, sb = getattr(student, attr, None), getattr(teacher, attr, None)
        if sa != sb:
            raise TokenizerMismatch(f"{attr}: {a} has {sa!r}, {b} has {sb!r}")
    sa, sb = sorted(student.all_special_tokens), sorted(teacher.all_special_tokens)
    if sa != sb:
        extra = sorted(set(sa) ^ set(sb))
        raise TokenizerMismatch(f"special tokens differ: {extra[0]!r} is special for only one of {a}/{b}")


def cache_kwarg(model) -> str:
    """Name of the forward() argument that takes a KV cache: ``cache`` in transformers ≥ 5.2x,
    ``past_key_values`` before (the vLLM environment pins an older transformers)."""
    import inspect
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def output_cache(output):
    """The KV cache an HF forward returned, under either name."""
    return getattr(output, "cache", None) or getattr(output, "past_key_values", None)
