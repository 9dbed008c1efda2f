"""The round overhead of the cluster path, measured on the harness (issue 34): the smoke overlay's run for N
rounds as `sapd run` (one process), as per-round stage Jobs (pipeline.stageJobs perRound) and as persistent
stage Jobs (the default), with train.overlap one_step on persistent Jobs, and as the persistent pods' three
commands run as plain processes on this machine (`processes`: the persistent design without the cluster,
which splits the persistent Jobs' cost into the design's and the cluster's); every mode's runs alternate in
one invocation, so the machine's load hits them alike. The logs of `sapd run` and of the processes have
each line stamped with its seconds since the command (`--keep` keeps them, and every pod's log). The front
door is ``bench/round_overhead.py`` (the layering keeps bench/ from importing tests/; this module is run as
``python -m tests.round_overhead``).

What is measured, for each run, by a thread polling the run root every 0.1 s:
- **rounds**: from checkpoint 0 committed (the prefix build done) to checkpoint N committed — the N rounds,
  with every start-up that falls inside them (the per-round Jobs' pods; the persistent workers' model loads;
  `sapd run`'s engines and its trainer, rebuilt every round);
- **total**: from the command (`sapd run …`, `helm install …`) to checkpoint N committed: also the driver's
  pod, its checks and the prefix build's Job.
The headline ratios are the rounds' (the overhead per round is what a long run pays N times); both are
printed. Every run must end with the same checkpoint N as `sapd run`'s, bit for bit.

The run: the smoke overlay (the cpu image, HF sampling, torch engine, one scoring worker, one train pod) on
TextWorld expert games recorded by sapd's collector, a tiny student and teacher, in a real S3 server
(SeaweedFS); no evaluation (`sapd run` evaluates nothing); the driver's and the workers' polls at 0.5 s
(`pipeline.pollSeconds`, `pipeline.inputPollSeconds`: rounds of seconds here, of minutes on GPUs).
`sapd run` runs in the cpu image's environment, like the pods.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path

import yaml

from tests.conftest import S3Server, free_port, running_s3_server
from tests.journey_util import NS, journey_cluster, upload_models, user_s3
from tests.k8s_harness import Cluster
from tests.k8s_harness.helm import render, user_values
from tests.k8s_harness.image import image_env
from tests.k8s_harness.kubelet import resource_field
from tests.pipeline_util import wait_together

REPO = Path(__file__).resolve().parents[1]
CHART = REPO / "charts" / "sapd"
SMOKE = CHART / "values" / "smoke.yaml"
MODES = ("sapd-run", "per-round", "persistent", "overlap", "processes")
LABELS = {"sapd-run": "sapd run", "per-round": "per-round Jobs", "persistent": "persistent Jobs",
          "overlap": "persistent Jobs, train.overlap one_step",
          "processes": "persistent workers as processes, no cluster"}


@dataclass
class Result:
    mode: str
    repeat: int
    rounds_s: float  # checkpoint 0 → checkpoint N
    total_s: float  # the command → checkpoint N
    commits: dict[int, float] = field(default_factory=dict)  # checkpoint → seconds after the command
    weights_sha256: str = ""


def _inputs(tmp: Path, bucket: str) -> str:
    """The user's uploads (TextWorld expert games, the tiny student and teacher) → their S3 prefix."""
    from sapd.data.loaders import write_native_jsonl
    from sapd.envs.loop import LoopOptions, collect_expert
    from sapd.envs.panels import PanelSpec, episode_specs
    specs = episode_specs(PanelSpec("textworld", families=("simple", "coin"), games_per_family=1, seed=0,
                                    cache_dir=str(tmp / "games")))
    trajs = collect_expert(specs, "textworld", successful_only=True, opts=LoopOptions(invalid_action="look"))
    prefix = f"s3://{bucket}/round-overhead-{uuid.uuid4().hex[:8]}"
    write_native_jsonl(trajs, f"{prefix}/data/textworld.jsonl")
    upload_models(tmp / "models", prefix)
    return prefix


