"""What the cluster journeys (tests/cluster/test_journeys*.py) share: the user's S3 session in the test process, the
tiny student and teacher they upload, and a started harness cluster (tests/k8s_harness) holding the docs'
S3 credentials Secret and, where asked, a node cache its admin prepared."""

from __future__ import annotations

import contextlib
import dataclasses
import shutil
from pathlib import Path
from typing import Any, Iterator

from tests.k8s_harness import Cluster
from tests.pipeline_util import make_models

NS = "sapd"  # the releases' namespace in every journey
NODE_CACHE = "/var/cache/sapd"  # the chart's modelCache hostPath


@contextlib.contextmanager
def user_s3(s3_server) -> Iterator[None]:
    """sapd's storage in this process talks to ``s3_server`` as the user would; restored on exit."""
    from sapd import storage
    previous = storage.configure_s3(endpoint_url=s3_server.endpoint_url, access_key_id=s3_server.access_key,
                                    secret_access_key=s3_server.secret_key, region="us-east-1")
    try:
        yield
    finally:
        storage.configure_s3(**dataclasses.asdict(previous))


def checkpoint_weights(root: str, k: int) -> dict[str, Any]:
    """Checkpoint ``k``'s model weights, read from the run root (local or S3: under :func:`user_s3`), by name."""
    from safetensors.torch import load

    from sapd import layout, storage
    out: dict[str, Any] = {}
    for u in storage.list_files(layout.checkpoint_model_dir(root, k)):
        if u.endswith(".safetensors"):
            out.update(load(storage.read_bytes(u)))
    assert out, f"no weights in checkpoint {k} of {root}"
    return out


def upload_models(tmp: Path, prefix: str) -> None:
    """The tiny student and teacher (built in ``tmp``) uploaded to ``prefix/models/{student,teacher}/``."""
    from sapd import storage
    student, teacher = make_models(tmp)
    for name, folder in (("student", student), ("teacher", teacher)):
        for f in sorted(Path(folder).rglob("*")):
            if f.is_file():
                storage.write_bytes(f"{prefix}/models/{name}/{f.relative_to(folder)}", f.read_bytes())


@contextlib.contextmanager
def journey_cluster(tmp: Path, s3_server, *, textworld_cache: Path | None = None,
                    **options: Any) -> Iterator[Cluster]:
    """A started cluster in namespace :data:`NS` with the ``sapd-s3-credentials`` Secret (what docs/kubernetes/install.md has
    the user create first); with ``textworld_cache``, a node whose shared cache already holds those games,
    prepared for the pods' user (a folder the kubelet would create is root's). Stopped on exit, and no
    harness error may have been recorded."""
    c = Cluster(tmp, namespace=NS, backoff_base_seconds=0.2, max_grace_seconds=3, **options).start()
    try:
        c.create_secret("sapd-s3-credentials", {"AWS_ACCESS_KEY_ID": s3_server.access_key,
                                                "AWS_SECRET_ACCESS_KEY": s3_server.secret_key})
        if textworld_cache is not None:
            shutil.copytree(textworld_cache, c.host_path(NODE_CACHE) / "textworld")
            c.host_path(NODE_CACHE, owner=(1000, 1000))
        yield c
    finally:
        c.stop()
    assert c.errors == [], c.errors[-1]
