"""Redis killed (-9) and restarted mid-experiment: clients reconnect, nothing acknowledged is lost.

These tests run their own redis-server (AOF on, on a port and data directory of their own) rather
than pytest-redis's, because they kill it and start it again on the same port and directory.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import redis

from core import keys
from core.connections import OUTAGE_BUDGET_ENV, RedisUnavailable, connect, retry_policy
from core.event_store import EventStore, StoredEvent
from manager.experiments import create_experiment
from manager.projector import Projector, _connection_lost
from manager.replay import check
from manager.training_service import TrainingService
from manager.views import ViewStore
from schemas.events import PLATFORM_CONFIG, TRIAL_CONFIG, ClusterMetadataSet, TrialMetricReported
from schemas.trial import TrialConfig, TrialJobStatus
from tests.conftest import REPO, Processes, RedisServer, form, free_port, stream_entries, wait_for_status, wait_until


def local_experiment(client: redis.Redis, rq_connection: redis.Redis, root: Path, command: str) -> TrainingService:
    """An experiment whose trials run `command` in `root/code` on the local platform (as conftest.make_service)."""
    code_dir = root / "code"
    code_dir.mkdir(exist_ok=True)
    experiment_id = create_experiment(client, {"trialCommand": command}, root / "experiments")
    service = TrainingService(client, rq_connection, experiment_id)
    service.set_cluster_metadata(TRIAL_CONFIG, TrialConfig(command=command, code_directory=str(code_dir)).to_json())
    service.set_cluster_metadata(PLATFORM_CONFIG, json.dumps({"platform": "local"}))
    return service


# A trial that reports PERIODICAL 0..n-1 (value = sequence) every `pause` seconds, then FINAL n.
METRIC_TRIAL = """
import sys, time
import trialstream_sdk as nni
count, pause = int(sys.argv[1]), float(sys.argv[2])
nni.get_next_parameter()
for sequence in range(count):
    nni.report_intermediate_result(sequence)
    time.sleep(pause)
nni.report_final_result(count)
"""


def metric_trial(root: Path, count: int, pause: float) -> str:
    code_dir = root / "code"
    code_dir.mkdir(exist_ok=True)
    (code_dir / "report.py").write_text(textwrap.dedent(METRIC_TRIAL))
    return f"{sys.executable} report.py {count} {pause}"


def expected_metrics(count: int) -> list[tuple[str, int, Any]]:
    return sorted([("PERIODICAL", sequence, sequence) for sequence in range(count)] + [("FINAL", 0, count)])


def metric_file_records(working_directory: str) -> int:
    """How many metric records the trial has written to its metrics file so far."""
    path = Path(working_directory) / ".nni" / "metrics"
    return path.read_bytes().count(b"ME0") if path.exists() else 0


def assert_views_match_rebuild(client: redis.Redis, experiment_id: str) -> None:
    """The projector has read the whole log, and a rebuild from the log into scratch views gives the same views."""
    head = EventStore(client, experiment_id).head()
    wait_until(lambda: ViewStore(client, experiment_id).position() == head, 20, what="the projector to reach the head")
    assert check(client, experiment_id) == []  # every view key compared with a replay into a scratch namespace


def assert_each_metric_once(client: redis.Redis, experiment_id: str) -> None:
    """Each trial's projected metrics are the distinct metrics of the log, in log order, each once."""
    views = ViewStore(client, experiment_id)
    distinct: dict[str, dict[str, TrialMetricReported]] = {}
    for entry in EventStore(client, experiment_id).read():
        if isinstance(entry, StoredEvent) and isinstance(entry.event, TrialMetricReported):
            event = entry.event
            key = f"{event.attempt}|{event.parameter_id}|{event.metric_type}|{event.sequence}"
            distinct.setdefault(event.trial_id, {}).setdefault(key, event)
    for trial in views.trials():
        projected = [(m.attempt, m.parameter_id, m.type, m.sequence, m.data) for m in views.metrics(trial.id)]
        in_log = [
            (e.attempt, e.parameter_id, e.metric_type, e.sequence, e.data) for e in distinct.get(trial.id, {}).values()
        ]
        assert projected == in_log, trial.id


