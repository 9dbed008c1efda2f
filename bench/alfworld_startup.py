"""ALFWorld's start-up, as shipped against paid once (issue 34 item 5): ``sapd collect-expert`` with the planner
expert on generated games, each episode's environment in its own process (``--env-timeout``, the default), timed
three ways in one run:

- **as shipped** (``--no-engine-cache``): every environment process imports ALFWorld, parses the grammar and runs
  Fast Downward's translator four times per game (twice at load, twice again at reset);
- **cached, cold**: a fresh ``SAPD_CACHE_DIR``: the parent parses what every game shares before the environment
  processes fork, translations are done once per game and written to the cache;
- **cached, warm**: the same command again over the same cache folder (a second collection, a re-evaluation, the
  next checkpoint's evaluation of the same games): the translations are read back.

    .venv/bin/python bench/alfworld_startup.py [--per-type 5] [--repeats 1] [--json out.json]
    .venv/bin/python bench/alfworld_startup.py --alfworld-data DIR --split valid_unseen --limit 6

Each run is the user's command in a fresh process (``python -m sapd.cli collect-expert …``), so its imports are as
cold as a user's; the child only records when each episode finishes (for the time to the first one) and the
parent times the whole process. The expert trajectories written by the three must be identical (the bench fails
otherwise). Without ``--alfworld-data`` the games are generated first with ``sapd alfworld-games`` (not timed).
Each run's CPU time (the command and every environment process it forked) is reported beside its wall time: on a
shared machine other work stretches the wall time, hardly the CPU time. The last line is
``alfworld start-up: cached X.X× faster cold, Y.Y× warm than as shipped; CPU A.A× and B.B× (N planner episodes, …)``
(wall-time ratios, then CPU-time ratios, of the medians over ``--repeats``).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
CONDITIONS = ("shipped", "cold", "warm")

# the CLI itself, with a progress hook that records when each episode finishes (seconds since this child began)
CHILD = r"""
import json, sys, time
t0 = time.perf_counter()
finished = []
import sapd.envs.loop as loop
_collect = loop.collect_expert
def collect_expert(*args, progress=None, **kwargs):
    def hook(n):
        finished.extend([time.perf_counter() - t0] * n)
        if progress is not None:
            progress(n)
    return _collect(*args, progress=hook, **kwargs)
