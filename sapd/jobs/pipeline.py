"""Job: the pipeline driver — sequences a whole run by creating the stage Jobs with the Kubernetes API,
waiting for them, and resuming from what is committed in the run root (sapd/run/k8s.py).

Order: the run's plan (sapd/run/plan.py, the one `sapd run` follows): build-prefixes (unless prefixes and
checkpoint 0 are committed); then the rounds k < train.rounds whose checkpoint k+1 is not committed;
finally evaluate-r<R> if the chart renders an evaluate template. The rounds (--stage-jobs):
- persistent (the default): teacher-scores-r<k> (an Indexed Job) and train-r<k>, created together at the
  first round k not done, whose pods stay up for --rounds-per-job rounds (0: the rest of the run), keep
  their models loaded and start each round once its input is committed (the last scoring worker commits
  a round, the trainer every checkpoint); the driver logs each round's commits and recreates a Job that
  fails or commits nothing within one round's time limit once that round's input is committed;
- per-round: per round, teacher-scores-r<k> (skipped for sft or when already committed), then train-r<k>.
Stage manifests come from --templates (the chart's pipeline-templates ConfigMap); the stage Jobs are
made dependents of --owner (the chart: that ConfigMap, which every Helm revision keeps, so an upgrade
never deletes a running stage Job and `helm uninstall` removes them all). A restarted or replaced driver
adopts the running stage Jobs instead of creating duplicates and skips every committed stage. A Job
that fails, or completes without committing its output, is deleted and created again at most
--retries times (a preempted train pod or a train group that never assembled is not counted); a failed
final evaluation is reported and the run still completes. The evaluation starts once the Jobs it needs
are complete (--evaluate-after-job: the chart's ALFWorld data fill). Every line it prints is meant to be
read with `kubectl logs job/<release>-pipeline-<revision>`.

With --stage (and --round) it runs one step only: it waits until the step's input is committed (in its own
small pod, holding no GPU), then runs that step's Job as above. The chart's `mode: manual` renders one such
Job per stage of round `round`.

Cluster: helm install sapd-alfworld charts/sapd -f charts/sapd/values/alfworld.yaml
         (mode: pipeline, the default: the driver Job <release>-pipeline-<revision> creates the stage Jobs)
Local:   python -m sapd.jobs.pipeline --config run.yaml --release sapd-alfworld --namespace sapd \
             --templates rendered-templates/ --kubeconfig ~/.kube/config
         python -m sapd.jobs.pipeline … --stage train --round 3      (one step, once its input is committed)
First it runs the checks of `sapd check` (storage, run root, data sample, models and tokenizers; memory is
checked by each stage pod on its own device): a failure exits before any Job is created (--no-check skips).
Then it takes the run root's lease as the release (sapd/lease.py; `SAPD_LEASE_OWNER`, which the chart sets in
every pod, else `release <release> in namespace <namespace>`): a restarted or upgraded driver, the gates and
the stage Jobs of the same release share it; a root another run holds is refused with one line naming it
(exit 2) — `--force-takeover` (the chart's `pipeline.forceTakeover`) takes it over. A complete run gives the
lease back; a gate leaves it to expire (`storage.lease_ttl_s` after the release's last renewal).
Exit codes (sapd.entry): 0 run (or step) complete — a failed final evaluation included, which it reports —,
1 a stage kept failing (the message names the Job and what to do), 2 bad config or templates, 3 Kubernetes
API error or a wait ran out, 75 storage unreachable.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Sequence

from kubernetes.client.exceptions import ApiException
from kubernetes.config.config_exception import ConfigException

from sapd import lease
from sapd.entry import add_config_flags, config_from_args, log_line, run_main
from sapd.run.check import preflight
from sapd.run.k8s import (
    POOL_STAGES,
    STAGE_JOBS,
    STAGES,
    Driver,
    KubeError,
    StageTemplates,
    current_namespace,
    load_api_client,
)
from sapd.run.plan import Step


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m sapd.jobs.pipeline", description=__doc__.splitlines()[0])
    add_config_flags(p, progress=False)
    p.add_argument("--release", required=True, help="the Helm release (only used in log lines)")
    p.add_argument("--templates", default="/etc/sapd-pipeline",
                   help="folder of stage manifests (<stage>.yaml; default /etc/sapd-pipeline)")
    p.add_argument("--namespace", default=None,
                   help="namespace of the stage Jobs (default: $SAPD_NAMESPACE, else the pod's own namespace)")
    p.add_argument("--retries", type=int, default=2, help="recreate a failed stage Job at most this often (default 2)")
    p.add_argument("--poll-seconds", type=float, default=30.0, help="seconds between Job status reads (default 30)")
    p.add_argument("--log-every-seconds", type=float, default=300.0,
                   help="seconds between 'still running' lines (default 300)")
    p.add_argument("--stage-timeout-seconds", type=float, default=None,
                   help="give up waiting on one Job after this long (default: its activeDeadlineSeconds + 600)")
    p.add_argument("--owner", default=os.environ.get("SAPD_PIPELINE_OWNER"),
                   help="configmap/<name> or job/<name>: the object the stage Jobs belong to, so that deleting it "
                        "removes them (the chart: the release's pipeline-templates ConfigMap; default "
                        "$SAPD_PIPELINE_OWNER, else none)")
    p.add_argument("--evaluate-after-job", action="append", default=[], metavar="JOB",
                   help="a Job of the release the evaluation needs complete first (repeatable; the chart: the "
                        "ALFWorld data fill); one that is not there is taken as done and deleted after its TTL")
    p.add_argument("--stage-jobs", choices=STAGE_JOBS, default=None,
                   help="persistent (default): one teacher-scores Job and one train Job whose pods stay up for "
                        "--rounds-per-job rounds, keeping their models loaded; per-round: two Jobs per round")
    p.add_argument("--rounds-per-job", type=int, default=0,
                   help="with --stage-jobs persistent: rounds one Job serves before the next is created (default 0: "
                        "every round left)")
    p.add_argument("--stage", choices=STAGES, default=None,
                   help="run this step only, once its input is committed (the chart's manual mode)")
    p.add_argument("--round", type=int, default=None, help="the round of --stage (not for build-prefixes)")
    p.add_argument("--kubeconfig", default=None, help="kubeconfig file (default: in-cluster config inside a pod)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    if args.stage is not None and (args.round is None) != (args.stage == "build-prefixes"):
        parser.error(f"--stage {args.stage} {'takes no' if args.stage == 'build-prefixes' else 'needs a'} --round")

    def body() -> None:
        cfg = config_from_args(args)
        if not args.no_check:
            preflight(cfg, "driver", log=log_line)  # before any stage Job is created
        templates = StageTemplates.from_dir(args.templates)
        # default: persistent, unless the templates cannot serve several rounds (a chart from before
        # persistent workers, e.g. a driver pod of an older revision running this code): then per-round
        stage_jobs = args.stage_jobs or ("persistent" if all(templates.serves_rounds(st) for st in POOL_STAGES
                                                             if templates.has(st)) else "per-round")
        namespace = current_namespace(args.namespace)
        log_line(f"pipeline: release {args.release}, templates {args.templates} ({', '.join(sorted(templates.texts))})")
        claimant = lease.Claimant.of_release(args.release, namespace, "python -m sapd.jobs.pipeline"
                                             + (f" --stage {args.stage}" if args.stage else ""))
        hint = (f"helm upgrade {args.release} --reuse-values --set pipeline.forceTakeover=true (or run "
                "sapd.jobs.pipeline with --force-takeover)")
        with lease.holding(cfg.run_root, claimant, ttl_s=cfg.storage.lease_ttl_s, log=log_line,
                           force=args.force_takeover, takeover_hint=hint,
                           give_back="owner" if args.stage is None else "no") as held:
            log_line(f"pipeline: holding the lease of {cfg.run_root} as {claimant.owner}")
            try:
                driver = Driver(cfg, templates, load_api_client(args.kubeconfig), namespace, retries=args.retries,
                                poll_seconds=args.poll_seconds, log_every_seconds=args.log_every_seconds,
                                stage_timeout_seconds=args.stage_timeout_seconds, owner=args.owner, log=log_line,
                                lease=held, evaluate_after=args.evaluate_after_job,
                                stage_jobs=stage_jobs if args.stage is None else "per-round",
                                rounds_per_job=args.rounds_per_job)
                if args.stage is None:
                    driver.run()
                else:
                    driver.run_stage(Step(args.stage, args.round))
            except (ApiException, ConfigException) as e:
                raise KubeError(f"Kubernetes API: {str(e).strip().splitlines()[0]}") from e

    return run_main("pipeline", body)


if __name__ == "__main__":
    sys.exit(main())
