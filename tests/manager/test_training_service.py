"""The TrainingService interface on a real redis-server, with no worker unless a test starts one."""

from __future__ import annotations

import gc
import json
import threading
from typing import Any

import pytest
import redis
from pydantic import ValidationError
from rq import Queue

from core import keys
from core.event_store import AppendFenced, AppendRefused, ExperimentArchived, Fence
from core.leases import AttemptRef, Lease
from core.queueing import TrialJob, park, queue_name, trial_queue, wake_parked
from core.reaper import reap_lost_attempts
from manager import training_service
from manager.experiments import finish_experiment
from manager.projector import Projector
from manager.training_service import CHECKED_IDS, MissingClusterMetadata, TrainingService, TrialNotFound
from schemas.events import TrialMetricReported, TrialStarted
from schemas.trial import TrialJobDetail, TrialJobMetric, TrialJobStatus
from tests.conftest import ServiceFactory, form, wait_until


def test_get_straight_after_submit_reads_the_write(make_service: ServiceFactory) -> None:
    service = make_service()
    submitted = service.submit_trial_job(form(0, lr=0.1))
    trial = service.get_trial_job(submitted.id)  # no projector has run
    assert trial.status is TrialJobStatus.WAITING
    assert trial.form.hyper_parameters.parameters == {"lr": 0.1}
    assert trial.sequence_id == 0 and trial.working_directory.endswith(f"/trials/{submitted.id}")
    assert [t.id for t in service.list_trial_jobs()] == [submitted.id]


def test_reads_combine_projected_views_with_events_not_yet_projected(client: redis.Redis, make_service) -> None:
    service = make_service()
    first = service.submit_trial_job(form(0)).id
    Projector(client).catch_up(service.experiment_id)
    second = service.submit_trial_job(form(1)).id
    service.store.append(
        TrialStarted(experiment_id=service.experiment_id, trial_id=first, attempt=1, working_directory="/w")
    )
    statuses = {trial.id: trial.status for trial in service.list_trial_jobs()}
    assert statuses == {first: TrialJobStatus.RUNNING, second: TrialJobStatus.WAITING}


def test_submission_event_and_job_are_written_together(make_service, rq_connection: redis.Redis) -> None:
    service = make_service()
    trial = service.submit_trial_job(form(0))
    jobs = trial_queue("local", rq_connection).get_jobs()
    assert [job.args for job in jobs] == [[service.experiment_id, trial.id, 1]]  # JSON, never a pickle
    assert jobs[0].timeout == -1  # RQ's 180 s default must never kill a trial


