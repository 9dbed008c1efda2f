"""Is one training round reproducible? The same torch-engine round from identical inputs, run again and again in
fresh processes with torch's default intra-op threads, under each OpenMP wait policy; prints how many distinct
checkpoints each policy produced. Run it as ``python -m tests.train_reproducibility [RUNS]`` (default 25 per
policy; ~8 s a run on 2 cores); the numbers in docs/results/ROUND_OVERHEAD.md came from it.

The run: the tests' tiny student and teacher (tests/pipeline_util.py), 2 rounds of `sapd run` on a local run
root; then RUNS times: a copy of that root without checkpoint 2, and `python -m sapd.jobs.train --round 1` on
it, as a persistent or per-round train pod runs it (no OMP_NUM_THREADS: torch's default threads).

``--in-process N`` instead repeats two optimizer steps of the tiny student N times in one process (run it with
the environment to test, e.g. ``OMP_WAIT_POLICY=PASSIVE python -m tests.train_reproducibility --in-process 400
--load 1``)."""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

from tests.pipeline_util import make_models, tiny_config


def _digest(root: Path) -> str:
    h = hashlib.sha256()
    for f in sorted((root / "checkpoints" / "000002").rglob("model.safetensors")):
        h.update(f.read_bytes())
    return h.hexdigest()[:12]


def _variant(spec: str) -> tuple[str, dict[str, str]]:
    if spec == "-":
        return "(default environment)", {}
    pairs = [kv.split("=", 1) for kv in spec.split(",")]
    if any(len(p) != 2 or not p[0] for p in pairs):
        raise SystemExit(f"--variant {spec!r}: expected K=V[,K=V...]")
    return spec, dict((k, v) for k, v in pairs)


def in_process(repeats: int, tmp: Path) -> int:
    """The tiny student's two AdamW steps from one state on one padded batch of four lengths, ``repeats`` times
    in this process (its environment's threads and wait policy): how many ended with other weights than the
    first. A variation that shows here is in a kernel's timing; one that shows only across processes is not."""
    import torch
    from transformers import AutoModelForCausalLM
    student, _ = make_models(tmp / "models")
    model = AutoModelForCausalLM.from_pretrained(student, dtype=torch.float32)
    model.train()
    start = {k: v.clone() for k, v in model.state_dict().items()}
    gen = torch.Generator().manual_seed(0)
    lengths = [700, 433, 610, 128]
    ids = torch.randint(0, model.config.vocab_size, (len(lengths), max(lengths)), generator=gen)
    mask = (torch.arange(max(lengths))[None, :] < torch.tensor(lengths)[:, None]).long()
    weight = torch.linspace(-1, 1, max(lengths) - 1)

    def steps() -> dict[str, torch.Tensor]:
        model.load_state_dict(start)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        for _ in range(2):
            opt.zero_grad(set_to_none=True)
            logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1].float()
            logp = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
            m = mask[:, 1:].float()
            (-(logp * weight * m).sum() / m.sum()).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
        return {k: v.detach().clone() for k, v in model.state_dict().items()}

    first, differed, t0 = steps(), 0, time.monotonic()
    for _ in range(repeats):
        got = steps()
        differed += any(not torch.equal(first[k], got[k]) for k in first)
    print(f"in one process ({torch.get_num_threads()} threads, OMP_WAIT_POLICY="
          f"{os.environ.get('OMP_WAIT_POLICY', '(unset)')}): {repeats} repeats in {time.monotonic() - t0:.0f} s; "
          f"{differed} ended with other weights than the first", flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tests.train_reproducibility", description=__doc__.splitlines()[0])
    ap.add_argument("runs", type=int, nargs="?", default=25, help="runs per variant (default 25)")
    ap.add_argument("--variant", action="append", default=[], metavar="K=V[,K=V...]",
                    help="an environment to run the round under, added to the default one (repeatable; default: "
                         "OMP_WAIT_POLICY unset, then PASSIVE); '-' is the default environment")
    ap.add_argument("--load", type=int, default=0, metavar="N",
                    help="keep N busy-looping processes running meanwhile (timing noise makes a race show more often)")
    ap.add_argument("--in-process", type=int, default=0, metavar="N",
                    help="instead: N repeats of two optimizer steps in this one process (its own environment)")
    args = ap.parse_args(argv)
    variants = [_variant(v) for v in (args.variant or ["-", "OMP_WAIT_POLICY=PASSIVE"])]
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.load)]
    tmp = Path(tempfile.mkdtemp(prefix="sapd-train-repro-"))
    try:
        if args.in_process:
            return in_process(args.in_process, tmp)
        student, teacher = make_models(tmp / "models")
        base = tmp / "base"
        cfg = tiny_config(str(base), student, teacher, train={"rounds": 2})
        (tmp / "config.yaml").write_text(yaml.safe_dump(cfg))
        env = {k: v for k, v in os.environ.items() if not k.startswith("OMP_")}  # torch's default threads
        env["PYTHONPATH"] = str(Path(__file__).resolve().parents[1])
        subprocess.run([sys.executable, "-m", "sapd.cli", "run", str(tmp / "config.yaml"), "--no-progress"], env=env,
                       check=True, capture_output=True)
        ref = _digest(base)
        print(f"sapd run's checkpoint 2: {ref}", flush=True)
        for name, extra in variants:
            seen: dict[str, int] = {}
            t0 = time.monotonic()
            for i in range(args.runs):
                root = tmp / f"run-{i}"
                shutil.copytree(base, root)
                shutil.rmtree(root / "checkpoints" / "000002")
                stored = root / "config.yaml"  # the run root's record of its config names its own root
                stored.write_text(stored.read_text().replace(str(base), str(root)))
                config = tmp / f"config-{i}.yaml"
                config.write_text(yaml.safe_dump({**cfg, "run_root": str(root)}))
                proc = subprocess.run([sys.executable, "-m", "sapd.jobs.train", "--config", str(config), "--round", "1",
                                       "--no-check", "--no-progress"],
                                      env={**env, **extra},
                                      capture_output=True, text=True)
                if proc.returncode != 0:
                    raise SystemExit(f"train round 1 failed:\n{(proc.stdout + proc.stderr)[-3000:]}")
                d = _digest(root)
                seen[d] = seen.get(d, 0) + 1
                shutil.rmtree(root)
            print(f"{name}: {args.runs} runs in {time.monotonic() - t0:.0f} s; "
                  f"checkpoint 2 hashes {seen} (sapd run's: {ref})", flush=True)
    finally:
        for h in hogs:
            h.kill()
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
