"""A runner that stalls past its claim and wakes next to a `resume` stops, instead of submitting twice."""

from __future__ import annotations

import json
import signal
import sys
from collections import Counter
from pathlib import Path
from typing import cast

import pytest
import redis

from core import keys
from core.event_store import EventStore, StoredEvent
from manager.config import load_experiment_config
from manager.runner import ClaimLost, ExperimentRunner
from manager.views import ViewStore
from schemas.events import TrialSubmitted
from tests.conftest import Processes, wait_until
from tests.manager.test_resume import trialstream

TRIAL = """
import time, trialstream_sdk as nni
x = nni.get_next_parameter()["x"]
time.sleep(2.0)
nni.report_final_result(x)
"""
MAX_TRIALS = 6


@pytest.mark.timeout(150)
def test_a_runner_that_lost_its_claim_stops_without_submitting(
    tmp_path: Path, processes: Processes, redis_url: str, client: redis.Redis
) -> None:
    (tmp_path / "trial.py").write_text(TRIAL)
    config = {
        "trialCommand": f"{sys.executable} trial.py",
        "trialCodeDirectory": str(tmp_path),
        "trialConcurrency": 2,
        "maxTrialNumber": MAX_TRIALS,
        "searchSpace": {"x": {"_type": "uniform", "_value": [0, 1]}},
        "tuner": {"name": "Random", "classArgs": {"seed": 7}},
        "trainingService": {"platform": "local"},
        "experimentWorkingDirectory": str(tmp_path / "experiments"),
    }
    (tmp_path / "config.yml").write_text(json.dumps(config))
    processes.projector()
    processes.worker()
    processes.worker()

    first = trialstream(redis_url, "run", str(tmp_path / "config.yml"), "--json")
    resumed = None
    try:
        experiment_id = str(
            wait_until(lambda: cast(list[str], client.zrange(keys.EXPERIMENTS, 0, -1)), 30, what="the experiment")[0]
        )
        claim = keys.runner(experiment_id)
        views = ViewStore(client, experiment_id)
        wait_until(lambda: any(t.status == "RUNNING" for t in views.trials()), 30, what="a trial running")
        first_holder = client.get(claim)
        assert first_holder is not None

        first.send_signal(signal.SIGSTOP)  # stalled: it cannot renew its claim
        wait_until(lambda: not client.exists(claim), 30, interval=0.1, what="the stalled runner's claim to lapse")
        resumed = trialstream(redis_url, "resume", experiment_id, "--json")
        wait_until(lambda: client.get(claim) not in (None, first_holder), 30, what="the new runner's claim")
        first.send_signal(signal.SIGCONT)

        _, first_errors = first.communicate(timeout=30)
        assert first.returncode != 0
        assert "lost its claim" in first_errors, first_errors

        output, errors = resumed.communicate(timeout=90)
        assert resumed.returncode == 0, errors
    finally:
        for process in (first, resumed):
            if process is not None and process.poll() is None:
                process.send_signal(signal.SIGCONT)
                process.kill()

    submitted = Counter(
        e.event.form.sequence_id
        for e in EventStore(client, experiment_id).read()
        if isinstance(e, StoredEvent) and isinstance(e.event, TrialSubmitted)
    )
    assert max(submitted.values()) == 1, submitted  # no sequence id submitted by both runners
    assert sorted(submitted) == list(range(MAX_TRIALS))  # maxTrialNumber holds
    trials = json.loads(output)["trials"]
    assert {trial["status"] for trial in trials} == {"SUCCEEDED"}  # the stalled runner stopped none of them


def test_a_claim_that_only_lapsed_is_taken_back_and_one_taken_over_is_not(
    tmp_path: Path, client: redis.Redis, rq_connection: redis.Redis
) -> None:
    """Redis paused or restarted past the claim's TTL: nobody claimed the experiment since (the epoch
    is still this runner's), so the runner goes on. Once another runner has claimed it, it stops."""
    (tmp_path / "config.yml").write_text(
        json.dumps(
            {
                "trialCommand": "true",
                "trialCodeDirectory": str(tmp_path),
                "trialConcurrency": 1,
                "searchSpace": {"x": {"_type": "uniform", "_value": [0, 1]}},
                "trainingService": {"platform": "local"},
                "experimentWorkingDirectory": str(tmp_path / "experiments"),
            }
        )
    )
    runner = ExperimentRunner.create(load_experiment_config(tmp_path / "config.yml"), client, rq_connection)
    claim = keys.runner(runner.experiment_id)
    client.delete(claim)  # as if it expired while Redis could not answer
    runner._claim._renewed_at = 0.0  # due for renewal
    runner._keep_claim()
    assert client.get(claim) == runner._name

    client.set(claim, "runner:elsewhere:1:x")  # a resume took it meanwhile...
    client.incr(keys.runner_epoch(runner.experiment_id))
    client.delete(claim)  # ...and its claim lapsed too: still not ours to take back
    runner._claim._renewed_at = 0.0
    with pytest.raises(ClaimLost):
        runner._keep_claim()
