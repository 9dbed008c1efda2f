"""What a container runtime does to a container's file system, for one process of the harness's kubelet:
``python -I sandbox.py SPEC -- COMMAND…`` makes a mount namespace of its own, mounts what SPEC says
read-only, drops to the container's user and execs COMMAND (so the process the kubelet watches is the
command's: same pid, same process group).

SPEC (JSON): ``mounts`` — [[folder, read_only], …], the container's volumes (each folder becomes a mount
of its own, read-only where the volumeMount says ``readOnly``, where the claim is mounted ``readOnly``
and always for configMap, secret, downwardAPI and projected volumes, as a kubelet mounts them);
``read_only_root`` — every other mount of the node (the harness's root filesystem: the image's files,
this checkout, the environments, the rest of the node's folders) read-only, as
``readOnlyRootFilesystem: true`` makes the image's root (``/proc``, ``/sys`` and ``/dev`` stay: a
runtime mounts them anew, ``/dev/shm`` writable); ``uid``, ``gid``, ``groups`` — whom to run as (null:
stay); ``cwd`` — where to start.

Run as root (the harness's kubelet, as a real one) it unshares a mount namespace and changes identity
after mounting; run by anyone else it unshares a user namespace too (the kernel's unprivileged user
namespaces), mapping only its own ids, so that it may mount, and stays that user. A write where the
pod may not write then fails as on a node: EROFS.

``python -I sandbox.py --probe`` checks that this works here (exit 0), for the kubelet to refuse to
start pods it cannot confine rather than let them write anywhere.
"""

from __future__ import annotations

import ctypes
import json
import os
import sys

CLONE_NEWNS = 0x00020000
CLONE_NEWUSER = 0x10000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
MS_NOATIME, MS_NODIRATIME, MS_RELATIME = 1024, 2048, 1 << 21
ST_RELATIME = 4096  # statvfs's own bit for relatime
# what a runtime mounts anew in every container: left as they are
SYSTEM = ("/proc", "/sys", "/dev")

_libc = ctypes.CDLL(None, use_errno=True)


def _check(rc: int, what: str) -> None:
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _mount(source: str | None, target: str, flags: int) -> None:
    _check(_libc.mount(source.encode() if source else None, target.encode(), None, ctypes.c_ulong(flags), None),
           f"mount {target}")


def _kept_flags(path: str) -> int:
    """The per-mount flags a bind remount must keep (a user namespace may not clear them)."""
    f = os.statvfs(path).f_flag
    out = f & (MS_NOSUID | MS_NODEV | MS_NOEXEC | MS_NOATIME | MS_NODIRATIME)
    return out | (MS_RELATIME if f & ST_RELATIME else 0)


def _remount(path: str, read_only: bool) -> None:
    _mount(None, path, MS_REMOUNT | MS_BIND | _kept_flags(path) | (MS_RDONLY if read_only else 0))


def _mount_points() -> list[str]:
    """This namespace's mount points (/proc/self/mountinfo, octal escapes decoded), in mount order."""
    out = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            point = line.split()[4]
            out.append(point.encode().decode("unicode_escape").encode("latin-1").decode())
    return out


def _under(path: str, parents: tuple[str, ...]) -> bool:
    return any(path == p or path.startswith(p.rstrip("/") + "/") for p in parents)


def confine(spec: dict) -> None:
    """Make this process's mount namespace what ``spec`` says (see the module docstring)."""
    root = os.geteuid() == 0
    if root:
        _check(_libc.unshare(CLONE_NEWNS), "unshare(CLONE_NEWNS)")
    else:
        uid, gid = os.geteuid(), os.getegid()
        _check(_libc.unshare(CLONE_NEWUSER | CLONE_NEWNS), "unshare(CLONE_NEWUSER|CLONE_NEWNS)")
        with open("/proc/self/setgroups", "w") as f:
            f.write("deny")
        with open("/proc/self/uid_map", "w") as f:
            f.write(f"{uid} {uid} 1")
        with open("/proc/self/gid_map", "w") as f:
            f.write(f"{gid} {gid} 1")
    _mount(None, "/", MS_REC | MS_PRIVATE)  # nothing done here reaches the node's own namespace
    volumes = sorted(((os.path.realpath(p), bool(ro)) for p, ro in spec.get("mounts", [])), key=lambda v: len(v[0]))
    for path, _ in volumes:  # each volume a mount of its own, so the root's flags do not reach it
        _mount(path, path, MS_BIND | MS_REC)
    ours = tuple(p for p, _ in volumes)
    if spec.get("read_only_root"):
        for point in _mount_points():
            if _under(point, SYSTEM) or _under(point, ours):
                continue
            try:
                _remount(point, True)
            except FileNotFoundError:  # a mount point hidden under another mount
                pass
    for path, ro in volumes:
        _remount(path, ro)


def main(argv: list[str]) -> int:
    if argv[:1] == ["--probe"]:
        confine({"mounts": [], "read_only_root": True})
        try:
            open("/.sapd-harness-probe", "w").close()
        except OSError as e:
            return 0 if e.errno == 30 else 1  # EROFS: the root is read-only in here
        os.unlink("/.sapd-harness-probe")
        return 1
    spec, command = json.loads(argv[0]), argv[argv.index("--") + 1:]
    failed = become(spec, command)
    if failed is not None:
        return failed
    try:
        os.execvp(command[0], command)
    except OSError as e:
        print(f"harness: cannot start {command[:1]}: {e}", file=sys.stderr, flush=True)
        return 128
    return 0  # not reached


def become(spec: dict, command: list[str]) -> int | None:
    """This process made the container's (its mounts, its user, its umask and working directory), ready to run
    ``command``; else the exit code, the reason printed to stderr (also what zygote.py's children do)."""
    try:
        confine(spec)
    except OSError as e:
        print(f"harness: cannot set up the container's mounts: {e}", file=sys.stderr, flush=True)
        return 128
    if spec.get("uid") is not None and os.geteuid() == 0:
        os.setgroups(sorted(set(spec.get("groups") or [])))
        os.setgid(int(spec["gid"]))
        os.setuid(int(spec["uid"]))
    os.umask(0o022)
    try:
        os.chdir(spec.get("cwd") or "/")  # again: the old cwd is the folder under the new mounts
    except OSError as e:
        print(f"harness: cannot start {command[:1]}: {e}", file=sys.stderr, flush=True)
        return 128
    return None


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
