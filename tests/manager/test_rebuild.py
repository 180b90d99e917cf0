"""Rebuilding the live views while a real projector folds the same, growing experiment."""

from __future__ import annotations

import threading

import redis

from core.event_store import EventStore, stream_position
from manager.projector import Projector
from manager.replay import SCRATCH_PREFIX, check
from manager.training_service import TrainingService
from manager.views import ViewStore
from tests.conftest import Processes, ServiceFactory, form, metric, wait_until

REBUILDS = 5
NEWEST = 10  # trials reported to each round, beside the first


def keep_reporting(service: TrainingService, trial_ids: list[str], stop: threading.Event) -> int:
    """Each round, a new trial and one metric to the first trial and the newest ones, until `stop`; returns the
    rounds appended.

    New trials keep giving the projector new metric lists to create while a rebuild runs. The log grows by the
    same few entries a round (not by every trial's), so a rebuild that folds it from the start catches up with
    it however slow the machine: a log growing faster than any fold never lets a rebuild end.
    """
    store: EventStore = service.store
    rounds = 0
    while not stop.is_set():
        trial_ids.append(service.submit_trial_job(form(len(trial_ids), x=len(trial_ids))).id)
        store.append_all([metric(store.experiment_id, trial_id, rounds) for trial_id in trial_ids[1:][-NEWEST:]])
        store.append_all([metric(store.experiment_id, trial_ids[0], rounds)])
        rounds += 1
        stop.wait(0.01)
    return rounds


def watch_views(views: ViewStore, trial_id: str, stop: threading.Event, seen: list[str]) -> None:
    """Record every time a reader sees the views go back: an older position, or a shorter metric list."""
    position, length = (0, 0), 0
    while not stop.is_set():
        with views.client.pipeline() as pipe:  # one MULTI: both read at the same point
            pipe.hget(views.keys.position, "position")
            pipe.llen(views.keys.metrics(trial_id))
            raw_position, now_length = pipe.execute()
        now_position = stream_position(raw_position or "0-0")
        if now_position < position or now_length < length:
            seen.append(f"position {position} -> {now_position}, metrics {length} -> {now_length}")
        position, length = max(position, now_position), max(length, now_length)


def test_a_rebuild_while_the_projector_folds_a_growing_log_loses_and_duplicates_nothing(
    make_service: ServiceFactory, processes: Processes, client: redis.Redis
) -> None:
    service = make_service()
    experiment_id = service.experiment_id
    projector = processes.projector()
    views = ViewStore(client, experiment_id)
    trial_ids = [service.submit_trial_job(form(0, x=0)).id]
    rounds: list[int] = []
    went_back: list[str] = []
    stop = threading.Event()
    threads = [
        threading.Thread(target=lambda: rounds.append(keep_reporting(service, trial_ids, stop))),
        threading.Thread(target=watch_views, args=(views, trial_ids[0], stop, went_back)),
    ]
    for thread in threads:
        thread.start()
    try:
        wait_until(lambda: views.metrics(trial_ids[0]), what="the projector to fold a first metric")
        for _ in range(REBUILDS):
            Projector(client).rebuild(experiment_id)
    finally:
        stop.set()
        for thread in threads:
            thread.join()

    wait_until(lambda: views.position() == service.store.head(), what="the projector to catch up")
    assert check(client, experiment_id) == []
    for trial_id in trial_ids:
        sequences = [record.sequence for record in views.metrics(trial_id)]
        assert sequences == sorted(set(sequences)), f"trial {trial_id}: duplicated or out of order"
    assert [record.sequence for record in views.metrics(trial_ids[0])] == list(range(rounds[0]))
    assert list(client.scan_iter(match=f"{SCRATCH_PREFIX}*")) == []
    assert went_back == [], "a reader saw the views go back during a rebuild"

    # still serving: a new metric is folded by the projector process
    service.store.append_all([metric(experiment_id, trial_ids[0], rounds[0])])
    wait_until(lambda: views.position() == service.store.head(), what="the projector to fold a new metric")
    assert [record.sequence for record in views.metrics(trial_ids[0])] == list(range(rounds[0] + 1))
    assert projector.poll() is None
