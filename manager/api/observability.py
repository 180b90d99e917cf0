"""`GET /metrics`: trialstream's state for Prometheus, computed from Redis when scraped.

Nothing is counted in this process: each scrape reads what the projector keeps (the per-experiment
counts hash, O(1) per experiment, never the trial views), the streams' own metadata, and RQ's queues
and workers, in a few pipelined round trips. So every manager serving one Redis reports the same
numbers, and a restart loses none.

Label cardinality stays bounded: totals are labelled by platform and status only; the `experiment`
label appears only on series of RUNNING experiments (a few at a time), so finished experiments,
however many, add no series. Rates (events per second) are left to PromQL: `rate(
trialstream_events_appended_total[1m])`, rather than measured between scrapes here, which would
depend on who scrapes and how often.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import redis
from fastapi import APIRouter, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from rq import Queue, Worker

from core import keys
from core.queueing import SERIALIZER, queue_name
from manager.host import ManagerHost
from schemas.events import PLATFORM_CONFIG
from schemas.trial import ExperimentView, TrialJobStatus

LAG_CAP = 10_000  # events counted past the projection position at most, so a scrape stays cheap
QUEUE_PREFIX = queue_name("")
EXPERIMENT_STATUSES = ("RUNNING", "DONE", "ERROR", "STOPPED")
UNKNOWN_PLATFORM = "unknown"


@dataclass(frozen=True)
class _Experiment:
    """What one scrape reads of one experiment."""

    id: str
    status: str
    platform: str
    counts: dict[str, int]
    position: str
    last_id: str | None  # the stream's last entry id; None when it has no stream
    appended: int  # entries ever added to its stream


class TrialstreamCollector(Collector):
    """Every trialstream metric, read from Redis at each scrape."""

    def __init__(self, client: redis.Redis, rq_connection: redis.Redis, lag_cap: int = LAG_CAP) -> None:
        self.client = client
        self.rq_connection = rq_connection
        self.lag_cap = lag_cap

    def collect(self) -> Iterator[Metric]:
        experiments = self._experiments()
        yield from self._trials(experiments)
        yield from self._experiment_metrics(experiments)
        yield from self._projection(experiments)
        yield from self._queues()
        yield self._replication()

    def _experiments(self) -> list[_Experiment]:
        """Each experiment's view, counts, position and stream info, in one pipelined round trip."""
        ids = [str(experiment_id) for experiment_id in self.client.zrange(keys.EXPERIMENTS, 0, -1)]
        with self.client.pipeline(transaction=False) as pipe:
            for experiment_id in ids:
                view_keys = keys.ViewKeys(experiment_id)
                pipe.hget(view_keys.experiment, "view")
                pipe.hgetall(view_keys.counts)
                pipe.hget(view_keys.position, "position")
                pipe.xinfo_stream(keys.events(experiment_id))
            replies: list[Any] = pipe.execute(raise_on_error=False)
        experiments = []
        for index, experiment_id in enumerate(ids):
            raw_view, counts, position, stream = replies[4 * index : 4 * index + 4]
            view = ExperimentView.model_validate_json(raw_view) if raw_view else None
            has_stream = isinstance(stream, dict)  # an error reply when the experiment has no stream (yet)
            experiments.append(
                _Experiment(
                    id=experiment_id,
                    status=view.status if view is not None else "RUNNING",  # created, not projected yet
                    platform=_platform_of(view),
                    counts={name: int(count) for name, count in counts.items()},
                    position=str(position or "0-0"),
                    last_id=str(stream["last-generated-id"]) if has_stream else None,
                    appended=int(stream.get("entries-added", stream["length"])) if has_stream else 0,
                )
            )
        return experiments

    def _trials(self, experiments: list[_Experiment]) -> Iterable[Metric]:
        totals = GaugeMetricFamily(
            "trialstream_trials",
            "Trials by status over every experiment, by the experiment's platform (the projected counts).",
            labels=["platform", "status"],
        )
        running = GaugeMetricFamily(
            "trialstream_running_experiment_trials",
            "Trials by status of each RUNNING experiment (finished experiments are only in trialstream_trials).",
            labels=["experiment", "platform", "status"],
        )
        lost = CounterMetricFamily(
            "trialstream_attempts_lost", "Trial attempts declared lost with their worker.", labels=["platform"]
        )
        retried = CounterMetricFamily(
            "trialstream_attempts_retried",
            "Lost trial attempts retried as a new attempt (maxTrialRetries).",
            labels=["platform"],
        )
        by_platform: dict[str, Counter[str]] = {}
        for experiment in experiments:
            by_platform.setdefault(experiment.platform, Counter()).update(experiment.counts)
            if experiment.status == "RUNNING":
                for status in TrialJobStatus:
                    running.add_metric(
                        [experiment.id, experiment.platform, status.value], experiment.counts.get(status.value, 0)
                    )
        for platform, counts in sorted(by_platform.items()):
            for status in TrialJobStatus:
                totals.add_metric([platform, status.value], counts[status.value])
            lost.add_metric([platform], counts["lost"])
            retried.add_metric([platform], counts["retried"])
        return totals, running, lost, retried

    def _experiment_metrics(self, experiments: list[_Experiment]) -> Iterable[Metric]:
        by_status = Counter(experiment.status for experiment in experiments)
        family = GaugeMetricFamily("trialstream_experiments", "Experiments by status.", labels=["status"])
        for status in EXPERIMENT_STATUSES:
            family.add_metric([status], by_status[status])
        appended = CounterMetricFamily(
            "trialstream_events_appended",
            "Events appended to the experiments' logs (their streams' entries-added, summed; an experiment "
            "deleted takes its events out, which Prometheus reads as a counter reset).",
            value=sum(experiment.appended for experiment in experiments),
        )
        return family, appended

    def _projection(self, experiments: list[_Experiment]) -> Iterable[Metric]:
        behind = [experiment for experiment in experiments if experiment.last_id not in (None, experiment.position)]
        lag = GaugeMetricFamily(
            "trialstream_projection_lag_events",
            f"Events of each RUNNING experiment's log not yet in its views, counted up to {self.lag_cap}: "
            f"{self.lag_cap} means at least that many.",
            labels=["experiment"],
        )
        lagging = [experiment for experiment in behind if experiment.status == "RUNNING"]
        with self.client.pipeline(transaction=False) as pipe:
            for experiment in lagging:
                pipe.xrange(keys.events(experiment.id), f"({experiment.position}", "+", count=self.lag_cap)
            unprojected = dict(zip((experiment.id for experiment in lagging), pipe.execute(), strict=True))
        for experiment in experiments:
            if experiment.status == "RUNNING":
                lag.add_metric([experiment.id], len(unprojected.get(experiment.id, [])))
        count = GaugeMetricFamily(
            "trialstream_projection_behind_experiments",
            "Experiments, of any status, whose views have not reached the end of their log.",
            value=len(behind),
        )
        alive = GaugeMetricFamily(
            "trialstream_projector_up",
            "1 while a projector's heartbeat is in Redis.",
            value=int(bool(self.client.exists(keys.PROJECTOR_HEARTBEAT))),
        )
        return lag, count, alive

    def _queues(self) -> Iterable[Metric]:
        depth = GaugeMetricFamily(
            "trialstream_queue_depth", "Jobs waiting in the platform's RQ queue.", labels=["platform"]
        )
        workers = GaugeMetricFamily(
            "trialstream_workers",
            "Workers registered on the platform's RQ queue (a killed worker stays listed until its RQ key "
            "expires: the worker TTL, 420 s by default; trials are safe sooner, by their leases).",
            labels=["platform"],
        )
        for queue in Queue.all(connection=self.rq_connection, serializer=SERIALIZER):
            if queue.name.startswith(QUEUE_PREFIX):
                platform = queue.name.removeprefix(QUEUE_PREFIX)
                depth.add_metric([platform], queue.count)
                workers.add_metric([platform], len(Worker.all(queue=queue)))
        return depth, workers

    def _replication(self) -> Metric:
        """Appends refused because too few replicas confirmed them in time (core.replication.ReplicaAcks): each
        was sent again, or its error reached its caller; never acknowledged unreplicated."""
        timeouts = CounterMetricFamily(
            "trialstream_redis_replication_timeouts",
            "Appends whose WAIT saw fewer replicas than required within the timeout (refused, sent again).",
        )
        timeouts.add_metric([], int(self.client.get(keys.REPLICATION_TIMEOUTS) or 0))
        return timeouts


def _platform_of(view: ExperimentView | None) -> str:
    """The platform in the experiment's config; else in its cluster metadata (an experiment driven
    through NNI's TrainingService interface sets it there)."""
    if view is None:
        return UNKNOWN_PLATFORM
    section = view.config.get("trainingService")
    if isinstance(section, list) and len(section) > 1:
        return "hybrid"  # as NNI names such an experiment's platform; its trials are on the listed ones
    if isinstance(section, dict) and isinstance(section.get("platform"), str):
        return str(section["platform"])
    metadata = json.loads(view.metadata.get(PLATFORM_CONFIG, "{}"))
    platform = metadata.get("platform") if isinstance(metadata, dict) else None
    return platform if isinstance(platform, str) else UNKNOWN_PLATFORM


def router(host: ManagerHost) -> APIRouter:
    """`GET /metrics`, behind the app's token guard like every route but the health check."""
    registry = CollectorRegistry()
    registry.register(TrialstreamCollector(host.client, host.rq_connection))
    metrics = APIRouter()

    @metrics.get("/metrics", response_class=Response)
    def scrape() -> Response:
        """The Prometheus text exposition of trialstream's metrics."""
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    return metrics
