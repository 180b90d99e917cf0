"""The projector process killed (-9) and restarted while metrics pour in: nothing counted twice, nothing missed."""

from __future__ import annotations

import threading

import redis

from core.event_store import EventStore
from manager.views import ViewStore
from schemas.events import TrialEnded, TrialStarted
from schemas.trial import TrialJobStatus
from tests.conftest import Processes, ServiceFactory, form, metric, wait_until
from tests.faults.test_fault_redis import assert_each_metric_once, assert_views_match_rebuild

TRIALS = 4
BATCH = 25  # metrics per trial per append_all
PACE_S = 0.04  # between batches: ~2,000 events/s, as many busy workers would append
KILLS = 3
PROGRESS_BEFORE_KILL = 1500  # events a (re)started projector applies before it is killed


class Producer(threading.Thread):
    """What workers append: every trial's metrics, in small batches, until stopped; then FINAL and the end.

    One in ten metrics is appended without an idempotency key and each batch repeats its first
    metric: redeliveries that reach the log, which the projection must count once.
    """

    def __init__(self, store: EventStore, trial_ids: list[str]) -> None:
        super().__init__(name="producer")
        self.store = store
        self.trial_ids = trial_ids
        self.stop = threading.Event()
        self.sequences = 0
        self.failure: BaseException | None = None

    def run(self) -> None:
        exp = self.store.experiment_id
        try:
            for trial_id in self.trial_ids:
                self.store.append(TrialStarted(experiment_id=exp, trial_id=trial_id, attempt=1, working_directory="/w"))
            while not self.stop.wait(PACE_S):
                events, idempotency_keys = [], []
                for trial_id in self.trial_ids:
                    for sequence in range(self.sequences, self.sequences + BATCH):
                        events.append(metric(exp, trial_id, sequence))
                        idempotency_keys.append(None if sequence % 10 == 0 else f"metric:{trial_id}:{sequence}")
                    events.append(metric(exp, trial_id, self.sequences))
                    idempotency_keys.append(None)
                self.store.append_all(events, idempotency_keys)
                self.sequences += BATCH
            for trial_id in self.trial_ids:
                self.store.append(metric(exp, trial_id, 0, "FINAL"))
                ended = TrialEnded(
                    experiment_id=exp, trial_id=trial_id, attempt=1, status=TrialJobStatus.SUCCEEDED, exit_code=0
                )
                self.store.append(ended)
        except BaseException as error:
            self.failure = error
            raise


def applied(client: redis.Redis, views: ViewStore) -> int:
    return int(client.hget(views.keys.position, "applied") or 0)


def test_a_projector_killed_mid_stream_resumes_without_double_counting(
    client: redis.Redis, make_service: ServiceFactory, processes: Processes
) -> None:
    service = make_service()
    trial_ids = [service.submit_trial_job(form(index)).id for index in range(TRIALS)]  # no worker: nothing runs them
    views = ViewStore(client, service.experiment_id)
    producer = Producer(service.store, trial_ids)
    producer.start()
    try:
        projector = processes.projector()
        for kill in range(KILLS):
            # Killed while busy: metrics still arriving, the log ahead of the views, a batch likely in flight.
            target = applied(client, views) + PROGRESS_BEFORE_KILL

            def progressed(target: int = target) -> bool:
                return applied(client, views) >= target

            wait_until(progressed, 20, what=f"kill {kill}: progress")
            assert not producer.stop.is_set() and producer.is_alive()
            projector.kill()
            projector.wait()
            projector = processes.start("projector")  # the dead one's heartbeat outlives it: no waiting on that
        target = applied(client, views) + PROGRESS_BEFORE_KILL
        wait_until(lambda: applied(client, views) >= target, 20, what="the last projector's progress")
    finally:
        producer.stop.set()
        producer.join(20)
    assert producer.failure is None and not producer.is_alive()

    assert_views_match_rebuild(client, service.experiment_id)
    assert_each_metric_once(client, service.experiment_id)
    for trial_id in trial_ids:
        periodical = [m.sequence for m in views.metrics(trial_id) if m.type == "PERIODICAL"]
        assert periodical == list(range(producer.sequences)), trial_id
        trial = views.trial(trial_id)
        assert trial is not None and trial.status is TrialJobStatus.SUCCEEDED
        assert len(trial.final_metric_data) == 1
    assert applied(client, views) == service.store.length()  # every entry applied once, across four processes
    assert projector.poll() is None


def test_a_projector_killed_in_its_first_batches_resumes_from_its_last_commit(
    client: redis.Redis, make_service: ServiceFactory, processes: Processes
) -> None:
    service = make_service()
    trial_id = service.submit_trial_job(form(0)).id
    service.store.append_all([metric(service.experiment_id, trial_id, n) for n in range(5000)])
    projector = processes.projector()
    projector.kill()  # it heartbeats before its first batch: likely killed mid-way through the first ones
    projector.wait()
    processes.start("projector")
    assert_views_match_rebuild(client, service.experiment_id)
    assert [m.sequence for m in ViewStore(client, service.experiment_id).metrics(trial_id)] == list(range(5000))
