"""Commands to a running experiment, at their edges: a stop whose runner died before carrying it out, a
customized trial's answer while another waits, an update landing as the runner finishes, a search space
changed before a resume, and results the ranking must not keep (NaN, a retried trial's old result)."""

from __future__ import annotations

import json
import math
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import cast

import pytest
import redis

from core.event_store import EventStore
from manager.config import load_experiment_config
from manager.projector import Projector
from manager.runner import ExperimentRunner, Progress
from manager.views import ViewStore
from schemas.events import (
    ExperimentChanges,
    ExperimentStopRequested,
    ExperimentUpdated,
    TrialAttemptLost,
    TrialMetricReported,
    TrialStarted,
)
from schemas.trial import TrialJobStatus
from simulators.processes import process_gone
from simulators.waiting import wait_until
from tests.api.test_api import Api, api_client, start_api
from tests.api.test_api_smoke import experiment_config
from tests.conftest import Processes, ServiceFactory, form
from tests.manager.test_tuner_driving import write_experiment


@pytest.fixture
def api(processes: Processes, tmp_path: Path) -> Iterator[Api]:
    """A manager and worker of the test's own: the first test kills its manager."""
    with api_client(start_api(processes), tmp_path / "code") as client:
        yield client


def test_a_stop_logged_while_no_runner_acts_on_it_is_carried_out_by_the_next_runner(
    api: Api,
    processes: Processes,
    client: redis.Redis,
) -> None:
    experiment_id = api.create(experiment_config(api.code, trials=6, concurrency=2))
    api.wait_running(experiment_id, 2)
    # the `manager` argument, not manager.cli (Processes.start gives Popen a list)
    manager = next(process for process in processes.running if "manager" in cast(list[str], process.args))
    pid = api.http.get("/nni/experiment-metadata").json()["pid"]  # the newest experiment: this one
    manager.kill()  # the runner dies with it: nothing will act on what is appended now
    manager.wait()
    wait_until(lambda: process_gone(pid), 30, what="the experiment's process to end with its manager")
    EventStore(client, experiment_id).append(ExperimentStopRequested(experiment_id=experiment_id, reason="enough"))

    url = processes.manager()  # resumes the experiments the last one ran; the stop was never answered
    api.http.base_url = f"{url}/api/v1"
    state = api.wait_status(experiment_id, "STOPPED", timeout=60)
    assert state["message"] == "enough"
    statuses = {trial["status"] for trial in api.trials(experiment_id)}
    assert statuses == {"SYS_CANCELED"}, statuses  # the two that ran; none submitted after the stop


def test_a_customized_trial_is_answered_with_its_own_sequence_id(api: Api) -> None:
    """Two requests at once, no slot free for either: each answer is its own trial's number, not the other's."""
    experiment_id = api.create(experiment_config(api.code, trials=5, concurrency=1))
    api.wait_running(experiment_id, 1)
    answers: dict[str, int] = {}

    def ask(x: float) -> None:
        answer = api.http.post(f"/experiments/{experiment_id}/trials", json={"parameters": {"x": x}})
        assert answer.status_code == 201, answer.text
        answers[str(x)] = answer.json()["sequenceId"]

    asking = [threading.Thread(target=ask, args=(x,)) for x in (0.25, 0.75)]
    for thread in asking:
        thread.start()
    for thread in asking:
        thread.join(60)
    assert sorted(answers.values()) == [1, 2], answers  # numbered at once, the running trial being 0
    api.release_all()
    api.wait_status(experiment_id, "DONE", timeout=60)
    by_sequence = {trial["sequenceId"]: parameters(trial) for trial in api.trials(experiment_id)}
    assert by_sequence[answers["0.25"]] == {"x": 0.25} and by_sequence[answers["0.75"]] == {"x": 0.75}


def test_an_update_landing_as_the_runner_finishes_is_carried_out(
    tmp_path: Path, served: Processes, client: redis.Redis, rq_connection: redis.Redis
) -> None:
    """The API took it (a 200): the runner, about to record DONE with its budget spent, must not drop it."""
    config = write_experiment(tmp_path, maxTrialNumber=1, trialConcurrency=1)
    runner = ExperimentRunner.create(load_experiment_config(config), client, rq_connection)
    more = ExperimentUpdated(experiment_id=runner.experiment_id, changes=ExperimentChanges(max_trial_number=2))
    updated: list[str] = []

    def update_once(progress: Progress) -> None:
        if not updated and progress.counts["SUCCEEDED"] == 1:  # all ran: reported just before it records DONE
            updated.append(runner.service.store.append(more))

    runner.on_progress = update_once
    result = runner.run()
    assert updated and [str(trial.status) for trial in result.trials] == ["SUCCEEDED"] * 2


def parameters(trial: dict[str, object]) -> object:
    return json.loads(trial["form"]["hyperParameters"]["value"])["parameters"]  # type: ignore[index]


def test_the_ranking_keeps_only_finite_current_results_and_a_rebuild_agrees(
    make_service: ServiceFactory, client: redis.Redis
) -> None:
    service = make_service()
    experiment_id = service.experiment_id
    store = EventStore(client, experiment_id)
    scores = {"nan": math.nan, "good": 0.5, "retried": 0.9}
    trials = {name: service.submit_trial_job(form(index)).id for index, name in enumerate(scores)}
    for name, score in scores.items():
        trial_id = trials[name]
        store.append(
            TrialStarted(experiment_id=experiment_id, trial_id=trial_id, attempt=1, working_directory="/", url="/")
        )
        store.append(
            TrialMetricReported(
                experiment_id=experiment_id,
                trial_id=trial_id,
                attempt=1,
                parameter_id=str(name),
                metric_type="FINAL",
                sequence=0,
                data=json.dumps(json.dumps(score)),
            )
        )
    projector = Projector(client)
    projector.catch_up(experiment_id)  # the retried trial is ranked before it is lost...
    store.append(
        TrialAttemptLost(
            experiment_id=experiment_id,
            trial_id=trials["retried"],
            attempt=1,
            status=TrialJobStatus.WAITING,
            reason="worker lost",
        )
    )
    projector.catch_up(experiment_id)  # ...and no longer once it starts again without a result

    views = ViewStore(client, experiment_id)
    assert list(views.trial_ids(order="metric")) == [trials["good"], trials["nan"], trials["retried"]]
    assert client.zrange(views.keys.ranking, 0, -1) == [trials["good"]]
    rebuilt = Projector(client, namespace="rebuilt")
    rebuilt.catch_up(experiment_id)
    assert client.zrange(ViewStore(client, experiment_id, "rebuilt").keys.ranking, 0, -1) == [trials["good"]]
