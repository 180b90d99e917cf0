"""The manager survives its own restart: a killed or detached manager's experiments are taken up by the
next one on the same Redis and finish with exactly their budget, no trial run twice; a manager stopped
with `--on-exit stop` stops its experiments, and the next one leaves them stopped.

Real parts: `trialstream manager` processes over HTTP, a worker, gated trials (tests/api/test_api.py) whose
ends the test decides, so each fault lands at a known point of the experiment's progress.
"""

from __future__ import annotations

import signal
import subprocess
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from core import keys
from core.connections import same_server
from manager.training_service import TrainingService
from simulators.waiting import wait_until
from tests.api.test_api import Api, experiment_config, write_trial
from tests.conftest import Processes

TRIALS = 8
CONCURRENCY = 2


@pytest.fixture
def code(tmp_path: Path) -> Path:
    return write_trial(tmp_path / "code")


def start_manager(processes: Processes, code: Path, *args: str) -> tuple[Api, subprocess.Popen[bytes]]:
    url = processes.manager(*args)
    return Api(httpx.Client(base_url=f"{url}/api/v1", timeout=30), code), processes.running[-1]


@pytest.fixture
def worker(processes: Processes) -> Iterator[None]:
    processes.worker(args=("--concurrency", "4"))
    yield


def ended(api: Api, experiment_id: str) -> list[dict[str, Any]]:
    return [trial for trial in api.trials(experiment_id) if trial["status"] == "SUCCEEDED"]


def run_to_mid_experiment(api: Api, experiment_id: str, ended_before_fault: int) -> None:
    """Release trials one at a time until `ended_before_fault` have ended, and CONCURRENCY more run."""
    while len(done := ended(api, experiment_id)) < ended_before_fault:
        running = api.wait_running(experiment_id, CONCURRENCY)
        api.release(running[0]["id"])
        wait_until(lambda: len(ended(api, experiment_id)) > len(done), 30, what="a released trial to end")
    api.wait_running(experiment_id, CONCURRENCY)


def log_status(client: redis.Redis, experiment_id: str) -> str:
    """The experiment's status as its log says, read without any manager."""
    return TrainingService(client, same_server(client, decode=False), experiment_id).experiment_view().status


def assert_ran_once_each(api: Api, experiment_id: str) -> None:
    """Exactly the budget, sequence ids 0..n-1, each trial started once (one attempt, one process)."""
    trials = api.trials(experiment_id)
    assert [trial["sequenceId"] for trial in trials] == list(range(TRIALS))
    assert {trial["status"] for trial in trials} == {"SUCCEEDED"}
    events = [item["event"] for item in api.events(experiment_id)]
    submitted = Counter(event["trialId"] for event in events if event["type"] == "TrialSubmitted")
    started = Counter(event["trialId"] for event in events if event["type"] == "TrialStarted")
    assert set(submitted.values()) == {1} and len(submitted) == TRIALS
    assert started == submitted, started
    ran = sorted(path.stem for path in (api.code / "params").glob("*.json"))  # each trial process writes one
    assert ran == sorted(trial["id"] for trial in trials)


@pytest.mark.timeout(180)
def test_a_killed_manager_s_experiment_is_resumed_by_the_next_and_finishes_its_budget_once(
    processes: Processes, worker: None, code: Path, client: redis.Redis
) -> None:
    api, manager = start_manager(processes, code)
    experiment_id = api.create(experiment_config(code, trials=TRIALS, concurrency=CONCURRENCY))
    run_to_mid_experiment(api, experiment_id, ended_before_fault=3)

    manager.send_signal(signal.SIGKILL)  # no shutdown of any kind: the runner dies mid-experiment
    manager.wait()
    assert client.sismember(keys.MANAGER_HOSTED, experiment_id)
    assert log_status(client, experiment_id) == "RUNNING"

    api, _ = start_manager(processes, code)
    wait_until(lambda: api.experiment(experiment_id)["hosted"], 30, what="the new manager to take the experiment up")
    api.release_all()
    state = api.wait_status(experiment_id, "DONE", timeout=90)
    assert state["trialCounts"] == {"SUCCEEDED": TRIALS}
    assert_ran_once_each(api, experiment_id)
    assert not client.sismember(keys.MANAGER_HOSTED, experiment_id)  # ended: nothing left to resume


@pytest.mark.timeout(180)
def test_sigterm_detaches_by_default_and_the_next_manager_finishes_the_experiment(
    processes: Processes, worker: None, code: Path, client: redis.Redis
) -> None:
    api, manager = start_manager(processes, code)
    experiment_id = api.create(experiment_config(code, trials=TRIALS, concurrency=CONCURRENCY))
    run_to_mid_experiment(api, experiment_id, ended_before_fault=2)
    running = {trial["id"] for trial in api.trials(experiment_id, status="RUNNING")}

    manager.send_signal(signal.SIGTERM)
    assert manager.wait(30) != -signal.SIGKILL
    assert log_status(client, experiment_id) == "RUNNING"  # detached, not stopped
    assert client.sismember(keys.MANAGER_HOSTED, experiment_id)
    assert not client.exists(keys.runner(experiment_id))  # the claim was let go, not left to lapse
    service = TrainingService(client, same_server(client, decode=False), experiment_id)
    assert {trial.id for trial in service.list_trial_jobs() if str(trial.status) == "RUNNING"} == running

    api, _ = start_manager(processes, code)
    wait_until(lambda: api.experiment(experiment_id)["hosted"], 30, what="the new manager to take the experiment up")
    api.release_all()
    api.wait_status(experiment_id, "DONE", timeout=90)
    assert_ran_once_each(api, experiment_id)


@pytest.mark.timeout(180)
def test_on_exit_stop_stops_the_experiments_and_the_next_manager_leaves_them_stopped(
    processes: Processes, worker: None, code: Path, client: redis.Redis
) -> None:
    api, manager = start_manager(processes, code, "--on-exit", "stop")
    experiment_id = api.create(experiment_config(code, trials=TRIALS, concurrency=CONCURRENCY))
    run_to_mid_experiment(api, experiment_id, ended_before_fault=1)
    running = {trial["id"] for trial in api.trials(experiment_id, status="RUNNING")}
    assert len(running) == CONCURRENCY

    manager.send_signal(signal.SIGTERM)
    manager.wait(60)
    assert log_status(client, experiment_id) == "STOPPED"
    assert not client.sismember(keys.MANAGER_HOSTED, experiment_id)
    service = TrainingService(client, same_server(client, decode=False), experiment_id)
    statuses = {trial.id: str(trial.status) for trial in service.list_trial_jobs()}
    assert {trial_id: statuses[trial_id] for trial_id in running} == dict.fromkeys(running, "SYS_CANCELED")
    assert Counter(statuses.values()) == {"SUCCEEDED": 1, "SYS_CANCELED": CONCURRENCY}

    api, _ = start_manager(processes, code)
    state = api.experiment(experiment_id)
    assert state["status"] == "STOPPED" and not state["hosted"]
    log_length = len(api.events(experiment_id))
    # the new manager is serving (it answers, and a new experiment of its own runs), and still left it alone
    other = api.create(experiment_config(code, trials=1, concurrency=1))
    api.release_all()
    api.wait_status(other, "DONE")
    assert api.experiment(experiment_id)["status"] == "STOPPED"
    assert len(api.events(experiment_id)) == log_length
    assert not client.exists(keys.runner(experiment_id))
