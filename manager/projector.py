"""The projector: folds each experiment's event log into its views.

How far it has read is written in the same MULTI/EXEC as the views it updates, under a WATCH of
that position: a restart resumes exactly where the last commit left off, and two projectors can
never apply the same event twice.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable
from typing import Any

import redis

from manager import keys
from manager.event_store import EventStore, StoredEvent, UnreadableEvent
from manager.keys import ViewKeys
from manager.projection import ExperimentView, apply_to_experiment, apply_to_trial, metric_record
from schemas.events import TrialEvent, TrialMetricReported
from schemas.trial import MetricRecord, TrialJobDetail

log = logging.getLogger(__name__)

HEARTBEAT_TTL_S = 5


class Projector:
    def __init__(self, client: redis.Redis, namespace: str = keys.LOG_PREFIX, batch_size: int = 2000) -> None:
        self.client = client
        self.namespace = namespace
        self.batch_size = batch_size

    def catch_up(self, experiment_id: str, until: str = "+") -> str:
        """Apply every event up to `until`; returns the position reached."""
        while True:
            position, applied = self._apply_batch(experiment_id, until)
            if not applied:
                return position

    def rebuild(self, experiment_id: str, until: str = "+") -> str:
        """Throw this namespace's views of the experiment away and fold the log again."""
        view_keys = ViewKeys(experiment_id, self.namespace)
        stale = list(self.client.scan_iter(match=view_keys.pattern, count=1000))
        if stale:
            self.client.delete(*stale)
        return self.catch_up(experiment_id, until)

    def run(self, stop: threading.Event, block_ms: int = 500) -> None:
        """Serve every experiment until `stop` is set, waking as soon as an event is appended."""
        positions: dict[str, str] = {}
        while not stop.is_set():
            self.client.set(keys.PROJECTOR_HEARTBEAT, "1", ex=HEARTBEAT_TTL_S)
            experiment_ids: Any = self.client.zrange(keys.EXPERIMENTS, 0, -1)
            for experiment_id in experiment_ids:
                positions[experiment_id] = self.catch_up(experiment_id)
            if not positions:
                stop.wait(block_ms / 1000)
                continue
            streams: Any = {keys.events(experiment_id): position for experiment_id, position in positions.items()}
            self.client.xread(streams, count=1, block=block_ms)  # a wake-up only; catch_up reads

    def _apply_batch(self, experiment_id: str, until: str) -> tuple[str, int]:
        view_keys = ViewKeys(experiment_id, self.namespace)
        store = EventStore(self.client, experiment_id)
        with self.client.pipeline() as pipe:
            while True:
                try:
                    pipe.watch(view_keys.position)
                    position = str(pipe.hget(view_keys.position, "position") or "0-0")
                    entries = store.read(after=position, until=until, count=self.batch_size)
                    if not entries:
                        pipe.unwatch()
                        return position, 0
                    self._write_batch(pipe, view_keys, entries)
                    pipe.execute()
                    return entries[-1].id, len(entries)
                except redis.WatchError:
                    log.debug("another projector advanced %s; re-reading", experiment_id)

    def _write_batch(self, pipe: redis.client.Pipeline, view_keys: ViewKeys, entries: list) -> None:
        """Fold `entries` in memory, then queue every write and the new position in one MULTI."""
        stored = [entry for entry in entries if isinstance(entry, StoredEvent)]
        trial_ids = sorted({entry.event.trial_id for entry in stored if isinstance(entry.event, TrialEvent)})
        trials = self._load_trials(pipe, view_keys, trial_ids)
        raw_experiment = pipe.hget(view_keys.experiment, "view")
        experiment = ExperimentView.model_validate_json(raw_experiment) if raw_experiment else None
        experiment_changed = False
        new_metrics = self._new_metrics(pipe, view_keys, stored)

        for entry in stored:
            event = entry.event
            if isinstance(event, TrialEvent):
                trials[event.trial_id] = apply_to_trial(trials.get(event.trial_id), event)
            else:
                experiment = apply_to_experiment(experiment, event)
                experiment_changed = True

        pipe.multi()
        changed: Any = {trial_id: view.to_json() for trial_id, view in trials.items() if view is not None}
        if changed:
            pipe.hset(view_keys.trials, mapping=changed)
        if experiment is not None and experiment_changed:
            pipe.hset(view_keys.experiment, "view", experiment.to_json())
        for dedup_key, record in new_metrics.items():
            pipe.sadd(view_keys.metric_keys, dedup_key)
            pipe.rpush(view_keys.metrics(record.trial_job_id), record.to_json())
        for entry in entries:
            if isinstance(entry, UnreadableEvent):
                log.warning("skipping unreadable event %s: %s", entry.id, entry.error)
                pipe.hset(view_keys.unreadable, entry.id, entry.error)
        pipe.hset(view_keys.position, "position", entries[-1].id)
        pipe.hincrby(view_keys.position, "applied", len(entries))

    @staticmethod
    def _load_trials(
        pipe: redis.client.Pipeline, view_keys: ViewKeys, trial_ids: list[str]
    ) -> dict[str, TrialJobDetail | None]:
        if not trial_ids:
            return {}
        raws = pipe.hmget(view_keys.trials, trial_ids)
        return {
            trial_id: TrialJobDetail.model_validate_json(raw) if raw else None
            for trial_id, raw in zip(trial_ids, raws, strict=True)
        }

    @staticmethod
    def _new_metrics(pipe: redis.client.Pipeline, view_keys: ViewKeys, stored: Iterable[StoredEvent]) -> dict:
        """Metrics of this batch not projected before, keyed by their dedup key, in log order."""
        candidates: dict[str, MetricRecord] = {}
        for entry in stored:
            if isinstance(entry.event, TrialMetricReported):
                record = metric_record(entry.event)
                candidates.setdefault(f"{record.trial_job_id}|{record.dedup_key}", record)
        if not candidates:
            return {}
        seen = pipe.smismember(view_keys.metric_keys, list(candidates))
        return {key: record for (key, record), known in zip(candidates.items(), seen, strict=True) if not known}
