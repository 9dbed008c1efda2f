"""Job: the checks of ``sapd check`` before a run spends GPUs (the chart's `helm test` pod): the run
config loads, the run root is reachable and writable with the given credentials (a probe object is
written and deleted), it holds no different committed config, a sample of the data input parses, both
model folders have a config and a tokenizer with a chat template (no weights are read) and the
tokenizers are identical, the memory estimate per stage, and the Pushgateway answers. One line per
check; every check runs even after one failed (:func:`sapd.run.check.run_checks`).

Local:   python -m sapd.jobs.check --config run.yaml
Cluster: helm test <release>   (the pod `<release>-preflight`)
Exit codes (sapd.entry): 0 every check passed, 2 a user error (bad config, input, credentials: the
FAILED line says what to fix), 75 a service was unreachable (retry later), 1 another failure.
"""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

from sapd.entry import EXIT_USER_ERROR, add_config_flags, config_from_args, log_line
from sapd.run.check import check_command


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m sapd.jobs.check", description=__doc__.splitlines()[0])
    add_config_flags(p, progress=False, check=False, takeover=False)
    p.add_argument("--device-memory-gib", type=float, default=None,
                   help="compare the memory estimate against this much device memory (default: the device here)")
    p.add_argument("--gpu-memory", type=float, default=None, metavar="GIB",
                   help="plan for the run's GPUs of this many GiB (the `helm test` pod has none of them)")
    p.add_argument("--gpus", type=int, default=None, metavar="N",
                   help="training GPUs to plan for (default: $SAPD_TRAIN_PROCESSES, which the chart sets)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    try:
        cfg = config_from_args(args, announce=False)
    except (ValueError, OSError) as e:
        log_line(f"check config: FAILED: {e}")
        return EXIT_USER_ERROR
    return check_command(cfg, device_memory_gib=args.device_memory_gib, gpu_memory_gib=args.gpu_memory, gpus=args.gpus,
                         log=log_line)


if __name__ == "__main__":
    sys.exit(main())
