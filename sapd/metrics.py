"""Every Prometheus metric sapd exports, declared in one place (docs/design/training.md "Metrics").

Names carry the ``sapd_`` prefix and base units; labels are low-cardinality only (stage, loss term,
advantage statistic, benchmark, category) — never a prefix or trajectory id. Batch jobs push their
registry to a Pushgateway (``SAPD_PUSHGATEWAY_URL``) after each stage and at the end, grouped by job
name, namespace (``SAPD_NAMESPACE``: two teams' releases of one name share a Pushgateway), release
(``SAPD_RELEASE``) and, for the workers of an Indexed Job, their index (``SAPD_METRICS_INSTANCE``);
long training also serves ``/metrics`` on rank 0 (``SAPD_METRICS_PORT``). Without those variables
nothing leaves the process, and the same figures are in the run's JSONL logs.

A push replaces its group (``PUT``), so a stage that finds its work committed (a retried Job, a rerun)
must not push an empty registry over the figures of the run that did the work: :meth:`Metrics.push_skip`
pushes the group's last committed figures again (the exposition text :meth:`Metrics.exposition` gave
when that run pushed, which the caller kept in the run root), with only what the skipping process set
itself on top; without them it adds its own figures and leaves every other series of the group alone
(``POST``). Generic over every family, so a new gauge needs no edit here. :func:`delete_release_groups`
removes a release's groups (the chart's uninstall hook).
"""

from __future__ import annotations

import json
import os
import time
import urllib.request
from dataclasses import dataclass, field
from typing import Any, Iterable

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    delete_from_gateway,
    generate_latest,
    push_to_gateway,
    pushadd_to_gateway,
    start_http_server,
)
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

# stage wall times span sub-second CPU steps to hour-long GPU rounds
_DURATION_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800, 3600, float("inf"))

# training-step record fields → (metric, label value). Loss terms are not listed: every ``loss_X`` key an
# objective logs is ``sapd_loss{term="X"}`` (``loss`` itself is term "total"), so a new objective's terms
# show up with no edit here.
_ADV_STATS = {"step_adv_abs_mean": "step_abs_mean", "step_adv_std": "step_std", "rule_adv_abs_mean": "rule_abs_mean",
              "step_score_mean": "step_score_mean", "rule_score_mean": "rule_score_mean"}


def loss_term(key: str) -> str | None:
    """The ``term`` label of a step-record key: ``loss`` → ``total``, ``loss_X`` → ``X``, else None.

    >>> loss_term("loss"), loss_term("loss_kl"), loss_term("lossy"), loss_term("clip_fraction")
    ('total', 'kl', None, None)
    """
    if key == "loss":
        return "total"
    if key.startswith("loss_") and len(key) > len("loss_"):
        return key[len("loss_"):]
    return None


