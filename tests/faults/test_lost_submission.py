"""A submission the log lost after acknowledging it: the write a deposed master took and a replica confirmed,
both then resynced from the new master (docs/reliability.md, the Sentinel failover test). The runner sends it
again, and the experiment ends; a re-queued job alone would find no submission to run, again and again."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import TypeVar

import redis

from core import keys
from core.event_store import EventStore, StoredEvent
from core.queueing import submission_key, trial_queue
from manager.config import load_experiment_config
from manager.runner import ExperimentResult, ExperimentRunner
from schemas.events import Event, TrialRequeued, TrialSubmitted
from tests.conftest import Processes, wait_until
from tests.support.configs import write_config

E = TypeVar("E", bound=Event)


def logged(store: EventStore, kind: type[E]) -> list[tuple[str, E]]:
    """(entry id, event) of each `kind` event in the log."""
    return [
        (entry.id, entry.event)
        for entry in store.read()
        if isinstance(entry, StoredEvent) and isinstance(entry.event, kind)
    ]


def test_a_submission_the_log_lost_is_sent_again(
    tmp_path: Path, processes: Processes, client: redis.Redis, rq_connection: redis.Redis
) -> None:
    config = write_config(
        tmp_path,
        {"platform": "local"},
        {"x": {"_type": "uniform", "_value": [0, 1]}},
        trialCommand="true",
        tuner={"name": "Random", "classArgs": {"seed": 7}},
    )
    runner = ExperimentRunner.create(load_experiment_config(config), client, rq_connection)
    store = runner.service.store
    results: list[ExperimentResult] = []
    thread = threading.Thread(target=lambda: results.append(runner.run()), daemon=True)
    thread.start()
    try:
        [(entry_id, submitted)] = wait_until(lambda: logged(store, TrialSubmitted), 30, what="the trial's submission")
        trial_id = submitted.trial_id
        # the transaction that wrote it, lost whole: its entry, its idempotency key and its job (no worker yet)
        client.xdel(keys.events(runner.experiment_id), entry_id)
        client.hdel(keys.idempotency(runner.experiment_id), submission_key(trial_id))
        trial_queue("local", rq_connection).empty()

        processes.worker()
        thread.join(60)
        assert not thread.is_alive(), "the experiment did not end"
    finally:
        runner.detach()
    [result] = results
    assert [(trial.id, trial.status.value) for trial in result.trials] == [(trial_id, "SUCCEEDED")]
    assert [event.trial_id for _, event in logged(store, TrialSubmitted)] == [trial_id]
    assert logged(store, TrialRequeued) == []  # sent again, not re-queued without it
