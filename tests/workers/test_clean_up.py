"""What a worker's clean-up after an experiment reads of it, on a real redis-server: the experiment's view and
the log past it, not the whole log (~100 entries a trial)."""

from __future__ import annotations

import secrets
from typing import Any

import pytest
import redis

from core.event_store import EventStore
from manager.projector import Projector
from schemas.events import PLATFORM_CONFIG, ClusterMetadataSet, ExperimentCreated, ExperimentFinished, ExperimentResumed
from tests.conftest import metric
from workers.runtime.job import _ended_experiment

LOCAL = '{"platform": "local"}'
ELSEWHERE = '{"platform": "local", "useActiveGpu": true}'


def scanned(store: EventStore, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the log entries each later read of `store` fetches."""
    counts: list[int] = []
    raw_range = store.raw_range

    def counted(*args: Any, **kwargs: Any) -> Any:
        entries = raw_range(*args, **kwargs)
        counts.append(len(entries))
        return entries

    monkeypatch.setattr(store, "raw_range", counted)
    return counts


def test_clean_up_reads_the_view_and_the_log_past_it(client: redis.Redis, monkeypatch: pytest.MonkeyPatch) -> None:
    experiment_id = f"clean{secrets.token_hex(4)}"
    store = EventStore(client, experiment_id)
    store.append(ExperimentCreated(experiment_id=experiment_id, config={}, working_directory="/w"))
    store.append(ClusterMetadataSet(experiment_id=experiment_id, key=PLATFORM_CONFIG, value=LOCAL))
    for sequence in range(50):
        store.append(metric(experiment_id, "t0001", sequence))
    store.append(ExperimentFinished(experiment_id=experiment_id, status="DONE"))
    counts = scanned(store, monkeypatch)

    assert _ended_experiment(store) == (False, LOCAL)  # no view kept: the whole log
    assert sum(counts) == 53

    Projector(client).catch_up(experiment_id)
    counts.clear()
    assert _ended_experiment(store) == (False, LOCAL)
    assert sum(counts) == 0  # the view is up to date: nothing of the log

    store.append(ExperimentResumed(experiment_id=experiment_id))
    store.append(ClusterMetadataSet(experiment_id=experiment_id, key=PLATFORM_CONFIG, value=ELSEWHERE))
    counts.clear()
    assert _ended_experiment(store) == (True, ELSEWHERE)  # the view lags: what came after it counts
    assert sum(counts) == 2

    Projector(client).catch_up(experiment_id)
    assert _ended_experiment(store) == (True, ELSEWHERE)
    store.append(ExperimentFinished(experiment_id=experiment_id, status="DONE"))
    assert _ended_experiment(store) == (False, ELSEWHERE)


def test_a_clean_up_of_an_experiment_that_never_finished_finds_it_running(client: redis.Redis) -> None:
    """A clean-up job queued with an ExperimentFinished the log refused (a superseded runner's: the MULTI ran on
    past the refusal), taken by a worker before it was withdrawn: no view kept, no end in the log, nothing cleaned."""
    experiment_id = f"clean{secrets.token_hex(4)}"
    store = EventStore(client, experiment_id)
    store.append(ExperimentCreated(experiment_id=experiment_id, config={}, working_directory="/w"))
    store.append(ClusterMetadataSet(experiment_id=experiment_id, key=PLATFORM_CONFIG, value=LOCAL))
    assert _ended_experiment(store) == (True, LOCAL)