@dataclass
class Metrics:
    job: str  # Pushgateway grouping key: the job (build_prefixes, teacher_scores, train, pipeline, …)
    pushgateway: str | None = None
    release: str = "local"
    namespace: str = ""  # the Kubernetes namespace (SAPD_NAMESPACE), part of the grouping key when set
    instance: str = ""  # a worker's own grouping key (SAPD_METRICS_INSTANCE), so parallel pushes coexist
    registry: CollectorRegistry = field(default_factory=CollectorRegistry)

    def __post_init__(self) -> None:
        r = self.registry
        self.stage_duration = Histogram("sapd_stage_duration_seconds", "Wall time of one stage run",
                                        ["stage"], buckets=_DURATION_BUCKETS, registry=r)
        self.tokens = Counter("sapd_tokens_total", "Tokens processed, by stage (sample, score, train)",
                              ["stage"], registry=r)
        self.loss = Gauge("sapd_loss", "Loss terms of the last optimizer step (total, and each loss_* term the "
                                       "objective logs)", ["term"], registry=r)
        self.advantage = Gauge("sapd_advantage", "Advantage and score statistics of the last optimizer step",
                               ["stat"], registry=r)
        self.gap = Gauge("sapd_teacher_student_gap",
                         "Mean per-token teacher − student log-prob of sampled tokens (nats)", registry=r)
        self.clip_fraction = Gauge("sapd_clip_ratio", "Share (0-1) of response tokens whose ratio was clipped",
                                   registry=r)
        self.round = Gauge("sapd_round", "Round being (or last) processed", registry=r)
        self.truncated = Gauge("sapd_response_truncated_ratio",
                               "Share (0-1) of the round's sampled responses cut at sampling.max_new_tokens",
                               registry=r)
        # the size of a round's update in the weights the optimizer keeps (the fp32 master in bf16), not in the
        # bf16 copy that samples: a run whose weights do not move shows here (sapd.stages.train.UpdateProbe)
        self.weight_update = Gauge("sapd_weight_update_ratio",
                                   "||w_end - w_start|| / ||w_start|| of the weights the optimizer keeps, last round",
                                   registry=r)
        self.update_applied = Gauge("sapd_update_applied_ratio",
                                    "Share of the update the optimizer computed that its kept weights took, last "
                                    "round (1: all; near 0: lost to rounding)", registry=r)
        self.optimizer_steps = Counter("sapd_optimizer_steps_total", "Optimizer steps taken", registry=r)
        self.eval_success = Gauge("sapd_eval_success_ratio", "Task success (or exact match) of the newest evaluation",
                                  ["benchmark", "category"], registry=r)
        # the newest validated checkpoint's distance to the teacher on held-out prefixes (sapd.data.validation)
        self.validation_checkpoint = Gauge("sapd_validation_checkpoint",
                                           "Checkpoint whose held-out validation the sapd_validation_* figures are",
                                           registry=r)
        self.validation_reverse_kl = Gauge("sapd_validation_reverse_kl",
                                           "Reverse KL(student ‖ teacher) per sampled token on held-out prefixes "
                                           "(nats)", ["category"], registry=r)
        self.validation_recorded_logratio = Gauge(
            "sapd_validation_recorded_logratio",
            "Mean teacher − student log-prob per token of the recorded responses of held-out prefixes (nats)",
            ["category"], registry=r)
        self.validation_action_match = Gauge("sapd_validation_action_match_ratio",
                                             "Share (0-1) of samples at T = 1 on held-out prefixes whose action is "
                                             "the recorded one, by model (student, teacher)", ["model", "category"],
                                             registry=r)
        self.last_success = Gauge("sapd_job_last_success_timestamp_seconds",
                                  "Unix time the job last finished successfully", registry=r)
        self.startup = Gauge("sapd_startup_seconds",
                             "Seconds from the stage process's start to each start-up phase: imports done, models "
                             "loaded, engines ready, first work (once per process)", ["phase"], registry=r)
        self.input_wait = Histogram("sapd_input_wait_seconds", "Time a persistent stage worker waited for its "
                                    "round's input to be committed", ["stage"], buckets=_DURATION_BUCKETS,
                                    registry=r)

    @classmethod
    def from_env(cls, job: str) -> "Metrics":
        return cls(job=job, pushgateway=os.environ.get("SAPD_PUSHGATEWAY_URL") or None,
                   release=os.environ.get("SAPD_RELEASE", "local"), namespace=os.environ.get("SAPD_NAMESPACE", ""),
                   instance=os.environ.get("SAPD_METRICS_INSTANCE", ""))

    # -- recording ---------------------------------------------------------------------------------

    def observe_stage(self, stage: str, seconds: float) -> None:
        self.stage_duration.labels(stage=stage).observe(seconds)

    def add_tokens(self, stage: str, n: int) -> None:
        if n > 0:
            self.tokens.labels(stage=stage).inc(n)

    def record_step(self, rec: dict[str, Any], group_size: int = 1) -> None:
        """One optimizer-step record of the training loop (sapd.stages.train); ``group_size`` G turns the mean
        response length per response into tokens trained."""
        for key, value in rec.items():
            term = loss_term(key)
            if term is not None and isinstance(value, (int, float)):
                self.loss.labels(term=term).set(value)
        for key, stat in _ADV_STATS.items():
            if key in rec:
                self.advantage.labels(stat=stat).set(rec[key])
        if "teacher_student_gap" in rec:
            self.gap.set(rec["teacher_student_gap"])
        if "clip_fraction" in rec:
            self.clip_fraction.set(rec["clip_fraction"])
        if "round_update_rel" in rec:  # the round's last step
            self.weight_update.set(rec["round_update_rel"])
            self.update_applied.set(rec["round_update_applied_ratio"])
        self.round.set(rec.get("round", 0))
        self.optimizer_steps.inc()
        self.observe_stage("train_step", rec.get("step_seconds", 0.0))
        self.add_tokens("train", round(rec.get("response_tokens_mean", 0.0) * rec.get("prefixes", 0) * group_size))

    def record_eval(self, benchmark: str, overall: float, by_category: dict[str, float] | None = None) -> None:
        self.eval_success.labels(benchmark=benchmark, category="all").set(overall)
        for cat, v in (by_category or {}).items():
            self.eval_success.labels(benchmark=benchmark, category=cat).set(v)

    def record_startup(self, seconds: dict[str, float]) -> None:
        for phase, value in seconds.items():
            self.startup.labels(phase=phase).set(value)
    def record_validation(self, checkpoint: int, by_category: dict[str, dict[str, float | None]]) -> None:
        """A committed validation (:func:`sapd.stages.validation.record_metrics`): per category ("all" too)
        ``reverse_kl_per_token``, ``recorded_logratio_per_token``, ``action_match``, ``teacher_action_match``;
        a figure that is None (no tokens) is left unset."""
        self.validation_checkpoint.set(checkpoint)
        for cat, figures in by_category.items():
            for key, gauge, labels in (("reverse_kl_per_token", self.validation_reverse_kl, {}),
                                       ("recorded_logratio_per_token", self.validation_recorded_logratio, {}),
                                       ("action_match", self.validation_action_match, {"model": "student"}),
                                       ("teacher_action_match", self.validation_action_match, {"model": "teacher"})):
                value = figures.get(key)
                if value is not None:
                    gauge.labels(category=cat, **labels).set(value)

    def mark_success(self) -> None:
        self.last_success.set(time.time())

    # -- export ------------------------------------------------------------------------------------

    def grouping_key(self) -> dict[str, str]:
        """The Pushgateway group's labels besides ``job``: namespace (when set), release, instance (when set)."""
        return {**({"namespace": self.namespace} if self.namespace else {}), "release": self.release,
                **({"instance": self.instance} if self.instance else {})}

    @property
    def group(self) -> str:
        """The group's name within one release: the job, and the worker's instance when it has one."""
        return f"{self.job}-{self.instance}" if self.instance else self.job

    def exposition(self) -> str:
        """The registry in the Prometheus text format: what :meth:`push` sends, for :meth:`push_skip` later."""
        return generate_latest(self.registry).decode()

    def push(self) -> None:
        """Push the registry to the Pushgateway, when one is configured (a batch job's metrics): it replaces
        the job's group."""
        if self.pushgateway:
            push_to_gateway(self.pushgateway, job=self.job, registry=self.registry, grouping_key=self.grouping_key(),
                            timeout=10)

    def push_skip(self, committed: str | None) -> str:
        """The push of a stage that found its work committed (see the module docstring). ``committed``: the
        exposition text the run that did the work pushed, or None when there is none. Returns how it
        pushed: "restated" (the group replaced by ``committed`` with this process's own figures on top),
        "added" (only this process's own figures, the rest of the group left alone), or "" (no
        Pushgateway)."""
        if not self.pushgateway:
            return ""
        own = self._families_set()
        if committed is None:
            pushadd_to_gateway(self.pushgateway, job=self.job, registry=_Families(own),
                               grouping_key=self.grouping_key(), timeout=10)
            return "added"
        names = {f.name for f in own}
        kept = [f for f in text_string_to_metric_families(committed) if f.name not in names]
        push_to_gateway(self.pushgateway, job=self.job, registry=_Families(kept + own),
                        grouping_key=self.grouping_key(), timeout=10)
        return "restated"

    def _families_set(self) -> list[Metric]:
        """The families this process set: those with a labelled sample (a labelled family shows nothing
        until a value is recorded), and the success time once :meth:`mark_success` ran. An unlabelled
        family reads 0 whether set or not, so it counts as unset (restated from the committed figures)."""
        out = []
        for family in self.registry.collect():
            if family.name == "sapd_job_last_success_timestamp_seconds":
                if any(s.value for s in family.samples):
                    out.append(family)
            elif any(s.labels for s in family.samples if not s.name.endswith("_created")):
                out.append(family)
        return out

    def serve(self, port: int, addr: str = "0.0.0.0"):
        """Serve ``/metrics`` (rank 0 of a long training job). Returns (server, thread)."""
        return start_http_server(port, addr=addr, registry=self.registry)


