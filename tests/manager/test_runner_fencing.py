"""A runner that stalls past its claim and wakes next to a `resume` stops, instead of submitting twice."""

from __future__ import annotations

import json
import signal
import sys
import threading
from collections import Counter
from pathlib import Path
from typing import TypeVar, cast

import pytest
import redis

from core import keys
from core.event_store import EventStore, StoredEvent
from core.queueing import trial_queue
from core.settings import Settings
from manager.config import load_experiment_config
from manager.runner import ClaimLost, ExperimentRunner
from manager.runner_claim import RunnerClaim
from manager.views import ViewStore
from schemas.events import (
    CustomizedTrialNumbered,
    CustomizedTrialRequested,
    Event,
    TrialEnded,
    TrialStarted,
    TrialSubmitted,
)
from tests.conftest import Processes, wait_until
from tests.manager.test_resume import trialstream

TRIAL = """
import time, trialstream_sdk as nni
x = nni.get_next_parameter()["x"]
time.sleep(2.0)
nni.report_final_result(x)
"""
MAX_TRIALS = 6
E = TypeVar("E", bound=Event)


def logged(store: EventStore, kind: type[E]) -> list[E]:
    return [entry.event for entry in store.read() if isinstance(entry, StoredEvent) and isinstance(entry.event, kind)]


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


@pytest.mark.parametrize("requested", ["before the takeover", "after the takeover"])
def test_a_runner_superseded_after_its_last_keep_is_refused_by_the_log_and_stops(
    tmp_path: Path, client: redis.Redis, rq_connection: redis.Redis, requested: str
) -> None:
    """keep() asks Redis once per renew_s and otherwise answers from memory: a runner that stalls after it, past
    its lease, while a `resume` takes the claim, wakes with nothing but the log to stop it. Its next write is a
    customized trial's submission (numbered before the takeover, a slot freed after) or its numbering (asked for
    after): the log refuses it, the runner stops with ClaimLost, and nothing of it is written or left queued."""
    (tmp_path / "config.yml").write_text(
        json.dumps(
            {
                "trialCommand": "true",
                "trialCodeDirectory": str(tmp_path),
                "trialConcurrency": 1,
                "maxTrialNumber": 5,
                "searchSpace": {"x": {"_type": "uniform", "_value": [0, 1]}},
                "tuner": {"name": "Random", "classArgs": {"seed": 7}},
                "trainingService": {"platform": "local"},
                "experimentWorkingDirectory": str(tmp_path / "experiments"),
            }
        )
    )
    runner = ExperimentRunner.create(load_experiment_config(tmp_path / "config.yml"), client, rq_connection)
    experiment_id = runner.experiment_id
    store = EventStore(client, experiment_id)  # the test's own appends: the API's and a worker's, unfenced
    runner._claim.renew_s = float("inf")  # every keep() answers from memory, as within renew_s of the last renewal
    errors: list[BaseException] = []

    def run() -> None:
        try:
            runner.run()
        except BaseException as error:
            errors.append(error)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        [first] = wait_until(lambda: logged(store, TrialSubmitted), 10, what="the first trial's submission")
        if requested == "before the takeover":  # numbered at once, submitted once the running trial ends
            request = store.append(CustomizedTrialRequested(experiment_id=experiment_id, parameters={"x": 0.5}))
            wait_until(lambda: logged(store, CustomizedTrialNumbered), 10, what="the customized trial's number")

        client.delete(keys.runner(experiment_id))  # the runner stalled past its lease...
        assert RunnerClaim(client, experiment_id, "runner:resumed", lease_s=30).take(wait_s=0)  # ...and a resume
        takeover = store.head()

        if requested == "before the takeover":  # the running trial ends: the runner submits into its slot
            attempt = {"experiment_id": experiment_id, "trial_id": first.trial_id, "attempt": 1}
            appended = [  # as a worker records a trial's run
                store.append(TrialStarted.model_validate({**attempt, "working_directory": str(tmp_path)})),
                store.append(TrialEnded.model_validate({**attempt, "status": "SUCCEEDED", "exit_code": 0})),
            ]
        else:  # the runner numbers it as soon as it reads it
            appended = [store.append(CustomizedTrialRequested(experiment_id=experiment_id, parameters={"x": 0.5}))]
            request = appended[0]
        thread.join(10)
        assert not thread.is_alive(), "the superseded runner did not stop"
    finally:
        runner.detach()
        thread.join(10)

    [error] = errors
    assert (
        isinstance(error, ClaimLost) and "lost its claim" in str(error) and "runner:resumed runs it now" in str(error)
    )
    assert [entry.id for entry in store.read(after=takeover)] == appended  # the runner wrote nothing after it
    assert not any(submitted.requested_by == request for submitted in logged(store, TrialSubmitted))
    queued = trial_queue("local", rq_connection).get_jobs()
    assert [job.args for job in queued] == [[experiment_id, first.trial_id, 1]]  # no job of a refused submission
    assert len(list(rq_connection.scan_iter("rq:job:*"))) == 1
    assert client.get(keys.runner(experiment_id)) == "runner:resumed"


