"""A process of the one-download-per-pod checks (tests/stages/test_pod_fetch.py).

``python tests/fetch_worker.py resolve URI CACHE OUT [--die-after-files N]``: resolve ``URI`` into the
shared cache ``CACHE`` (what every rank of a pod does with checkpoint k), write this process's S3
traffic and the folder to ``OUT``; with ``--die-after-files N`` SIGKILL itself once it has downloaded N
files (a rank killed mid-download).

``python tests/fetch_worker.py cli OUT ARGS...``: run ``sapd.cli`` with ARGS (one torchrun rank of a
train round), then write this rank's S3 traffic to ``OUT.rank{RANK}.json``; with ``SAPD_TEST_CACHE_PER_RANK``
set, each rank gets a cache of its own (how every rank downloaded before: no shared cache).

With ``SAPD_TEST_FLOCK_ERRNO`` set (e.g. ``ENOLCK``), every ``flock`` call of the process fails with that
error, as on a file system without ``flock`` (NFSv3 mounted ``nolock``, some FUSE/CSI drivers)."""

from __future__ import annotations

import json
import os
import signal
import sys


def refuse_flock(name: str) -> None:
    """Every flock of this process fails with errno ``name``, as the file system's would."""
    import errno
    import fcntl
    code = getattr(errno, name)

    def flock(fd, operation):
        raise OSError(code, os.strerror(code))

    fcntl.flock = flock  # type: ignore[assignment]


def main(argv: list[str]) -> int:
    from sapd import storage
    if os.environ.get("SAPD_TEST_FLOCK_ERRNO"):
        refuse_flock(os.environ["SAPD_TEST_FLOCK_ERRNO"])
    if argv[0] == "resolve":
        uri, cache, out = argv[1:4]
        if "--die-after-files" in argv:
            limit = int(argv[argv.index("--die-after-files") + 1])
            real = storage.download_to
            done = [0]

            def dying(*args, **kwargs):
                real(*args, **kwargs)
                done[0] += 1
                if done[0] >= limit:
                    os.kill(os.getpid(), signal.SIGKILL)

            storage.download_to = dying  # type: ignore[assignment]
        from sapd.models.loading import resolve_model_dir
        if "--hold-seconds" in argv:  # download slowly: each file takes this long (a big model on a slow link)
            pause = float(argv[argv.index("--hold-seconds") + 1])
            slow = storage.download_to

            def slowly(*args, **kwargs):
                import time
                time.sleep(pause)
                slow(*args, **kwargs)

            storage.download_to = slowly  # type: ignore[assignment]
        folder = resolve_model_dir(uri, cache)
        with open(out, "w") as f:
            json.dump({"folder": str(folder), **storage.transfer_stats()}, f)
        return 0
    out, args = argv[1], argv[2:]
    rank = os.environ.get("RANK", "0")
    if os.environ.get("SAPD_TEST_CACHE_PER_RANK"):
        os.environ["SAPD_CACHE_DIR"] = os.path.join(os.environ["SAPD_CACHE_DIR"], f"rank{rank}")
    from sapd.cli import main as cli_main
    rc = cli_main(args)
    with open(f"{out}.rank{rank}.json", "w") as f:
        json.dump(storage.transfer_stats(), f)
    return rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
