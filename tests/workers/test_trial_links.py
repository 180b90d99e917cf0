"""The commands reader and lease renewer a worker process's trials share (workers/runtime/trial_links.py), on a
real redis-server: many trials' controls in one process, each handed its own commands only, over a handful of
connections; a trial registered while the reader blocks is followed at once; a Redis restart mid-read is survived."""

from __future__ import annotations

import json
import logging
import secrets
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from core import keys
from core.connections import connect
from core.event_store import EventStore, StoredEvent
from core.leases import AttemptRef, Lease
from core.platform import ParsedMetric
from core.queueing import load_submission
from manager.training_service import TrainingService
from schemas.events import TrialMetricReported
from tests.conftest import RedisServer, ServiceFactory, form, new_service, wait_until
from workers.runtime import trial_links
from workers.runtime.control import LogTrialControl

TRIALS = 30
METRICS = 20
LEASE_S = 10.0
LONG_BLOCK_MS = 20_000  # far longer than any deadline below: a test that waited for the block would fail


def _control(client: redis.Redis, service: TrainingService, trial_id: str) -> LogTrialControl:
    store = EventStore(client, service.experiment_id)
    lease = Lease(client, AttemptRef(service.experiment_id, trial_id, 1), "test-worker", LEASE_S)
    assert lease.acquire()
    commands: Any = client.xrange(keys.trial_commands(service.experiment_id, trial_id))  # as a pick-up reads them
    return LogTrialControl(store, load_submission(store, trial_id), lease, commands)


@pytest.fixture
def client(redis_url: str) -> redis.Redis:
    """The test's client, named: its readers' connections are told from those of a reader another test on this
    server left blocked (for up to its block after its last trial, or for good if it lost a trial's close)."""
    return connect(f"{redis_url}?client_name=links-{secrets.token_hex(4)}")


def _blocked_reads(client: redis.Redis) -> int:
    """Connections of `client` blocked in XREAD."""
    name = client.connection_pool.connection_kwargs.get("client_name") or ""
    listed: Any = client.client_list()
    return sum(1 for each in listed if each["cmd"] == "xread" and "b" in each["flags"] and each["name"] == name)


@pytest.fixture
def controls() -> Iterator[list[LogTrialControl]]:
    made: list[LogTrialControl] = []
    yield made
    for control in made:
        control.close()


def test_many_trials_on_one_worker_each_get_their_own_commands_over_a_few_connections(
    make_service: ServiceFactory, client: redis.Redis, controls: list[LogTrialControl]
) -> None:
    service = make_service()
    trial_ids = [service.submit_trial_job(form(index)).id for index in range(TRIALS)]
    connected_before = len(client.client_list())
    controls += [_control(client, service, trial_id) for trial_id in trial_ids]
    for index, trial_id in enumerate(trial_ids):
        if index % 3 == 0:
            service.cancel_trial_job(trial_id)
        elif index % 3 == 1:  # two parameter sets: they arrive in order
            service.update_trial_job(trial_id, form(100 + index))
            service.update_trial_job(trial_id, form(200 + index))
    forms: dict[int, list[int]] = {index: [] for index in range(TRIALS)}

    def all_seen() -> bool:
        for index, control in enumerate(controls):
            forms[index] += [each.sequence_id for each in control.new_forms()]
        canceled = all(controls[index].stop_request() is not None for index in range(0, TRIALS, 3))
        return canceled and all(len(forms[index]) == 2 for index in range(1, TRIALS, 3))

    wait_until(all_seen, 10, what="every trial's commands")
    for index, control in enumerate(controls):
        assert (control.stop_request() is not None) == (index % 3 == 0), index
        assert forms[index] == ([100 + index, 200 + index] if index % 3 == 1 else []), index
    # one reader for all the trials (waited for: a late wake may have it between two reads just now)
    wait_until(lambda: _blocked_reads(client) == 1, 10, what="the reader to block again")
    # a connection per trial before: now the reader's, the renewer's and a few writes', whatever the trials
    assert len(client.client_list()) - connected_before <= 4