def test_an_experiment_completes_across_a_redis_kill_and_restart(
    own_redis: RedisServer, own_processes: Processes, tmp_path: Path
) -> None:
    client, rq_connection = connect(own_redis.url), connect(own_redis.url, decode=False)
    count = 40
    service = local_experiment(client, rq_connection, tmp_path, metric_trial(tmp_path, count, 0.08))
    own_processes.projector()
    own_processes.worker()
    own_processes.worker()
    trial_ids = [service.submit_trial_job(form(index, x=index)).id for index in range(3)]  # the third waits

    def two_running_with_metrics() -> list[str] | None:
        running = [trial for trial in service.list_trial_jobs() if trial.status is TrialJobStatus.RUNNING]
        if len(running) == 2 and all(metric_file_records(trial.working_directory) >= 3 for trial in running):
            return [trial.working_directory for trial in running]
        return None

    directories = wait_until(two_running_with_metrics, 20, what="two trials running and reporting")
    written = [metric_file_records(directory) for directory in directories]
    own_redis.kill()
    # The trials go on while Redis is down (over a second: several backoff steps): each writes more
    # metrics that can only reach the log after the restart.
    wait_until(
        lambda: all(metric_file_records(d) >= n + 15 for d, n in zip(directories, written, strict=True)),
        10,
        what="the trials to report metrics while Redis is down",
    )
    own_redis.start()

    terminal = [str(status) for status in TrialJobStatus if status.is_terminal]
    for trial_id in trial_ids:
        trial = wait_for_status(service, trial_id, *terminal, timeout=30)
        assert trial.status is TrialJobStatus.SUCCEEDED, (trial.message, own_processes.logs()[-3000:])
    assert_views_match_rebuild(client, service.experiment_id)
    views = ViewStore(client, service.experiment_id)
    for trial_id in trial_ids:
        metrics = sorted((m.type, m.sequence, m.value) for m in views.metrics(trial_id))
        assert metrics == expected_metrics(count), trial_id
    assert_each_metric_once(client, service.experiment_id)
    assert views.unreadable() == {}
    for process in own_processes.running:
        assert process.poll() is None, "a projector or worker died on the outage"


def append_until_killed(server: RedisServer, client: redis.Redis, kill_after: int, limit_s: float = 15.0) -> list[str]:
    """Append events one by one, recording each acknowledged id, and SIGKILL the server mid-loop."""
    store = EventStore(client, "durable")
    acknowledged: list[str] = []
    failure: list[BaseException] = []

    def append_forever() -> None:
        deadline = time.monotonic() + limit_s
        try:
            while time.monotonic() < deadline:
                event = ClusterMetadataSet(experiment_id="durable", key="k", value=str(len(acknowledged)))
                acknowledged.append(store.append(event))
        except redis.ConnectionError as error:
            failure.append(error)

    appender = threading.Thread(target=append_forever)
    appender.start()
    wait_until(lambda: len(acknowledged) >= kill_after, 10, interval=0.001, what=f"{kill_after} appends")
    server.kill()
    appender.join(limit_s)
    assert failure, "the appends went on although Redis was killed"
    return acknowledged


def no_retry_client(url: str) -> redis.Redis:
    """A client that fails at the first error: an append either was acknowledged or raised."""
    return redis.Redis.from_url(url, decode_responses=True)


def test_every_acknowledged_append_survives_a_kill_with_appendfsync_always(own_redis: RedisServer) -> None:
    acknowledged = append_until_killed(own_redis, no_retry_client(own_redis.url), kill_after=2000)
    own_redis.start()
    stored = {str(entry_id) for entry_id, _ in stream_entries(connect(own_redis.url), keys.events("durable"))}
    missing = [entry_id for entry_id in acknowledged if entry_id not in stored]
    assert missing == [], f"{len(missing)} of {len(acknowledged)} acknowledged appends lost"
    assert len(stored) - len(acknowledged) in (0, 1)  # at most the append in flight when it died