TAKER = """
import pathlib, redis
from nni.tuner import Tuner


class Taker(Tuner):
    '''Random enough for the test; the second time it is built (the resume), another runner takes the claim.'''

    def __init__(self, url, claim, epoch, built):
        self.takes = pathlib.Path(built).exists()
        pathlib.Path(built).touch()
        self.claim, self.epoch, self.client = claim, epoch, redis.Redis.from_url(url)

    def update_search_space(self, search_space):
        if self.takes:
            self.client.set(self.claim, "runner:elsewhere")
            self.client.incr(self.epoch)

    def generate_parameters(self, parameter_id, **kwargs):
        return {"x": 0.5}

    def receive_trial_result(self, parameter_id, parameters, value, **kwargs):
        pass
"""


def test_a_resume_taken_over_as_it_starts_stops_and_leaves_no_tuner_running(
    tmp_path: Path, redis_url: str, client: redis.Redis, rq_connection: redis.Redis
) -> None:
    """Another runner takes the claim while a resumed one builds its tuner: the resumed one's first append
    (ExperimentResumed) is refused, it stops with ClaimLost saying so, and the tuner it started does not live on
    (a manager runs many experiments in one process)."""
    (tmp_path / "algorithms").mkdir()
    (tmp_path / "algorithms" / "taker.py").write_text(TAKER)
    config = {
        "trialCommand": "true",
        "trialCodeDirectory": str(tmp_path),
        "trialConcurrency": 1,
        "maxTrialNumber": 1,
        "searchSpace": {"x": {"_type": "uniform", "_value": [0, 1]}},
        "tuner": {"codeDirectory": str(tmp_path / "algorithms"), "className": "taker.Taker", "classArgs": {}},
        "trainingService": {"platform": "local"},
        "experimentWorkingDirectory": str(tmp_path / "experiments"),
    }

    def tuners() -> int:
        return sum(1 for thread in threading.enumerate() if thread.name == "tuner" and thread.is_alive())

    experiment_id = "taken"
    claim, epoch = keys.runner(experiment_id), keys.runner_epoch(experiment_id)
    class_args = {"url": redis_url, "claim": claim, "epoch": epoch, "built": str(tmp_path / "built")}
    config["tuner"]["classArgs"] = class_args  # type: ignore[index]
    (tmp_path / "config.yml").write_text(json.dumps(config))
    spec = load_experiment_config(tmp_path / "config.yml")
    created = ExperimentRunner.create(spec, client, rq_connection, experiment_id=experiment_id)
    assert created._tuner is not None
    created._tuner.close()  # the first runner crashed: its claim is gone, its tuner with it
    client.delete(claim)
    before = tuners()
    store = EventStore(client, experiment_id)
    head = store.head()

    with pytest.raises(ClaimLost) as lost:
        ExperimentRunner.resume(client, rq_connection, experiment_id, settings=Settings(runner_lease_s=3))
    assert "another runner took it while this one was starting" in str(lost.value), lost.value
    assert "runner:elsewhere runs it now" in str(lost.value), lost.value
    assert store.read(after=head) == []  # nothing of the resumed runner's is in the log
    assert tuners() == before, "the resumed runner's tuner lives on"