def test_a_crash_before_commit_leaves_neither_event_nor_job(
    make_service, rq_connection: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    service = make_service()
    length_before = service.store.length()

    def crash(*args: object, **kwargs: object) -> None:
        raise RuntimeError("process died between append and enqueue")

    monkeypatch.setattr(Queue, "enqueue_call", crash)
    with pytest.raises(RuntimeError):
        service.submit_trial_job(form(0))
    assert service.store.length() == length_before
    assert Queue(queue_name("local"), connection=rq_connection).count == 0
    assert service.list_trial_jobs() == []


def test_trial_ids_are_checked_against_the_log_many_at_a_time(
    client: redis.Redis, rq_connection: redis.Redis, make_service: ServiceFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An id already in the log is never given again, and submissions do not each wait for a check of their own."""
    first = make_service()
    taken = first.submit_trial_job(form(0)).id
    service = TrainingService(client, rq_connection, first.experiment_id)  # none drawn yet
    drawn = iter([taken] * 5 + [f"id{index:03d}" for index in range(100)])
    monkeypatch.setattr(training_service, "_random_trial_id", lambda: next(drawn))
    client.config_resetstat()
    ids = [service.submit_trial_job(form(index + 1)).id for index in range(CHECKED_IDS)]
    calls: Any = client.info("commandstats")
    assert taken not in ids and len(set(ids)) == CHECKED_IDS
    assert calls["cmdstat_hmget"]["calls"] == 2  # the first draw held 11 free ids: drawn again for the 12th


def test_unknown_trial_is_a_clear_not_found(make_service: ServiceFactory) -> None:
    service = make_service()
    for call in (service.get_trial_job, service.cancel_trial_job, lambda tid: service.update_trial_job(tid, form(1))):
        with pytest.raises(TrialNotFound, match=f"trial 'nope!' not found in experiment {service.experiment_id}"):
            call("nope!")


def test_cancel_before_launch_ends_the_trial_at_once(make_service: ServiceFactory) -> None:
    service = make_service()
    canceled = service.submit_trial_job(form(0)).id
    stopped = service.submit_trial_job(form(1)).id
    service.cancel_trial_job(canceled)
    service.cancel_trial_job(stopped, is_early_stopped=True)
    assert service.get_trial_job(canceled).status is TrialJobStatus.USER_CANCELED
    early = service.get_trial_job(stopped)
    assert early.status is TrialJobStatus.EARLY_STOPPED and early.is_early_stopped
    length = service.store.length()
    service.cancel_trial_job(canceled)  # already ended: nothing more is written
    assert service.store.length() == length


def test_cluster_metadata_round_trips(make_service: ServiceFactory) -> None:
    service = make_service()
    service.set_cluster_metadata("custom", '{"a": 1}')
    assert service.get_cluster_metadata("custom") == '{"a": 1}'
    with pytest.raises(MissingClusterMetadata, match="'absent'"):
        service.get_cluster_metadata("absent")
    assert service.is_multi_phase_job_supported is True


def test_update_trial_job_replaces_the_form(make_service: ServiceFactory) -> None:
    service = make_service()
    trial_id = service.submit_trial_job(form(0, x=1)).id
    updated = service.update_trial_job(trial_id, form(0, x=2))
    assert updated.form.hyper_parameters.parameters == {"x": 2}


def test_metric_listeners_get_each_metric_once_until_removed(make_service: ServiceFactory) -> None:
    service = make_service()
    trial_id = service.submit_trial_job(form(0)).id
    received: list[TrialJobMetric] = []
    service.add_trial_job_metric_listener(received.append)
    loop = threading.Thread(target=service.run)
    loop.start()
    try:

        def report(sequence: int) -> None:
            service.store.append(
                TrialMetricReported(
                    experiment_id=service.experiment_id,
                    trial_id=trial_id,
                    attempt=1,
                    parameter_id="0",
                    metric_type="PERIODICAL",
                    sequence=sequence,
                    data='"0.5"',
                )
            )

        report(0)
        report(0)  # a redelivery
        report(1)
        wait_until(lambda: len(received) >= 2, 5, what="two metrics")
        service.remove_trial_job_metric_listener(received.append)
        report(2)
        service.clean_up()
    finally:
        service.clean_up()
        loop.join(5)
    assert received == [TrialJobMetric(id=trial_id, data='"0.5"')] * 2
    assert not loop.is_alive()


def test_clean_up_stops_every_unfinished_trial(make_service: ServiceFactory) -> None:
    service = make_service()
    waiting = service.submit_trial_job(form(0)).id
    service.clean_up()
    assert service.get_trial_job(waiting).status is TrialJobStatus.SYS_CANCELED


def test_views_parsed_before_are_reused_only_while_unchanged(client: redis.Redis, make_service) -> None:
    service = make_service()
    first, second = (service.submit_trial_job(form(n)).id for n in range(2))
    projector = Projector(client)
    projector.catch_up(service.experiment_id)
    listed = service.list_trial_jobs()
    assert service.list_trial_jobs()[0] is listed[0]  # unchanged JSON: the view parsed before
    service.store.append(
        TrialStarted(experiment_id=service.experiment_id, trial_id=first, attempt=1, working_directory="/w")
    )
    projector.catch_up(service.experiment_id)
    again = {trial.id: trial for trial in service.list_trial_jobs()}
    assert again[first].status is TrialJobStatus.RUNNING and again[second] is listed[1]
    assert [trial.status for trial in service.get_trial_jobs([second, first])] == [
        TrialJobStatus.WAITING,
        TrialJobStatus.RUNNING,
    ]
    with pytest.raises(TrialNotFound, match="nope"):
        service.get_trial_jobs([first, "nope"])


@pytest.mark.parametrize("views_per_parse", [1, training_service.VIEWS_PER_PARSE])
def test_a_list_reads_views_of_every_form_and_still_validates_them(
    client: redis.Redis, make_service, monkeypatch: pytest.MonkeyPatch, views_per_parse: int
) -> None:
    """Views are parsed several at a time with the collector paused: each reads as it would alone, in order across
    the parses, views written before the optional fields existed included, and one invalid view still fails the
    list."""
    monkeypatch.setattr(training_service, "VIEWS_PER_PARSE", views_per_parse)
    service = make_service()
    first, second = (service.submit_trial_job(form(n)).id for n in range(2))
    Projector(client).catch_up(service.experiment_id)
    current = client.hget(service.views.keys.trials, second)
    assert isinstance(current, str)
    old = {
        "id": first,
        "status": "SUCCEEDED",
        "submitTime": 1,
        "workingDirectory": "/w",
        "form": {"sequenceId": 0, "hyperParameters": {"value": "{}"}},
        "sequenceId": 0,
        "experimentId": service.experiment_id,
        "platform": "local",
    }
    client.hset(service.views.keys.trials, first, json.dumps(old))
    listed = service.list_trial_jobs()
    assert listed == [TrialJobDetail.model_validate(old), TrialJobDetail.model_validate_json(current)]
    assert listed[0].attempt == 1 and listed[0].final_metric_data == [] and listed[0].worker is None
    assert gc.isenabled() and gc.get_freeze_count() == 0
    client.hset(service.views.keys.trials, first, json.dumps({**old, "status": "NOT_A_STATUS"}))
    with pytest.raises(ValidationError):
        service.list_trial_jobs()
    assert gc.isenabled() and gc.get_freeze_count() == 0
    gc.disable()
    try:
        assert [trial.id for trial in service.get_trial_jobs([second])] == [second]
        assert not gc.isenabled()  # a caller's own setting is left as it was
    finally:
        gc.enable()


def _refuse_appends(client: redis.Redis, service: TrainingService, refusal: type[AppendRefused]) -> None:
    """From now on the experiment's log refuses the service's appends: its experiment archived, or its fence moved
    on (another runner took the claim of the runner whose epoch fences the service)."""
    epoch = keys.runner_epoch(service.experiment_id)
    if refusal is ExperimentArchived:
        client.hset(keys.ARCHIVED, service.experiment_id, "{}")
    else:
        service.store.fence = Fence(epoch, "1")
        client.set(epoch, 2)


@pytest.mark.parametrize("refusal", [ExperimentArchived, AppendFenced])
def test_a_refused_submission_or_requeue_leaves_no_job(
    client: redis.Redis, rq_connection: redis.Redis, make_service: ServiceFactory, refusal: type[AppendRefused]
) -> None:
    """Redis runs the rest of a MULTI past a script's error: the jobs queued with a refused record are withdrawn."""
    service = make_service()
    waiting = service.submit_trial_job(form(0))
    trial_queue("local", rq_connection).empty()  # as if a worker had taken it: only what comes next is queued
    submission = service.submission(form(1))
    log_before = service.store.read()
    _refuse_appends(client, service, refusal)

    with pytest.raises(refusal):
        service.submit(submission)
    with pytest.raises(refusal):
        service.requeue(waiting, "its job was lost")
    with pytest.raises(refusal):
        finish_experiment(client, rq_connection, service.experiment_id, "local", "DONE", fence=service.store.fence)

    assert service.store.read() == log_before
    assert trial_queue("local", rq_connection).count == 0
    assert list(rq_connection.scan_iter("rq:job:*")) == []  # nor any job's hash, which a worker could run


def test_the_workers_enqueues_withdraw_the_jobs_of_an_archived_experiment(
    client: redis.Redis, rq_connection: redis.Redis, make_service: ServiceFactory
) -> None:
    """A parked trial's wake-up and a lost attempt's retry go through the one enqueue path: archived meanwhile, they
    leave no job and nothing in the log, and the other parked trials are woken all the same."""
    archived, live = make_service(max_retries=1), make_service()
    parked = [archived.submit_trial_job(form(0)).id, live.submit_trial_job(form(0)).id]
    lost = archived.submit_trial_job(form(1)).id
    trial_queue("local", rq_connection).empty()  # as if workers had taken them: only what comes next is queued
    with client.pipeline(transaction=True) as pipe:
        for service, trial_id in zip((archived, live), parked, strict=True):
            park(pipe, TrialJob("local", service.experiment_id, trial_id, 1), 0)
        pipe.execute()
    lease = Lease(client, AttemptRef(archived.experiment_id, lost, 1), "gone:1", seconds=0.2)
    assert lease.acquire()
    log_before = archived.store.read()
    _refuse_appends(client, archived, ExperimentArchived)

    assert wake_parked(client, rq_connection, "local", "a trial ended", due_only=False) == 1
    assert [job.args[:2] for job in trial_queue("local", rq_connection).jobs] == [[live.experiment_id, parked[1]]]
    assert client.zcard(keys.parked("local")) == 0
    # The expired lease's retry is refused in the reaper's transaction, which ends the lease all the same.
    wait_until(
        lambda: (
            not reap_lost_attempts(client, rq_connection, "reaper", 0.2)
            and client.zscore(keys.LEASES, lease.ref.member) is None
        ),
        10,
        what="the reaper to end the archived experiment's lease",
    )
    assert archived.store.read() == log_before
    assert trial_queue("local", rq_connection).count == 1
    assert [key for key in rq_connection.scan_iter("rq:job:*") if archived.experiment_id.encode() in key] == []
