"""Observability: /metrics read by Prometheus' own parser against what really happened, and JSON logs.

Real parts throughout: a `trialstream manager` subprocess, worker processes (one SIGKILLed mid-trial),
real HTTP, and the collector against a real Redis where a projector's absence must show as lag.
"""

from __future__ import annotations

import json
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import redis
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from rq import Worker

from core import keys
from core.event_store import EventStore, StoredEvent
from core.queueing import trial_queue
from manager.api.observability import TrialstreamCollector
from manager.projector import Projector
from manager.views import ViewStore
from schemas.events import TrialAttemptLost
from schemas.trial import TrialJobStatus
from simulators.waiting import wait_until
from tests.api.test_api_smoke import TRIAL, experiment_config
from tests.conftest import Processes, ServiceFactory, form
from tests.support import web

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]
FAST_LEASE = {"TRIALSTREAM_TRIAL_LEASE_S": "1"}

# The first attempt hangs until its worker is killed; the retry (same working directory) finishes.
HANGS_FIRST = """
import os, time, trialstream_sdk as nni
nni.get_next_parameter()
marker = os.path.join(os.environ["NNI_SYS_DIR"], "attempted")
first = not os.path.exists(marker)
open(marker, "a").close()
while first:
    time.sleep(1)
nni.report_final_result(1.0)
"""


def parse(exposition: str) -> Samples:
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(exposition)
        for sample in family.samples
    }


def scrape(url: str, token: str | None = None) -> Samples:
    headers = {"authorization": f"Bearer {token}"} if token else {}
    response = web.get(f"{url}/metrics", headers=headers, timeout=10)
    assert response.status_code == 200, response.text
    assert response.headers["content-type"] == CONTENT_TYPE_LATEST
    return parse(response.text)


def value(samples: Samples, name: str, **labels: str) -> float | None:
    return samples.get((name, frozenset(labels.items())))


def create(url: str, config: dict[str, Any]) -> str:
    created = web.post(f"{url}/api/v1/experiments", json={"config": config})
    assert created.status_code == 201, created.text
    return str(created.json()["id"])


def wait_done(url: str, experiment_id: str, timeout: float = 60) -> dict[str, Any]:
    def done() -> dict[str, Any] | None:
        state: dict[str, Any] = web.get(f"{url}/api/v1/experiments/{experiment_id}").json()
        return state if state["status"] == "DONE" else None

    return wait_until(done, timeout, what=f"experiment {experiment_id} to finish")


def scrape_until(url: str, check: Callable[[Samples], bool], what: str, timeout: float = 30) -> Samples:
    """The first scrape that passes `check`."""

    def probe() -> Samples | None:
        samples = scrape(url)
        return samples if check(samples) else None

    return wait_until(probe, timeout, what=what)


def caught_up(url: str) -> Samples:
    """A scrape taken once the projector has reached the end of every log."""
    return scrape_until(
        url, lambda samples: value(samples, "trialstream_projection_behind_experiments") == 0, "the projection"
    )