def test_many_trials_reporting_at_once_each_land_every_metric_once_and_in_order(
    make_service: ServiceFactory, client: redis.Redis, controls: list[LogTrialControl]
) -> None:
    """Their writes share round trips (workers/runtime/group_commit.py): each trial's own still land in its order,
    once each, and the last batch's idempotency keys are dropped by the next write as before."""
    service = make_service()
    trial_ids = [service.submit_trial_job(form(index)).id for index in range(TRIALS)]
    controls += [_control(client, service, trial_id) for trial_id in trial_ids]

    def report(control: LogTrialControl) -> None:
        for sequence in range(METRICS):
            control.metrics([ParsedMetric("0", "PERIODICAL", sequence, json.dumps(json.dumps(sequence)))])

    threads = [threading.Thread(target=report, args=(control,)) for control in controls]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
        assert not thread.is_alive()
    reported: dict[str, list[int]] = {trial_id: [] for trial_id in trial_ids}
    for entry in EventStore(client, service.experiment_id).read():
        if isinstance(entry, StoredEvent) and isinstance(entry.event, TrialMetricReported):
            reported[entry.event.trial_id].append(entry.event.sequence)
    assert reported == {trial_id: list(range(METRICS)) for trial_id in trial_ids}
    held: Any = client.hkeys(keys.idempotency(service.experiment_id))
    assert sorted(key for key in held if key.startswith("metric:")) == sorted(  # the last write's of each trial
        f"metric:{trial_id}:1:0:PERIODICAL:{METRICS - 1}" for trial_id in trial_ids
    )


def test_a_cancel_that_came_before_the_worker_is_seen_before_launching(
    make_service: ServiceFactory, client: redis.Redis, controls: list[LogTrialControl]
) -> None:
    service = make_service()
    trial_id = service.submit_trial_job(form(0)).id
    service.cancel_trial_job(trial_id)
    controls.append(_control(client, service, trial_id))
    assert controls[0].stop_request() is not None  # at once: no wait for the reader


def test_a_trial_registered_during_a_blocking_read_gets_its_cancel_promptly(
    make_service: ServiceFactory, client: redis.Redis, controls: list[LogTrialControl], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(trial_links, "READ_BLOCK_MS", LONG_BLOCK_MS)
    service = make_service()
    first, second = (service.submit_trial_job(form(index)).id for index in range(2))
    controls.append(_control(client, service, first))
    wait_until(lambda: _blocked_reads(client) == 1, 10, what="the reader to block")
    controls.append(_control(client, service, second))  # while that read blocks, naming the first trial only
    service.cancel_trial_job(second)
    wait_until(lambda: controls[1].stop_request() is not None, 5, what="the second trial's cancel")
    assert controls[0].stop_request() is None


def test_trials_starting_together_share_a_wake_of_the_reader(
    make_service: ServiceFactory, client: redis.Redis, controls: list[LogTrialControl], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each wake makes the reader send every trial's key again: a burst of starts wakes it a few times, not once
    per trial, and the last trial of the burst is followed all the same."""
    monkeypatch.setattr(trial_links, "READ_BLOCK_MS", LONG_BLOCK_MS)
    monkeypatch.setattr(trial_links, "WAKE_SPACING_S", 1.0)  # longer than the burst takes, on an idle machine
    service = make_service()
    trial_ids = [service.submit_trial_job(form(index)).id for index in range(TRIALS)]
    controls.append(_control(client, service, trial_ids[0]))
    wait_until(lambda: _blocked_reads(client) == 1, 10, what="the reader to block")
    began = time.monotonic()
    controls += [_control(client, service, trial_id) for trial_id in trial_ids[1:]]
    burst_s = time.monotonic() - began
    service.cancel_trial_job(trial_ids[-1])
    wait_until(lambda: controls[-1].stop_request() is not None, 5 + burst_s, what="the last trial's cancel")
    # this process's reader on this server: another test's reader may have left a wake key of its own there
    wake_key = trial_links.links(client, LEASE_S).reader._wake_key
    wakes: Any = client.xinfo_stream(wake_key)
    assert 1 <= wakes["entries-added"] <= 2 + int(burst_s)  # one a second at most; one per trial before


def test_the_reader_survives_a_redis_restart_mid_read(
    own_redis: RedisServer,
    tmp_path: Path,
    code_dir: Path,
    caplog: pytest.LogCaptureFixture,
    controls: list[LogTrialControl],
) -> None:
    server = own_redis
    client = connect(server.url, retry_s=0.3)  # the read's error reaches the reader: it must retry on its own
    service = new_service(client, connect(server.url, decode=False), tmp_path, code_dir)
    trial_ids = [service.submit_trial_job(form(index)).id for index in range(3)]
    controls += [_control(client, service, trial_id) for trial_id in trial_ids]
    service.update_trial_job(trial_ids[0], form(10))
    wait_until(lambda: controls[0].new_forms(), 10, what="the first parameter set")
    wait_until(lambda: _blocked_reads(client) == 1, 10, what="the reader to block")
    with caplog.at_level(logging.WARNING, logger=trial_links.__name__):
        server.kill()
        wait_until(lambda: "commands (" in caplog.text, 10, what="the reader to meet the outage")
        server.start()
    service.update_trial_job(trial_ids[0], form(11))
    service.cancel_trial_job(trial_ids[1])
    wait_until(lambda: controls[1].stop_request() is not None, 10, what="the cancel after the restart")
    assert [each.sequence_id for each in wait_until(controls[0].new_forms, 10, what="the next form")] == [11]
    assert controls[2].stop_request() is None