loop.collect_expert = collect_expert
from sapd.cli import main
code = main(json.loads(sys.argv[1]))
json.dump({"code": code, "finished": finished, "seconds": time.perf_counter() - t0}, open(sys.argv[2], "w"))
"""


def _cpu_of_children() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run_child(argv: list[str], cache_dir: Path, record: Path) -> dict[str, Any]:
    """One run: wall time, and CPU time of the command with every environment process it forked (each is
    waited for, so its usage adds up into ours): the load of a shared machine stretches the first, hardly
    the second."""
    env = {**os.environ, "SAPD_CACHE_DIR": str(cache_dir), "PYTHONPATH": str(REPO)}
    t0, cpu0 = time.perf_counter(), _cpu_of_children()
    out = subprocess.run([sys.executable, "-c", CHILD, json.dumps(argv), str(record)], capture_output=True,
                         text=True, cwd=REPO, env=env)
    wall, cpu = time.perf_counter() - t0, _cpu_of_children() - cpu0
    if out.returncode != 0:
        raise SystemExit(f"sapd {' '.join(argv)} failed ({out.returncode}):\n{out.stderr[-4000:]}")
    rec = json.loads(record.read_text())
    return {"wall_seconds": wall, "cpu_seconds": cpu,
            "first_episode_seconds": rec["finished"][0] if rec["finished"] else None,
            "episodes": len(rec["finished"]), "stdout": out.stdout}


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--alfworld-data", default=None, help="ALFWORLD_DATA with the split (default: generate games)")
    ap.add_argument("--split", default="valid_unseen")
    ap.add_argument("--per-type", type=int, default=5, help="games per task type to generate (no --alfworld-data)")
    ap.add_argument("--limit", type=int, default=None, help="at most this many episodes")
    ap.add_argument("--expert", default="planner", choices=["planner", "handcoded"])
    ap.add_argument("--env-timeout", type=float, default=300.0, help="as sapd's flag (0 = no worker processes)")
    ap.add_argument("--repeats", type=int, default=1, help="each condition this many times (medians reported)")
    ap.add_argument("--work", default=None, help="working folder (default: a temporary one)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(args.work or tmp)
        data = Path(args.alfworld_data) if args.alfworld_data else work / "alfworld-games"
        if not args.alfworld_data:
            subprocess.run([sys.executable, "-m", "sapd.cli", "alfworld-games", "--out", str(data), "--split",
                            args.split, "--per-type", str(args.per_type), "--no-progress"], cwd=REPO, check=True,
                           env={**os.environ, "PYTHONPATH": str(REPO)})
        base = ["collect-expert", "--benchmark", "alfworld", "--expert", args.expert, "--split", args.split,
                "--alfworld-data", str(data), "--env-timeout", str(args.env_timeout), "--no-progress"]
        if args.limit is not None:
            base += ["--limit", str(args.limit)]
        runs: dict[str, list[dict[str, Any]]] = {c: [] for c in CONDITIONS}
        digests: dict[str, set[str]] = {c: set() for c in CONDITIONS}
        for r in range(args.repeats):
            cache = work / f"cache-{r}"  # empty for "cold", then reused by "warm"
            for cond in CONDITIONS:
                out = work / f"expert-{cond}-{r}.jsonl"
                argv = base + ["--out", str(out)] + (["--no-engine-cache"] if cond == "shipped" else [])
                res = run_child(argv, cache if cond != "shipped" else work / f"unused-{r}", work / f"{cond}-{r}.json")
                res["cache_files"] = sum(1 for _ in cache.rglob("*.sas.gz")) if cond != "shipped" else 0
                runs[cond].append(res)
                digests[cond].add(digest(out))
                print(f"repeat {r} {cond}: {res['wall_seconds']:.1f} s ({res['cpu_seconds']:.1f} s CPU), first "
                      f"episode after {res['first_episode_seconds']:.1f} s, {res['episodes']} episodes; "
                      f"load average {os.getloadavg()[0]:.1f}", flush=True)
        if len(set().union(*digests.values())) != 1:
            raise SystemExit(f"the expert trajectories differ between the conditions: {digests}")
        print(next(line for line in runs["shipped"][0]["stdout"].splitlines() if line.startswith("wrote ")))
    n = runs["shipped"][0]["episodes"]
    med = {c: {k: statistics.median(r[k] for r in rs) for k in ("wall_seconds", "cpu_seconds", "first_episode_seconds")}
           for c, rs in runs.items()}
    result: dict[str, Any] = {
        "episodes": n, "expert": args.expert, "env_timeout": args.env_timeout, "repeats": args.repeats,
        "median": med,
        "runs": {c: [{k: v for k, v in r.items() if k != "stdout"} for r in rs] for c, rs in runs.items()}}
    for c in ("cold", "warm"):
        result[f"speedup_{c}"] = med["shipped"]["wall_seconds"] / med[c]["wall_seconds"]
        result[f"cpu_speedup_{c}"] = med["shipped"]["cpu_seconds"] / med[c]["cpu_seconds"]
        result[f"first_episode_speedup_{c}"] = med["shipped"]["first_episode_seconds"] / med[c]["first_episode_seconds"]
    print("\n| | whole command s | CPU s (all processes) | first episode after s |\n|---|---|---|---|")
    for c in CONDITIONS:
        print(f"| {c} | {med[c]['wall_seconds']:.1f} | {med[c]['cpu_seconds']:.1f} | "
              f"{med[c]['first_episode_seconds']:.1f} |")
    print(f"identical expert trajectories in all {len(CONDITIONS) * args.repeats} runs")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    where = "isolated workers" if args.env_timeout > 0 else "in-process"
    print(f"alfworld start-up: cached {result['speedup_cold']:.1f}× faster cold, {result['speedup_warm']:.1f}× warm "
          f"than as shipped; CPU {result['cpu_speedup_cold']:.1f}× and {result['cpu_speedup_warm']:.1f}× "
          f"({n} {args.expert} episodes, {where})")
    return result


if __name__ == "__main__":
    main()
