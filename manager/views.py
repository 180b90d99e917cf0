"""Reading the views the projector writes; they answer list_trial_jobs and get_trial_job."""

from __future__ import annotations

from typing import Any

import redis

from core.keys import LOG_PREFIX, ViewKeys
from manager.projection import ExperimentView
from schemas.trial import MetricRecord, TrialJobDetail


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
        return [MetricRecord.model_validate_json(raw) for raw in self.client.lrange(self.keys.metrics(trial_id), 0, -1)]

    def unreadable(self) -> dict[str, str]:
        raw: Any = self.client.hgetall(self.keys.unreadable)
        return dict(raw)