class _Families:
    """A collector of given metric families (what a registry of them exposes and pushes)."""

    def __init__(self, families: Iterable[Metric]) -> None:
        self.families = list(families)

    def collect(self) -> Iterable[Metric]:
        return self.families


def release_groups(gateway: str, namespace: str, release: str, timeout: float = 10) -> list[dict[str, str]]:
    """The grouping labels (``job`` included) of every group a release pushed to ``gateway``: those whose
    ``release`` and ``namespace`` labels are these (``namespace`` "": groups pushed without one)."""
    with urllib.request.urlopen(f"{gateway.rstrip('/')}/api/v1/metrics", timeout=timeout) as r:
        body = json.load(r)
    out = []
    for group in body.get("data") or []:
        labels = dict(group.get("labels") or {})
        if labels.get("release") == release and labels.get("namespace", "") == namespace:
            out.append(labels)
    return sorted(out, key=lambda g: sorted(g.items()))


def delete_release_groups(gateway: str, namespace: str, release: str, timeout: float = 10) -> list[dict[str, str]]:
    """Delete every group of a release from ``gateway`` (:func:`release_groups`); returns their labels."""
    groups = release_groups(gateway, namespace, release, timeout)
    for labels in groups:
        key = {k: v for k, v in labels.items() if k != "job"}
        delete_from_gateway(gateway, job=labels["job"], grouping_key=key, timeout=timeout)
    return groups
