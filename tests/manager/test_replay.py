"""Replaying the log into scratch views, and comparing views: on a real redis-server with real trials."""

from __future__ import annotations

import sys
import textwrap
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import cast

import pytest
import redis
from redis.typing import EncodableT, FieldT
from rq import Queue

from core import keys
from core.event_store import EventStore, StoredEvent
from core.queueing import queue_name
from manager.experiments import finish_experiment
from manager.projector import Projector
from manager.replay import (
    SCRATCH_PREFIX,
    InvalidPosition,
    UnknownEventType,
    check,
    diff_views,
    parse_position,
    parse_types,
    read_log,
    replay_check,
    replayed,
    snapshot_views,
)
from manager.training_service import TrainingService
from manager.views import ViewStore
from schemas.trial import TrialJobStatus
from tests.conftest import Processes, ServiceFactory, form, stream_entries, wait_for_status, wait_until

MIXED_TRIAL = """
import sys, time, trialstream_sdk as nni
x = nni.get_next_parameter()["x"]
if x == 2:
    sys.exit(3)
if x == 3:
    time.sleep(60)
nni.report_intermediate_result(x / 2)
nni.report_final_result(x * 10)
"""
TERMINAL = [str(status) for status in TrialJobStatus if status.is_terminal]


@dataclass(frozen=True)
class Mixed:
    """An experiment that ran to its end: x=1 succeeded, x=2 failed, x=3 canceled running, x=4 canceled waiting."""

    service: TrainingService
    trials: dict[int, str]

    @property
    def experiment_id(self) -> str:
        return self.service.experiment_id


def start_mixed_experiment(make_service: ServiceFactory, processes: Processes, code_dir: Path) -> Mixed:
    """Submit the trials to one worker and return once x=3 runs (x=1 and x=2 are over by then)."""
    (code_dir / "trial.py").write_text(textwrap.dedent(MIXED_TRIAL))
    service = make_service(f"{sys.executable} trial.py")
    processes.projector()
    processes.worker()
    trials = {x: service.submit_trial_job(form(x - 1, x=x)).id for x in (1, 2, 3)}
    wait_for_status(service, trials[3], "RUNNING")
    return Mixed(service, trials)


def finish_mixed_experiment(mixed: Mixed, rq_connection: redis.Redis) -> None:
    """Cancel x=3 and a queued x=4, then wait until every job is done and the projector has applied everything."""
    service = mixed.service
    mixed.trials[4] = service.submit_trial_job(form(3, x=4)).id
    service.cancel_trial_job(mixed.trials[4])  # WAITING: the only worker is busy with x=3
    service.cancel_trial_job(mixed.trials[3])
    for trial_id in mixed.trials.values():
        wait_for_status(service, trial_id, *TERMINAL)
    queue = Queue(queue_name("local"), connection=rq_connection)
    done = lambda: queue.finished_job_registry.count + queue.failed_job_registry.count  # noqa: E731
    wait_until(lambda: done() == len(mixed.trials), what="every trial's job to be done")
    finish_experiment(service.store.client, rq_connection, mixed.experiment_id, "local", "DONE")
    wait_projected(service)


def run_mixed_experiment(
    make_service: ServiceFactory, processes: Processes, code_dir: Path, rq_connection: redis.Redis
) -> Mixed:
    mixed = start_mixed_experiment(make_service, processes, code_dir)
    finish_mixed_experiment(mixed, rq_connection)
    return mixed


def wait_projected(service: TrainingService) -> None:
    wait_until(lambda: service.views.position() == service.store.head(), what="the projector to catch up")


def scratch_keys(client: redis.Redis) -> list[str]:
    return list(client.scan_iter(match=f"{SCRATCH_PREFIX}*"))


def test_live_views_match_a_replay_while_the_experiment_runs_and_after(
    make_service: ServiceFactory, processes: Processes, code_dir: Path, client: redis.Redis, rq_connection: redis.Redis
) -> None:
    mixed = start_mixed_experiment(make_service, processes, code_dir)
    for _ in range(5):  # the projector keeps committing while we compare
        assert check(client, mixed.experiment_id) == []
    finish_mixed_experiment(mixed, rq_connection)
    result = replay_check(client, mixed.experiment_id)
    assert result.differences == [] and check(client, mixed.experiment_id) == []
    assert result.position == mixed.service.store.head()
    assert result.applied == mixed.service.store.length()
    assert scratch_keys(client) == []


BUSY_TRIAL = """
import trialstream_sdk as nni
nni.get_next_parameter()
for step in range(300):
    nni.report_intermediate_result(step)
nni.report_final_result(1)
"""


def test_check_holds_while_the_projector_commits_metrics(
    make_service: ServiceFactory, processes: Processes, code_dir: Path, client: redis.Redis
) -> None:
    """Trials flood the log with metrics (new trials and metric lists appear) while the views are compared."""
    (code_dir / "busy.py").write_text(textwrap.dedent(BUSY_TRIAL))
    service = make_service(f"{sys.executable} busy.py")
    processes.projector()
    processes.worker()
    processes.worker()
    trial_ids = [service.submit_trial_job(form(index)).id for index in range(4)]
    checks = 0
    while not all(service.get_trial_job(trial_id).status.is_terminal for trial_id in trial_ids) or checks < 3:
        assert check(client, service.experiment_id) == []
        checks += 1
    wait_projected(service)
    assert check(client, service.experiment_id) == []
    assert len(service.views.metrics(trial_ids[0])) == 301