def test_metrics_follow_an_experiment_from_queued_to_done(
    tmp_path: Path, processes: Processes, client: redis.Redis, rq_connection: redis.Redis
) -> None:
    (tmp_path / "trial.py").write_text(TRIAL)
    url = processes.manager()  # no worker yet: the trials stay queued
    experiment_id = create(url, experiment_config(tmp_path, trials=4))
    queue = trial_queue("local", rq_connection)

    queued = scrape_until(
        url,
        lambda samples: value(samples, "trialstream_queue_depth", platform="local") == 2,
        "the runner's first 2 trials to be queued",
    )
    assert queue.count == 2
    assert value(queued, "trialstream_workers", platform="local") == 0
    assert value(queued, "trialstream_experiments", status="RUNNING") == 1
    assert value(queued, "trialstream_redis_replication_timeouts_total") == 0
    waiting = caught_up(url)
    assert value(waiting, "trialstream_projection_lag_events", experiment=experiment_id) == 0
    labels = {"experiment": experiment_id, "platform": "local"}
    assert value(waiting, "trialstream_running_experiment_trials", status="WAITING", **labels) == 2
    assert value(waiting, "trialstream_trials", platform="local", status="WAITING") == 2
    assert value(waiting, "trialstream_events_appended_total") == client.xlen(keys.events(experiment_id))

    processes.worker()
    processes.worker()
    serving = scrape(url)
    assert value(serving, "trialstream_workers", platform="local") == 2 == len(Worker.all(queue=queue))

    state = wait_done(url, experiment_id)
    wait_until(
        lambda: value(scrape(url), "trialstream_queue_depth", platform="local") == 0,
        30,
        what="the workers to drain the queue (the experiment's clean-up job included)",
    )
    done = caught_up(url)
    for status in TrialJobStatus:
        expected = state["trialCounts"].get(status.value, 0)
        assert value(done, "trialstream_trials", platform="local", status=status.value) == expected, status
    assert state["trialCounts"] == {"SUCCEEDED": 4}
    assert value(done, "trialstream_experiments", status="DONE") == 1
    assert value(done, "trialstream_experiments", status="RUNNING") == 0
    running_series = {labels for name, labels in done if name == "trialstream_running_experiment_trials"}
    assert running_series == set(), "a finished experiment keeps no per-experiment series"
    assert value(done, "trialstream_events_appended_total") == client.xlen(keys.events(experiment_id))
    assert value(done, "trialstream_projector_up") == 1


def test_a_worker_killed_mid_trial_shows_as_a_lost_and_retried_attempt(
    tmp_path: Path, processes: Processes, client: redis.Redis
) -> None:
    (tmp_path / "trial.py").write_text(HANGS_FIRST)
    url = processes.manager(env=FAST_LEASE)
    victim = processes.worker(env=FAST_LEASE)
    config = {**experiment_config(tmp_path, trials=1), "trialConcurrency": 1, "maxTrialRetries": 1}
    experiment_id = create(url, config)

    def trials() -> list[dict[str, Any]]:
        items: list[dict[str, Any]] = web.get(f"{url}/api/v1/experiments/{experiment_id}/trials").json()["items"]
        return items

    wait_until(lambda: [t["status"] for t in trials()] == ["RUNNING"], 30, what="the first attempt to run")
    processes.worker(env=FAST_LEASE)  # the survivor, which reaps the lost lease and runs the retry
    victim.send_signal(signal.SIGKILL)
    wait_done(url, experiment_id, timeout=60)

    samples = caught_up(url)
    counts = ViewStore(client, experiment_id).counts()
    lost = [
        entry
        for entry in EventStore(client, experiment_id).read()
        if isinstance(entry, StoredEvent) and isinstance(entry.event, TrialAttemptLost)
    ]
    assert len(lost) == counts["lost"] == counts["retried"] == 1
    assert value(samples, "trialstream_attempts_lost_total", platform="local") == 1
    assert value(samples, "trialstream_attempts_retried_total", platform="local") == 1
    assert value(samples, "trialstream_trials", platform="local", status="SUCCEEDED") == 1
    assert [(t["status"], t["attempt"]) for t in trials()] == [("SUCCEEDED", 2)]


def test_metrics_need_the_token_when_the_manager_has_one(processes: Processes) -> None:
    url = processes.manager("--host", "127.0.0.1", env={"TRIALSTREAM_MANAGER_TOKEN": "s3cret"})

    assert web.get(f"{url}/metrics").status_code == 401
    assert web.get(f"{url}/metrics", headers={"authorization": "Bearer wrong"}).status_code == 401
    wait_until(
        lambda: value(scrape(url, token="s3cret"), "trialstream_projector_up") == 1, 20, what="the manager's projector"
    )


