"""The runner (the manager) SIGKILLed mid-experiment, then `trialstream resume` continues it from the log."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import cast

import redis

from core import keys
from core.event_store import EventStore, StoredEvent
from manager.archive.moves import archive, archived
from manager.archive.stores import open_store
from manager.stack import embedded_experiments, live_url
from manager.views import ViewStore
from schemas.events import ExperimentResumed, TrialStarted
from tests.conftest import REPO, Processes, wait_until

TRIAL = """
import time, trialstream_sdk as nni
x = nni.get_next_parameter()["x"]
time.sleep(1.0)
nni.report_final_result(x)
"""


def write_config(directory: Path, **overrides: object) -> None:
    """Six trials of TRIAL, two at a time, with a seeded Random tuner."""
    (directory / "trial.py").write_text(TRIAL)
    config = {
        "trialCommand": f"{sys.executable} trial.py",
        "trialCodeDirectory": str(directory),
        "trialConcurrency": 2,
        "maxTrialNumber": 6,
        "searchSpace": {"x": {"_type": "uniform", "_value": [0, 1]}},
        "tuner": {"name": "Random", "classArgs": {"seed": 5}},
        "trainingService": {"platform": "local"},
        **overrides,
    }
    (directory / "config.yml").write_text(json.dumps(config))


def trialstream(redis_url: str, *args: str) -> subprocess.Popen[str]:
    """The CLI on `redis_url`; its runner's claim lapses 3 s after it dies (5 by default), for the resume after it."""
    return subprocess.Popen(
        [sys.executable, "-m", "manager.cli", "--redis", redis_url, *args],
        cwd=REPO,
        env={
            **{key: value for key, value in os.environ.items() if key != "TRIALSTREAM_REDIS_URL"},
            "TRIALSTREAM_RUNNER_LEASE_S": "3",
        },
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_resume_continues_a_crashed_runner_without_rerunning_or_overspending(
    tmp_path: Path, processes: Processes, redis_url: str, client: redis.Redis
) -> None:
    write_config(tmp_path, experimentWorkingDirectory=str(tmp_path / "experiments"))
    processes.projector()
    processes.worker()
    processes.worker()

    runner = trialstream(redis_url, "run", str(tmp_path / "config.yml"), "--json")
    experiment_id = str(
        wait_until(lambda: cast(list[str], client.zrange(keys.EXPERIMENTS, 0, -1)), 20, what="the experiment")[0]
    )
    views = ViewStore(client, experiment_id)

    def mid_run() -> bool:
        statuses = Counter(str(trial.status) for trial in views.trials())
        return statuses["SUCCEEDED"] >= 2 and statuses["RUNNING"] >= 1

    wait_until(mid_run, 30, what="two trials done and one running")
    runner.send_signal(signal.SIGKILL)
    runner.wait()
    before = {trial.id: trial.status for trial in views.trials()}

    resumed = trialstream(redis_url, "resume", experiment_id, "--json")
    output, errors = resumed.communicate(timeout=60)
    assert resumed.returncode == 0, errors

    trials = json.loads(output)["trials"]
    assert len(trials) == 6  # maxTrialNumber counts the trials from before the crash
    assert sorted(trial["sequenceId"] for trial in trials) == list(range(6))
    assert {trial["status"] for trial in trials} == {"SUCCEEDED"}  # running ones were followed, not canceled
    entries = EventStore(client, experiment_id).read()
    starts = Counter(
        e.event.trial_id for e in entries if isinstance(e, StoredEvent) and isinstance(e.event, TrialStarted)
    )
    assert all(starts[trial_id] == 1 for trial_id in before)  # nothing from before was run again
    assert sum(isinstance(e, StoredEvent) and isinstance(e.event, ExperimentResumed) for e in entries) == 1
    wait_until(lambda: (view := views.experiment()) is not None and view.status == "DONE", 10, what="DONE")

    archive(client, experiment_id, open_store(str(tmp_path / "archive")))
    again = trialstream(redis_url, "resume", experiment_id)
    _, errors = again.communicate(timeout=30)
    assert again.returncode == 1 and f"experiment {experiment_id} is done" in errors
    assert archived(client, experiment_id) is not None  # refused by the view it keeps: left in its archive
    assert client.pttl(keys.events(experiment_id)) > 0  # the command's read-through copy, for a while


def test_resume_after_an_embedded_run_was_killed(tmp_path: Path) -> None:
    """No Redis URL: the runner's private stack dies with it, and resume brings it back from the data directory."""
    root = tmp_path / "experiments"
    write_config(tmp_path, maxTrialRetries=1)
    env = {
        **{key: value for key, value in os.environ.items() if key != "TRIALSTREAM_REDIS_URL"},
        "TRIALSTREAM_EXPERIMENTS_DIR": str(root),
        "TRIALSTREAM_TRIAL_LEASE_S": "1",
        "TRIALSTREAM_RUNNER_LEASE_S": "3",
    }

    def cli(*args: str) -> subprocess.Popen[str]:
        command = [sys.executable, "-m", "manager.cli", *args]
        return subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    runner = cli("run", str(tmp_path / "config.yml"), "--json")
    directory = wait_until(lambda: next(iter(embedded_experiments(root)), None), 30, what="the experiment")
    url = wait_until(lambda: live_url(directory), 30, what="the embedded Redis")
    client = redis.Redis.from_url(url, decode_responses=True)
    experiment_id = directory.name
    views = ViewStore(client, experiment_id)
    wait_until(lambda: sum(t.status == "SUCCEEDED" for t in views.trials()) >= 2, 60, what="two trials done")
    runner.send_signal(signal.SIGKILL)
    runner.wait()

    def stack_gone() -> bool:
        try:
            client.ping()
        except redis.ConnectionError:
            return True
        return False

    wait_until(stack_gone, 15, what="the embedded Redis to stop with its runner")
    resumed = cli("resume", experiment_id, "--json")
    output, errors = resumed.communicate(timeout=90)
    assert resumed.returncode == 0, errors
    trials = json.loads(output)["trials"]
    assert sorted(trial["sequenceId"] for trial in trials) == list(range(6))
    assert {trial["status"] for trial in trials} <= {"SUCCEEDED", "FAILED"}
    assert sum(trial["status"] == "SUCCEEDED" for trial in trials) >= 2