def test_check_names_each_difference(
    make_service: ServiceFactory, processes: Processes, code_dir: Path, client: redis.Redis, rq_connection: redis.Redis
) -> None:
    mixed = run_mixed_experiment(make_service, processes, code_dir, rq_connection)
    processes.stop()  # nothing may rewrite the views we tamper with
    view_keys = ViewStore(client, mixed.experiment_id).keys
    succeeded = mixed.trials[1]
    trial = ViewStore(client, mixed.experiment_id).trial(succeeded)
    assert trial is not None
    client.hset(view_keys.trials, succeeded, trial.model_copy(update={"status": TrialJobStatus.FAILED}).to_json())
    client.rpop(view_keys.metrics(succeeded))
    client.hset(view_keys.metric_marks, "made-up", "0 1")
    client.hincrby(view_keys.position, "applied", 1)
    differences = check(client, mixed.experiment_id)
    assert f'trials[{succeeded}].status: live "FAILED" vs replayed "SUCCEEDED"' in differences
    assert any(line.startswith(f"metrics:{succeeded}[1]: live (missing) vs replayed [") for line in differences)
    assert 'metric-marks[made-up]: live "0 1" vs replayed (missing)' in differences
    applied = mixed.service.store.length()
    assert f"position[applied]: live {applied + 1} vs replayed {applied}" in differences
    assert len(differences) == 4, differences
    assert scratch_keys(client) == []


def test_replay_until_shows_the_past_and_cleans_up_even_on_error(
    make_service: ServiceFactory, processes: Processes, code_dir: Path, client: redis.Redis, rq_connection: redis.Redis
) -> None:
    mixed = run_mixed_experiment(make_service, processes, code_dir, rq_connection)
    started = [
        entry.id
        for entry in read_log(client, mixed.experiment_id, trial=mixed.trials[3], types={"TrialStarted"})
        if isinstance(entry, StoredEvent)
    ]
    with replayed(client, mixed.experiment_id, until=started[0]) as replay:
        assert replay.namespace.startswith(SCRATCH_PREFIX) and replay.position == started[0]
        past = ViewStore(client, mixed.experiment_id, replay.namespace)
        statuses = {trial.id: str(trial.status) for trial in past.trials()}
        assert statuses == {mixed.trials[1]: "SUCCEEDED", mixed.trials[2]: "FAILED", mixed.trials[3]: "RUNNING"}
        experiment = past.experiment()
        assert experiment is not None and experiment.status == "RUNNING"
    assert scratch_keys(client) == []
    assert ViewStore(client, mixed.experiment_id).trial(mixed.trials[3]) is not None  # the live views are untouched

    with pytest.raises(RuntimeError, match="in the middle"), replayed(client, mixed.experiment_id) as replay:
        assert scratch_keys(client)
        raise RuntimeError("in the middle")
    assert scratch_keys(client) == []


def test_diff_views_compares_two_redis_databases(
    make_service: ServiceFactory, client: redis.Redis, redis_url: str
) -> None:
    """Without workers: a submit, a cancel while waiting, and a finish are already a history to compare."""
    service = make_service()
    trial_id = service.submit_trial_job(form(0, x=1)).id
    service.cancel_trial_job(trial_id)
    Projector(client).catch_up(service.experiment_id)
    other = redis.Redis.from_url(redis_url.rsplit("/", 1)[0] + "/1", decode_responses=True)
    other.flushdb()
    for entry_id, fields in stream_entries(client, keys.events(service.experiment_id)):
        other.xadd(keys.events(service.experiment_id), cast(dict[FieldT, EncodableT], fields), id=entry_id)
    Projector(other).catch_up(service.experiment_id)
    assert diff_views(client, service.experiment_id, other_client=other) == []

    canceled = service.store.read()[-1]
    assert isinstance(canceled, StoredEvent)
    EventStore(client, service.experiment_id).append(canceled.event)  # a duplicate: the position moves
    Projector(client).catch_up(service.experiment_id)
    differences = diff_views(client, service.experiment_id, other_client=other, labels=("here", "there"))
    assert any(line.startswith("position[position]: here ") for line in differences), differences
    assert any(line.startswith("position[applied]: here ") for line in differences), differences
    # and the timeline, which draws every entry: its head, and the trial's entries and cancel marks
    timeline = [line for line in differences if not line.startswith("position[")]
    assert {line.split(": ")[0].split("[")[0] for line in timeline} == {
        "timeline",
        "timeline:trials",
        f"timeline:entries:{trial_id}",
    }, differences
    assert snapshot_views(other, service.experiment_id).applied == 5  # created, 2 metadata, submit, cancel


def test_positions_parse_from_ids_epoch_ms_and_iso_times() -> None:
    assert parse_position("1795319625061-3") == "1795319625061-3"
    assert parse_position("1795319625061") == "1795319625061"
    assert parse_position("2026-11-22T03:53:58.123+00:00") == "1795319638123-0"
    assert parse_position("2026-11-22T03:53:58.123Z", end=True) == "1795319638123"
    local = datetime(2026, 11, 22, 3, 53, 58).astimezone()
    assert parse_position("2026-11-22T03:53:58") == f"{int(local.timestamp()) * 1000}-0"
    for bad in ("yesterday", "17-x", "1969-01-01T00:00:00+00:00"):
        with pytest.raises(InvalidPosition):
            parse_position(bad)


def test_event_type_filters_are_checked_against_the_event_union() -> None:
    assert parse_types(None) is None
    assert parse_types(["TrialStarted,TrialEnded", "TrialSubmitted"]) == {
        "TrialStarted",
        "TrialEnded",
        "TrialSubmitted",
    }
    with pytest.raises(UnknownEventType, match=r"unknown event type TrialExploded; known types: .*TrialSubmitted"):
        parse_types(["TrialStarted,TrialExploded"])
