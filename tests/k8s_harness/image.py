"""What a container of the sapd image starts with, read from the repository's Dockerfile: the target
stage (``…-cpu`` / ``…-gpu`` / ``…-eval`` tag suffix) and, following its ``FROM`` chain, ENTRYPOINT,
CMD, WORKDIR, ENV and USER; and the Python environment that stands for the target's installed
packages: ``.cache/images/<target>/``, made by the Dockerfile's own install script
(``docker/install.sh <target> --venv …``; ``make image-venvs``). The code the image copies (``sapd``,
``sapd.jobs``) comes from the working tree (PYTHONPATH)."""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
IMAGES = REPO / ".cache" / "images"
MARK = ".sapd-image-env"  # written by docker/install.sh --venv once the environment is complete


class ImageNotBuilt(ValueError):
    """The environment of an image target is missing: the pod cannot start (as with an image that was
    never pushed)."""


def image_env(target: str) -> Path:
    """The environment that runs ``target``'s pods; ``ImageNotBuilt`` if it was not made (completely)."""
    env = IMAGES / target
    if not (env / MARK).is_file():
        raise ImageNotBuilt(f"ErrImagePull: the harness runs image target {target!r} in {env}, which is not "
                            f"built: make image-venvs (docker/install.sh {target} --venv {env})")
    return env


@dataclass
class ImageConfig:
    target: str
    entrypoint: list[str] = field(default_factory=list)
    cmd: list[str] = field(default_factory=list)
    workdir: str = "/"
    env: dict[str, str] = field(default_factory=dict)
    user: str | None = None


def _exec_form(text: str) -> list[str]:
    text = text.strip()
    if text.startswith("["):
        return list(json.loads(text))
    return ["/bin/sh", "-c", text]


def _env_pairs(text: str) -> dict[str, str]:
    out: dict[str, str] = {}
    tokens = shlex.split(text)
    if len(tokens) >= 2 and "=" not in tokens[0]:  # legacy "ENV KEY value"
        return {tokens[0]: " ".join(tokens[1:])}
    for tok in tokens:
        k, _, v = tok.partition("=")
        out[k] = v
    return out


def parse_dockerfile(path: Path) -> dict[str, tuple[str, list[tuple[str, str]]]]:
    """Stage name → (parent image or stage, [(instruction, argument)]), line continuations joined."""
    lines, cur = [], ""
    for raw in path.read_text().splitlines():
        s = raw.rstrip()
        if not cur and (not s.strip() or s.lstrip().startswith("#")):
            continue
        if s.endswith("\\"):
            cur += s[:-1] + " "
            continue
        lines.append(cur + s)
        cur = ""
    stages: dict[str, tuple[str, list[tuple[str, str]]]] = {}
    name = None
    for line in lines:
        m = re.match(r"\s*(\w+)\s+(.*)", line)
        if not m:
            continue
        ins, arg = m.group(1).upper(), m.group(2)
        if ins == "FROM":
            fm = re.match(r"(?:--\S+\s+)*(\S+)(?:\s+AS\s+(\S+))?", arg, re.IGNORECASE)
            parent, name = fm.group(1), fm.group(2) or fm.group(1)
            stages[name] = (parent, [])
        elif name is not None:
            stages[name][1].append((ins, arg))
    return stages


def image_config(dockerfile: Path, image: str) -> ImageConfig:
    """The runtime config of ``image`` (``repo:tag`` or ``repo@digest``) built from ``dockerfile``."""
    stages = parse_dockerfile(dockerfile)
    tag = image.rsplit("@", 1)[0].rsplit(":", 1)[-1] if ":" in image.split("/")[-1] else "latest"
    target = next((t for t in ("gpu", "cpu", "eval") if tag.endswith(t) and t in stages), None)
    if target is None:
        raise ValueError(f"image {image!r}: the tag names no target of {dockerfile.name} (…-cpu, …-gpu)")
    chain = []
    s = target
    while s in stages:
        chain.append(s)
        s = stages[s][0]
    cfg = ImageConfig(target=target)
    for stage in reversed(chain):
        for ins, arg in stages[stage][1]:
            if ins == "ENTRYPOINT":
                cfg.entrypoint, cfg.cmd = _exec_form(arg), []
            elif ins == "CMD":
                cfg.cmd = _exec_form(arg)
            elif ins == "WORKDIR":
                cfg.workdir = arg.strip() if arg.strip().startswith("/") else f"{cfg.workdir.rstrip('/')}/{arg.strip()}"
            elif ins == "ENV":
                cfg.env.update(_env_pairs(arg))
            elif ins == "USER":
                cfg.user = arg.strip()
    return cfg