def test_a_wrong_url_still_fails_at_once() -> None:
    started = time.monotonic()
    with pytest.raises(RedisUnavailable, match="cannot reach Redis"):
        connect(f"redis://127.0.0.1:{free_port()}/0")
    assert time.monotonic() - started < 2


def test_a_command_waits_for_redis_to_come_back(own_redis: RedisServer) -> None:
    client = connect(own_redis.url)
    client.set("before", "1")
    own_redis.kill()
    restarted = threading.Timer(1.0, own_redis.start)  # the outage: a second, then Redis is back
    restarted.start()
    try:
        started = time.monotonic()
        assert client.get("before") == "1"  # retried with backoff until the restarted server answers
        assert time.monotonic() - started >= 0.5
    finally:
        restarted.join()


def test_the_projector_outlives_an_outage_longer_than_its_client_retries(
    own_redis: RedisServer, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="manager.projector")
    client = redis.Redis.from_url(own_redis.url, decode_responses=True, retry=retry_policy(budget_s=0.2))
    writer = connect(own_redis.url)
    experiment_id = create_experiment(writer, {}, tmp_path)
    store = EventStore(writer, experiment_id)
    store.append(ClusterMetadataSet(experiment_id=experiment_id, key="before", value="1"))
    stop = threading.Event()
    runner = threading.Thread(target=Projector(client).run, args=(stop,), kwargs={"block_ms": 100})
    runner.start()
    try:
        views = ViewStore(writer, experiment_id)
        wait_until(lambda: views.position() == store.head(), 10, what="the projector to catch up")
        own_redis.kill()
        wait_until(lambda: "retrying with backoff" in caplog.text, 10, what="the projector to give up a command")
        own_redis.start()
        store.append(ClusterMetadataSet(experiment_id=experiment_id, key="after", value="2"))
        wait_until(lambda: views.position() == store.head(), 10, what="the projector to resume")
        wait_until(lambda: "serving again" in caplog.text, 5, what="the projector to say it recovered")
        assert runner.is_alive()
        experiment = views.experiment()
        assert experiment is not None and experiment.metadata == {"before": "1", "after": "2"}
    finally:
        stop.set()
        runner.join(10)
    assert not runner.is_alive()


def test_a_connection_lost_while_watching_is_told_apart_from_a_conflict(own_redis: RedisServer) -> None:
    """redis-py cannot resend a WATCH: a connection error there surfaces as WatchError, like a conflict."""
    client = connect(own_redis.url)
    with client.pipeline() as pipe:
        pipe.watch("position")
        own_redis.kill()
        with pytest.raises(redis.WatchError) as lost:
            pipe.get("position")
        assert _connection_lost(lost.value)
    own_redis.start()
    with client.pipeline() as pipe:
        pipe.watch("position")
        client.set("position", "moved")  # another projector commits meanwhile
        pipe.multi()
        pipe.set("position", "mine")
        with pytest.raises(redis.WatchError) as conflict:
            pipe.execute()
        assert not _connection_lost(conflict.value)


def test_an_outage_longer_than_the_client_retries_does_not_kill_a_trial(
    own_redis: RedisServer, own_processes: Processes, tmp_path: Path
) -> None:
    client, rq_connection = connect(own_redis.url), connect(own_redis.url, decode=False)
    count = 60
    service = local_experiment(client, rq_connection, tmp_path, metric_trial(tmp_path, count, 0.08))
    budget = {OUTAGE_BUDGET_ENV: "0.5"}  # as a 60 s budget against a longer outage, in less time
    own_processes.projector(env=budget)
    worker = own_processes.worker(env=budget)
    trial_id = service.submit_trial_job(form(0)).id
    running = wait_for_status(service, trial_id, "RUNNING")
    directory = running.working_directory
    wait_until(lambda: metric_file_records(directory) >= 3, 10, what="the trial to report")
    written = metric_file_records(directory)
    own_redis.kill()
    wait_until(
        lambda: metric_file_records(directory) >= written + 30 or worker.poll() is not None,
        10,
        what="an outage of several retry budgets",
    )
    assert worker.poll() is None, "the worker quit on the outage"
    own_redis.start()
    terminal = [str(status) for status in TrialJobStatus if status.is_terminal]
    trial = wait_for_status(service, trial_id, *terminal, timeout=30)
    assert trial.status is TrialJobStatus.SUCCEEDED, trial.message
    views = ViewStore(client, service.experiment_id)  # the status came from the log's tail: the views may lag it
    wait_until(lambda: views.position() == service.store.head(), 20, what="the projector to reach the head")
    metrics = sorted((m.type, m.sequence, m.value) for m in views.metrics(trial_id))
    assert metrics == expected_metrics(count)
    assert worker.poll() is None