def _sets(prefix: str, endpoint: str, release: str, rounds: int, mode: str) -> list[str]:
    sets = [f"runRoot={prefix}/runs/{release}", f"config.data.input={prefix}/data/textworld.jsonl",
            f"config.model.student={prefix}/models/student", f"config.model.teacher={prefix}/models/teacher",
            "config.data.val_fraction=0", f"config.train.rounds={rounds}", f"s3.endpoint={endpoint}",
            "pushgateway.url=", "evaluate.enabled=false", "pipeline.inputPollSeconds=0.5",
            "pipeline.logEverySeconds=60", f"train.rendezvousPort={free_port()}", f"train.metricsPort={free_port()}"]
    # the driver's status reads: per-round Jobs wait on them between every two stages (0.5 s: that mode's best
    # case); persistent workers hand the rounds over through the object store, so there the driver only
    # watches (every 2 s: it loads the 2 cores less, and still notices the end quickly)
    sets.append("pipeline.pollSeconds=" + ("0.5" if mode == "per-round" else "2"))
    if mode == "per-round":
        sets.append("pipeline.stageJobs=perRound")
    if mode == "overlap":
        sets.append("config.train.overlap=one_step")
    return sets


class CommitWatch:
    """A thread that notes when each of checkpoints 0 … N of a run root is first seen committed."""

    def __init__(self, root: str, n: int, t0: float) -> None:
        self.root, self.n, self.t0 = root, n, t0
        self.seen: dict[int, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        from sapd import checkpoints
        k = 0  # checkpoints commit in order: one small read every 0.1 s, for the next one only (the watch
        # itself must not load the 2 cores that the run under measurement uses)
        while not self._stop.is_set() and k <= self.n:
            if checkpoints.is_committed(self.root, k):
                self.seen[k] = time.monotonic() - self.t0
                k += 1
                continue
            self._stop.wait(0.1)

    def stop(self) -> dict[int, float]:
        self._stop.set()
        self._thread.join(timeout=30)
        return dict(self.seen)


class Stamped:
    """A process's output into ``path``, each line prefixed with the seconds since ``t0`` at which it was read
    (``[  12.345] …``): the logs of `--keep` say when each phase of each round happened."""

    def __init__(self, path: Path, t0: float) -> None:
        self.path, self.t0 = path, t0
        self._thread: threading.Thread | None = None

    def start(self, proc: subprocess.Popen) -> None:
        def copy() -> None:
            assert proc.stdout is not None
            with self.path.open("w") as f:
                for line in proc.stdout:
                    f.write(f"[{time.monotonic() - self.t0:8.3f}] {line}")
        self._thread = threading.Thread(target=copy, daemon=True)
        self._thread.start()

    def join(self) -> None:
        if self._thread is not None:
            self._thread.join(timeout=30)


def _weights_sha(root: str, k: int) -> str:
    import hashlib

    from sapd import layout, storage
    h = hashlib.sha256()
    for uri in sorted(u for u in storage.list_files(layout.checkpoint_model_dir(root, k)) if u.endswith(".safetensors")):
        h.update(storage.read_bytes(uri))
    return h.hexdigest()


def _render(prefix: str, s3: S3Server, release: str, rounds: int, mode: str) -> list[dict]:
    vals = user_values([SMOKE], _sets(prefix, s3.endpoint_url, release, rounds, mode))
    docs, _, _ = render(CHART, vals, release, NS)
    return docs


def _openmp_env(docs: list[dict], release: str, stage: str) -> dict[str, str]:
    """The OpenMP variables (OMP_*) that the chart's pod template of ``stage`` sets (OMP_NUM_THREADS from the
    container's CPU limit, the train pods' OMP_WAIT_POLICY where their engine needs it), as a process here
    takes them (a resource reference resolved as the harness's kubelet resolves it)."""
    (cm,) = [d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"] == f"{release}-pipeline-templates"]
    job = yaml.safe_load(cm["data"][f"{stage}.yaml"])
    (container,) = job["spec"]["template"]["spec"]["containers"]
    return {e["name"]: (str(e["value"]) if "value" in e else resource_field(container, e["valueFrom"]["resourceFieldRef"]))
            for e in container.get("env", [])
            if e["name"].startswith("OMP_") and ("value" in e or "resourceFieldRef" in e.get("valueFrom", {}))}


def _local(docs: list[dict], s3: S3Server, tmp: Path, release: str) -> tuple[dict, Path, dict]:
    """The config the chart (its rendered ``docs``) gives the pipeline's stages (its own run root), written to a
    file, and a pod's environment (not this process's: no OMP_NUM_THREADS or the like, the pods' threads are
    torch's own) → (config, its file, environment)."""
    (cm,) = [d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"] == f"{release}-config"]
    cfg = yaml.safe_load(cm["data"]["pipeline.yaml"])
    config = tmp / f"{release}.yaml"
    config.write_text(yaml.safe_dump(cfg))
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(tmp), "PYTHONPATH": str(REPO),
           "SAPD_S3_ENDPOINT_URL": s3.endpoint_url, "AWS_ACCESS_KEY_ID": s3.access_key,
           "AWS_SECRET_ACCESS_KEY": s3.secret_key, "AWS_DEFAULT_REGION": "us-east-1",
           "SAPD_CACHE_DIR": str(tmp / f"{release}-cache"), "HF_HOME": str(tmp / f"{release}-hf"),
           "PYTHONUNBUFFERED": "1"}
    return cfg, config, env


def run_sapd(prefix: str, s3: S3Server, tmp: Path, release: str, rounds: int, log) -> tuple[str, dict[int, float]]:
    """`sapd run` on the config the chart gives the pipeline's stages (another run root) → (root, commits)."""
    cfg, config, env = _local(_render(prefix, s3, release, rounds, "sapd-run"), s3, tmp, release)
    python = image_env("cpu") / "bin" / "python"  # the smoke overlay's image, as its pods run
    t0 = time.monotonic()
    watch = CommitWatch(cfg["run_root"], rounds, t0)
    out = tmp / f"{release}.log"
    stamped = Stamped(out, t0)
    proc = subprocess.Popen([str(python), "-m", "sapd.cli", "run", str(config), "--no-progress"], cwd=tmp, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    stamped.start(proc)
    try:
        proc.wait(timeout=3600)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        stamped.join()
        seen = watch.stop()
    if proc.returncode != 0:
        raise SystemExit(f"sapd run failed ({proc.returncode}):\n{out.read_text()[-3000:]}")
    log(f"  sapd run: done ({out})")
    return cfg["run_root"], seen


def run_processes(prefix: str, s3: S3Server, tmp: Path, release: str, rounds: int, log) -> tuple[str, dict[int, float]]:
    """The persistent stage workers without the cluster: the three commands the chart's persistent pods run
    (the prefix build; one teacher-scores worker and one torchrun trainer serving every round), started
    together as plain processes on this machine, with the pods' environment (the OpenMP settings of each
    pod template too) and the pods' input poll → (root, commits). What this mode adds to `sapd run`
    is the persistent design's own cost (separate processes, the hand-off through S3, every checkpoint
    written and read back); what the persistent Jobs add to it is the cluster's (scheduling, the harness's
    processes on the same cores)."""
    docs = _render(prefix, s3, release, rounds, "persistent")
    cfg, config, env = _local(docs, s3, tmp, release)
    env = {**env, "SAPD_LEASE_OWNER": f"release {release} in namespace {NS}", "SAPD_TRAIN_PROCESSES": "1",
           "SAPD_PUSHGATEWAY_URL": ""}
    bindir = image_env("cpu") / "bin"
    base = ["--config", str(config)]
    pool = ["--round", "0", "--rounds", str(rounds), "--poll-seconds", "0.5", "--input-timeout-seconds", "3600"]
    commands = {
        "build-prefixes": [str(bindir / "python"), "-m", "sapd.jobs.build_prefixes", *base],
        "teacher-scores": [str(bindir / "python"), "-m", "sapd.jobs.teacher_scores", *base, *pool, "--worker", "0"],
        "train": [str(bindir / "torchrun"), "--nnodes=1", "--nproc-per-node=1", "--node-rank=0",
                  "--master-addr=127.0.0.1", f"--master-port={free_port()}", "-m", "sapd.jobs.train", *base, *pool],
    }
    envs = {name: {**env, "SAPD_JOB": name, **_openmp_env(docs, release, name)} for name in commands}
    t0 = time.monotonic()
    watch = CommitWatch(cfg["run_root"], rounds, t0)
    outs = {name: Stamped(tmp / f"{release}-{name}.log", t0) for name in commands}
    procs = {name: subprocess.Popen(cmd, cwd=tmp, env=envs[name], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                    text=True) for name, cmd in commands.items()}
    for name, proc in procs.items():
        outs[name].start(proc)
    try:
        wait_together(procs, 3600, poll_s=0.5)
    finally:
        for out in outs.values():
            out.join()
        seen = watch.stop()
    for name, p in procs.items():
        if p.returncode != 0:
            raise SystemExit(f"{release}: {name} exited {p.returncode}:\n"
                             f"{(tmp / f'{release}-{name}.log').read_text()[-3000:]}")
    log(f"  {LABELS['processes']}: done ({tmp / release}-*.log)")
    return cfg["run_root"], seen


def run_cluster(cluster: Cluster, prefix: str, s3: S3Server, release: str, rounds: int, mode: str,
                log, keep: Path | None = None) -> tuple[str, dict[int, float]]:
    """`helm install <release> charts/sapd -f smoke.yaml --set …` until its driver completes."""
    t0 = time.monotonic()
    rel = cluster.helm.install(release, CHART, values_files=[SMOKE],
                               set_values=_sets(prefix, s3.endpoint_url, release, rounds, mode))
    root = rel.values["runRoot"]
    watch = CommitWatch(root, rounds, t0)
    try:
        state = cluster.wait_job(f"{release}-pipeline-1", timeout=3600)
    finally:
        seen = watch.stop()
    if state != "Complete":
        raise SystemExit(f"{release}: the driver ended {state}\n{cluster.describe()}")
    created = [ln.split()[1].rstrip(":") for p in cluster.pods(f"batch.kubernetes.io/job-name={release}-pipeline-1")
               for ln in cluster.logs(p["metadata"]["name"]).splitlines() if ": created (" in ln and ln.startswith("job ")]
    log(f"  {LABELS[mode]}: done; stage Jobs created: {len(created)}")
    if keep is not None:  # every pod's log, before the uninstall removes them
        (keep / release).mkdir(parents=True, exist_ok=True)
        for p in cluster.pods():
            if (name := p["metadata"]["name"]).startswith(f"{release}-"):
                (keep / release / f"{name}.log").write_text(cluster.logs(name))
    cluster.helm.uninstall(release)
    cluster.wait_for(lambda: not [j for j in cluster.store.list("Job", NS)
                                  if j["metadata"]["name"].startswith(f"{release}-")], 300, f"{release}'s Jobs to go")
    return root, seen


def load_average() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "?"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="bench/round_overhead.py", description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=4, help="rounds of the run (default 4)")
    ap.add_argument("--repeats", type=int, default=1, help="runs of every mode, alternated (default 1)")
    ap.add_argument("--modes", default=",".join(MODES), help=f"comma-separated subset of {','.join(MODES)}")
    ap.add_argument("--json", default=None, help="also write every run's figures here")
    ap.add_argument("--keep", action="store_true",
                    help="keep the working folder (every pod's log, the S3 server's data) and say where it is")
    args = ap.parse_args(argv)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if unknown := sorted(set(modes) - set(MODES)):
        ap.error(f"--modes: unknown {unknown}; choose from {', '.join(MODES)}")
    if "sapd-run" not in modes:
        ap.error("--modes: sapd-run is the baseline every ratio is measured against")
    log = lambda line: print(line, flush=True)  # noqa: E731
    results: list[Result] = []
    tmp = Path(tempfile.mkdtemp(prefix="sapd-round-overhead-"))
    tmp.chmod(0o755)
    started_load = load_average()
    try:
        with running_s3_server(tmp / "seaweedfs") as s3, user_s3(s3):
            prefix = _inputs(tmp / "inputs", s3.bucket)
            with journey_cluster(tmp / "cluster", s3) as cluster:
                for rep in range(args.repeats):
                    order = modes[rep % len(modes):] + modes[:rep % len(modes)]  # each mode first in turn
                    for mode in order:
                        release = f"rb-{mode}-{rep}"
                        log(f"repeat {rep + 1}/{args.repeats}: {LABELS[mode]} ({args.rounds} rounds, load {load_average()})")
                        if mode == "sapd-run":
                            root, seen = run_sapd(prefix, s3, tmp, release, args.rounds, log)
                        elif mode == "processes":
                            root, seen = run_processes(prefix, s3, tmp, release, args.rounds, log)
                        else:
                            root, seen = run_cluster(cluster, prefix, s3, release, args.rounds, mode, log,
                                                         keep=tmp / "logs" if args.keep else None)
                        if len(seen) != args.rounds + 1:
                            raise SystemExit(f"{release}: checkpoints seen {sorted(seen)}, not 0…{args.rounds}")
                        r = Result(mode, rep, seen[args.rounds] - seen[0], seen[args.rounds], seen,
                                   _weights_sha(root, args.rounds))
                        log(f"  rounds {r.rounds_s:.1f}s (checkpoint 0 → {args.rounds}), total {r.total_s:.1f}s")
                        results.append(r)
    finally:
        if args.keep:
            log(f"kept: {tmp} (every pod's log under {tmp / 'logs'})")
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    best = {m: min((r for r in results if r.mode == m), key=lambda r: r.rounds_s) for m in modes}
    base = best["sapd-run"]
    print(f"\nround overhead on the harness: the smoke overlay, {args.rounds} rounds, best of {args.repeats} per mode; "
          f"load average {started_load} at the start, {load_average()} at the end")
    print("| mode | rounds s (ckpt 0 → N) | ratio to sapd run | per round s | total s (command → ckpt N) | ratio |")
    print("|---|---|---|---|---|---|")
    for m in modes:
        r = best[m]
        print(f"| {LABELS[m]} | {r.rounds_s:.1f} | {r.rounds_s / base.rounds_s:.2f}× | {r.rounds_s / args.rounds:.1f} | "
              f"{r.total_s:.1f} | {r.total_s / base.total_s:.2f}× |")
    reference = {r.weights_sha256 for r in results if r.mode != "overlap"}
    same = len(reference) == 1
    print(f"checkpoint {args.rounds} of every run without overlap: "
          + ("the same weights, bit for bit" if same else f"DIFFERENT weights ({len(reference)} versions)"))
    if args.json:
        Path(args.json).write_text(json.dumps({"rounds": args.rounds, "repeats": args.repeats,
                                               "load_average": [started_load, load_average()],
                                               "runs": [asdict(r) for r in results]}, indent=2) + "\n")
    ratio = {m: f"{best[m].rounds_s / base.rounds_s:.2f}×" if m in best else "n/a" for m in MODES}
    if "overlap" in best and "persistent" in best:
        print(f"train.overlap one_step on persistent Jobs: {best['overlap'].rounds_s / best['persistent'].rounds_s:.2f}× "
              "the persistent Jobs' rounds")
    if "processes" in best and "persistent" in best:
        print(f"persistent workers as processes, no cluster: {ratio['processes']} sapd run; the persistent Jobs "
              f"{best['persistent'].rounds_s / best['processes'].rounds_s:.2f}× those processes' rounds")
    line = (f"round overhead: persistent {ratio['persistent']} sapd run, per-round Jobs {ratio['per-round']} "
            f"({args.rounds} rounds)")
    print(line)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
