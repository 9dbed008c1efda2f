"""Job: delete a release's groups from the Pushgateway (the chart's post-delete hook), so that an
uninstalled release leaves no series behind on the dashboards. Every group pushed with this release
and namespace is deleted (each stage's, each teacher-scores worker's). The release's pods may still be
stopping when the hook starts (`helm uninstall` deletes them in the background), and one that finishes
then pushes once more: after ``--settle-seconds`` (the pods' termination grace) the groups are looked up
and deleted again.

Local:   python -m sapd.jobs.delete_metrics --pushgateway http://127.0.0.1:9091 --namespace sapd --release sapd-alfworld
Cluster: helm uninstall sapd-alfworld   (the hook Job <release>-delete-metrics; metrics.deleteOnUninstall)
Exit codes (sapd.entry): 0 deleted (or nothing there), 2 bad flags; an unreachable Pushgateway is retried
until --deadline-seconds, then reported as a WARNING with exit 0: an uninstall never fails on dashboards.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import urllib.error
from typing import Sequence

from sapd.entry import EXIT_USER_ERROR, log_line, run_main
from sapd.metrics import delete_release_groups


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m sapd.jobs.delete_metrics", description=__doc__.splitlines()[0])
    p.add_argument("--pushgateway", default=os.environ.get("SAPD_PUSHGATEWAY_URL"),
                   help="the Pushgateway's URL (default $SAPD_PUSHGATEWAY_URL)")
    p.add_argument("--namespace", default=os.environ.get("SAPD_NAMESPACE", ""),
                   help="the release's namespace (default $SAPD_NAMESPACE; empty: groups pushed without one)")
    p.add_argument("--release", default=os.environ.get("SAPD_RELEASE"), help="the release (default $SAPD_RELEASE)")
    p.add_argument("--settle-seconds", type=float, default=30.0,
                   help="look again this long after the first deletion, for pods that were still stopping "
                        "(default 30, the pods' termination grace)")
    p.add_argument("--deadline-seconds", type=float, default=120.0,
                   help="keep retrying an unreachable Pushgateway this long (default 120)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    if not args.pushgateway or not args.release:
        log_line("delete-metrics: error: --pushgateway and --release are required (or SAPD_PUSHGATEWAY_URL and "
                 "SAPD_RELEASE)")
        return EXIT_USER_ERROR
    where = f"release {args.release}" + (f" in namespace {args.namespace}" if args.namespace else "")

    def delete_all() -> list[dict[str, str]] | None:
        """The deleted groups; None if the Pushgateway stayed unreachable until the deadline."""
        give_up = time.monotonic() + args.deadline_seconds
        delay = 1.0
        while True:
            try:
                return delete_release_groups(args.pushgateway, args.namespace, args.release)
            except (urllib.error.URLError, OSError) as e:
                if time.monotonic() + delay > give_up:
                    log_line(f"delete-metrics: WARNING: the Pushgateway {args.pushgateway} is unreachable ({e}); "
                             f"the groups of {where} stay there: delete them in its web UI, or with `curl -X DELETE "
                             f"{args.pushgateway.rstrip('/')}/metrics/job/<job>/namespace/{args.namespace}/release/"
                             f"{args.release}`")
                    return None
                log_line(f"delete-metrics: the Pushgateway {args.pushgateway} is unreachable ({e}); retrying")
                time.sleep(delay)
                delay = min(2 * delay, 15.0)

    def body() -> int:
        first = delete_all()
        if first is None:
            return 0
        log_line(f"delete-metrics: deleted {len(first)} group(s) of {where}: "
                 + (", ".join("/".join(f"{k}={v}" for k, v in sorted(g.items())) for g in first) or "none"))
        if args.settle_seconds > 0:
            time.sleep(args.settle_seconds)
            late = delete_all()
            if late:
                log_line(f"delete-metrics: deleted {len(late)} group(s) pushed since (pods that were still stopping)")
        return 0

    return run_main("delete-metrics", body)


if __name__ == "__main__":
    sys.exit(main())