def test_an_outage_longer_than_the_lease_does_not_declare_a_live_trial_lost(
    own_redis: RedisServer, own_processes: Processes, tmp_path: Path
) -> None:
    """No worker can renew while Redis is down: after a restart, reapers give the holders time to."""
    client, rq_connection = connect(own_redis.url), connect(own_redis.url, decode=False)
    count = 90
    service = local_experiment(client, rq_connection, tmp_path, metric_trial(tmp_path, count, 0.08))
    # 1 s, not less: the renewer must get the CPU within its local deadline (two leases) on a loaded machine
    lease = {"TRIALSTREAM_TRIAL_LEASE_S": "1.0"}
    own_processes.projector()
    own_processes.worker(env=lease)
    trial_id = service.submit_trial_job(form(0)).id
    directory = wait_for_status(service, trial_id, "RUNNING").working_directory
    own_processes.worker(env=lease)  # a reaper with nothing else to do
    wait_until(lambda: metric_file_records(directory) >= 3, 10, what="the trial to report")
    written = metric_file_records(directory)
    own_redis.kill()
    wait_until(lambda: metric_file_records(directory) >= written + 40, 20, what="an outage of several leases")
    own_redis.start()

    terminal = [str(status) for status in TrialJobStatus if status.is_terminal]
    trial = wait_for_status(service, trial_id, *terminal, timeout=30)
    assert trial.status is TrialJobStatus.SUCCEEDED and trial.attempt == 1, trial.message
    entries = EventStore(client, service.experiment_id).read()
    lost = [e.id for e in entries if isinstance(e, StoredEvent) and e.event.type == "TrialAttemptLost"]
    assert lost == []


def test_the_runner_rides_out_a_redis_restart(own_redis: RedisServer, own_processes: Processes, tmp_path: Path) -> None:
    """`trialstream run` itself (the manager) reconnects too, and the experiment completes."""
    code_dir = tmp_path / "code"
    command = metric_trial(tmp_path, 30, 0.05)
    config = {
        "trialCommand": command,
        "trialCodeDirectory": str(code_dir),
        "trialConcurrency": 2,
        "maxTrialNumber": 4,
        "searchSpace": {"x": {"_type": "choice", "_value": [1, 2]}},
        "trainingService": {"platform": "local"},
        "experimentWorkingDirectory": str(tmp_path / "experiments"),
    }
    (tmp_path / "config.yml").write_text(json.dumps(config))
    own_processes.projector()
    own_processes.worker()
    own_processes.worker()
    runner = subprocess.Popen(
        [sys.executable, "-m", "manager.cli", "--redis", own_redis.url, "run", str(tmp_path / "config.yml"), "--json"],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    experiments = tmp_path / "experiments"
    first = wait_until(lambda: next(experiments.glob("*/trials/*/.nni/metrics"), None), 30, what="a trial reporting")
    written = metric_file_records(str(first.parent.parent))
    own_redis.kill()
    wait_until(
        lambda: metric_file_records(str(first.parent.parent)) >= written + 10,
        10,
        what="the trial to go on reporting while Redis is down",
    )
    own_redis.start()
    output, errors = runner.communicate(timeout=60)

    assert runner.returncode == 0, errors[-2000:]
    trials = json.loads(output)["trials"]
    assert len(trials) == 4 and {trial["status"] for trial in trials} == {"SUCCEEDED"}
