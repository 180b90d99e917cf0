"""Reading the views the projector writes; they answer list_trial_jobs, get_trial_job and the API's pages.

Pages and streams read the views in chunks through the order and ranking indexes the projector keeps
with them, so listing 100,000 trials holds one chunk in memory, never the whole experiment.
"""

from __future__ import annotations

from collections.abc import Iterator
from itertools import islice
from typing import Any, Literal

import redis

from core.keys import LOG_PREFIX, ViewKeys
from schemas.compact import metric_record
from schemas.trial import ExperimentView, MetricRecord, TrialJobDetail

CHUNK = 500
TrialOrder = Literal["sequence", "metric"]


class ViewStore:
    def __init__(self, client: redis.Redis, experiment_id: str, namespace: str = LOG_PREFIX) -> None:
        self.client = client
        self.keys = ViewKeys(experiment_id, namespace)

    def position(self) -> str:
        """Id of the last event folded into these views (0-0 before the first)."""
        return str(self.client.hget(self.keys.position, "position") or "0-0")

    def trial(self, trial_id: str) -> TrialJobDetail | None:
        raw = self.client.hget(self.keys.trials, trial_id)
        return TrialJobDetail.model_validate_json(raw) if raw else None

    def trials(self) -> list[TrialJobDetail]:
        views = [TrialJobDetail.model_validate_json(raw) for raw in self.client.hvals(self.keys.trials)]
        return sorted(views, key=lambda view: view.sequence_id)

    def experiment(self) -> ExperimentView | None:
        raw = self.client.hget(self.keys.experiment, "view")
        return ExperimentView.model_validate_json(raw) if raw else None

    def metrics(self, trial_id: str) -> list[MetricRecord]:
        return [MetricRecord.model_validate(record) for record in self.metric_records([trial_id])[trial_id]]

    def metric_records(self, trial_ids: list[str]) -> dict[str, list[dict[str, Any]]]:
        """Each trial's metric records (MetricRecord's JSON objects, from their compact form), in one round trip."""
        with self.client.pipeline(transaction=False) as pipe:
            for trial_id in trial_ids:
                pipe.lrange(self.keys.metrics(trial_id), 0, -1)
            stored = pipe.execute()
        return {
            trial_id: [metric_record(raw, trial_id) for raw in records]
            for trial_id, records in zip(trial_ids, stored, strict=True)
        }

    def unreadable(self) -> dict[str, str]:
        raw: Any = self.client.hgetall(self.keys.unreadable)
        return dict(raw)

    def counts(self) -> dict[str, int]:
        """Trials by status, and attempts `lost` and `retried`, as projected."""
        raw: Any = self.client.hgetall(self.keys.counts)
        return {name: int(count) for name, count in raw.items() if int(count)}

    def total(self) -> int:
        return int(self.client.zcard(self.keys.order))

    def trial_ids(self, order: TrialOrder = "sequence", best_first_high: bool = True) -> Iterator[str]:
        """Every trial id, chunk by chunk: by sequence id, or by final metric (best first, in the
        direction given; trials without a numeric result after them, by sequence id)."""
        if order == "sequence":
            yield from self._index(self.keys.order, descending=False)
            return
        yield from self._index(self.keys.ranking, descending=best_first_high)
        for chunk in _chunks(self._index(self.keys.order, descending=False)):
            ranked = self.client.zmscore(self.keys.ranking, chunk)
            yield from (trial_id for trial_id, score in zip(chunk, ranked, strict=True) if score is None)

    def iter_trials(
        self, order: TrialOrder = "sequence", best_first_high: bool = True, status: str | None = None
    ) -> Iterator[TrialJobDetail]:
        """Every trial view in `order`, optionally only those in `status`, read a chunk at a time."""
        for chunk in _chunks(self.trial_ids(order, best_first_high)):
            for raw in self.client.hmget(self.keys.trials, chunk):
                if raw is None:
                    continue
                if status is not None and f'"status":"{status}"' not in raw:  # most views skip parsing
                    continue
                trial = TrialJobDetail.model_validate_json(raw)
                if status is None or trial.status == status:
                    yield trial

    def page(
        self,
        offset: int,
        limit: int,
        order: TrialOrder = "sequence",
        best_first_high: bool = True,
        status: str | None = None,
    ) -> list[TrialJobDetail]:
        if status is None:  # straight to the page through the index
            if order == "sequence":
                ids = [str(trial_id) for trial_id in self.client.zrange(self.keys.order, offset, offset + limit - 1)]
            else:
                ids = list(islice(self.trial_ids(order, best_first_high), offset, offset + limit))
            raws = self.client.hmget(self.keys.trials, ids) if ids else []
            return [TrialJobDetail.model_validate_json(raw) for raw in raws if raw]
        return list(islice(self.iter_trials(order, best_first_high, status), offset, offset + limit))

    def _index(self, key: str, descending: bool) -> Iterator[str]:
        start = 0
        while True:
            if descending:
                chunk = self.client.zrevrange(key, start, start + CHUNK - 1)
            else:
                chunk = self.client.zrange(key, start, start + CHUNK - 1)
            yield from (str(member) for member in chunk)
            if len(chunk) < CHUNK:
                return
            start += CHUNK


def _chunks(ids: Iterator[str]) -> Iterator[list[str]]:
    while chunk := list(islice(ids, CHUNK)):
        yield chunk