def test_lag_counts_the_events_no_projector_has_folded_up_to_the_cap(
    make_service: ServiceFactory, client: redis.Redis, rq_connection: redis.Redis
) -> None:
    service = make_service()
    service.submit_trial_job(form(0))
    experiment_id = service.experiment_id
    logged = client.xlen(keys.events(experiment_id))

    def collect(cap: int) -> Samples:
        registry = CollectorRegistry()
        registry.register(TrialstreamCollector(client, rq_connection, lag_cap=cap))
        return parse(generate_latest(registry).decode())

    unprojected = collect(cap=100)
    assert logged > 2
    assert value(unprojected, "trialstream_projection_lag_events", experiment=experiment_id) == logged
    assert value(collect(cap=2), "trialstream_projection_lag_events", experiment=experiment_id) == 2
    assert value(unprojected, "trialstream_projection_behind_experiments") == 1
    assert value(unprojected, "trialstream_projector_up") == 0
    assert value(unprojected, "trialstream_queue_depth", platform="local") == 1

    Projector(client).catch_up(experiment_id)
    projected = collect(cap=100)
    assert value(projected, "trialstream_projection_lag_events", experiment=experiment_id) == 0
    assert value(projected, "trialstream_projection_behind_experiments") == 0
    assert value(projected, "trialstream_trials", platform="local", status="WAITING") == 1  # from its metadata
    assert value(projected, "trialstream_events_appended_total") == logged


def test_json_logs_are_one_object_per_line_with_the_experiment_id(tmp_path: Path, processes: Processes) -> None:
    (tmp_path / "trial.py").write_text(TRIAL)
    url = processes.manager("--log-format", "json")
    manager = processes.running[-1]
    experiment_id = create(url, experiment_config(tmp_path))  # no worker: it stays RUNNING

    manager.send_signal(signal.SIGTERM)  # detach (the default): its runner logs that it let go
    manager.wait(30)
    log_file = processes.log_dir / f"manager-{processes.running.index(manager)}.log"
    records = [json.loads(line) for line in log_file.read_text().splitlines() if line.strip()]

    assert records and all({"time", "level", "logger", "message"} <= record.keys() for record in records)
    detached = [record for record in records if record["message"].startswith(f"experiment {experiment_id} detached")]
    assert len(detached) == 1
    assert detached[0]["experiment"] == experiment_id
    assert detached[0]["logger"] == "manager.host" and detached[0]["level"] == "info"
    assert any(record["logger"] == "manager.cli.manager" and url in record["message"] for record in records)
    assert manager.returncode == 0  # a SIGTERM is a clean stop, not an error


def test_json_logs_carry_the_trial_id_in_the_manager_and_in_the_worker(tmp_path: Path, processes: Processes) -> None:
    """A worker paused past its lease: the manager (the only reaper left) declares the attempt lost,
    and the worker, woken, finds it so; both say it in a JSON record with the experiment and trial ids."""
    (tmp_path / "trial.py").write_text(HANGS_FIRST)
    url = processes.manager("--log-format", "json", env=FAST_LEASE)
    manager_log = processes.log_dir / f"manager-{len(processes.running) - 1}.log"
    worker = processes.worker(env=FAST_LEASE, args=("--log-format", "json"))
    worker_log = processes.log_dir / f"worker-{len(processes.running) - 1}.log"
    experiment_id = create(url, {**experiment_config(tmp_path, trials=1), "trialConcurrency": 1})

    def running() -> str | None:
        trials = web.get(f"{url}/api/v1/experiments/{experiment_id}/trials").json()["items"]
        return next((str(trial["id"]) for trial in trials if trial["status"] == "RUNNING"), None)

    trial_id = wait_until(running, 30, what="the trial to run")

    def records(log_file: Path) -> list[dict[str, Any]]:
        return [json.loads(line) for line in log_file.read_text().splitlines() if line.strip()]

    def about_the_trial(log_file: Path, words: str) -> dict[str, Any] | None:
        return next((r for r in records(log_file) if r.get("trial") == trial_id and words in r["message"]), None)

    worker.send_signal(signal.SIGSTOP)
    declared = wait_until(lambda: about_the_trial(manager_log, "attempt 1"), 30, what="the manager to log the loss")
    worker.send_signal(signal.SIGCONT)
    assert declared["experiment"] == experiment_id and declared["logger"] == "core.reaper"
    woken = wait_until(lambda: about_the_trial(worker_log, "was declared lost"), 30, what="the worker to log it")
    assert woken["experiment"] == experiment_id and woken["level"] == "warning"
    assert all({"time", "level", "logger", "message"} <= record.keys() for record in records(worker_log))
