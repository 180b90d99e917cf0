"""NNI's own Python client (`nni.experiment.Experiment.connect(port)`) and nnictl's read commands, end to end,
against one real `trialstream manager --nnictl-registry` that the tests share (each runs experiments of its
own), with a real worker and real gated trials (tests/api/test_api.py: each waits for `gates/<trial>` or
`gates/all`). The client reaches an experiment at the port nnictl's registry gives it, as nnictl does."""

from __future__ import annotations

import csv
import json
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import pytest
import redis
from nni.experiment import Experiment, ExperimentConfig, TrialJob

from core import keys
from core.connections import connect
from core.event_store import EventStore
from core.keys import ViewKeys
from manager.archive.moves import archive, archived
from manager.archive.stores import open_store
from schemas.events import ClusterMetadataSet
from simulators.waiting import wait_until
from tests.api.test_api import write_trial
from tests.api.test_api_smoke import experiment_config
from tests.api.test_nnictl import nnictl
from tests.conftest import Processes
from tests.support import web

BUSY_EXPERIMENT = "0-busy"  # sorts before every generated id: the projector folds its log first in each round
BUSY_EVENTS = 30_000


@dataclass
class Manager:
    """The shared manager, its HOME (nnictl's registry is `<home>/nni-experiments/.experiment`), and helpers."""

    url: str
    home: Path
    root: Path
    process: subprocess.Popen[bytes]
    client: redis.Redis

    def create(
        self, name: str, trials: int, concurrency: int = 1, released: bool = False, **overrides: Any
    ) -> tuple[str, Path]:
        code = write_trial(self.root / name)
        if released:
            (code / "gates" / "all").touch()
        config = experiment_config(code, trials, concurrency, experimentName=name, **overrides)
        created = web.post(f"{self.url}/api/v1/experiments", json={"config": config}, timeout=30)
        assert created.status_code == 201, created.text
        return str(created.json()["id"]), code

    def entry(self, experiment_id: str) -> dict[str, Any]:
        registry = self.home / "nni-experiments" / ".experiment"
        entries: dict[str, dict[str, Any]] = json.loads(registry.read_text()) if registry.exists() else {}
        return entries.get(experiment_id, {})

    def port(self, experiment_id: str) -> int:
        return int(wait_until(lambda: self.entry(experiment_id).get("port"), 30, what="the registry entry"))

    def status(self, experiment_id: str) -> str:
        return str(web.get(f"{self.url}/api/v1/experiments/{experiment_id}", timeout=30).json()["status"])

    def trials(self, experiment_id: str) -> list[dict[str, Any]]:
        answer = web.get(f"{self.url}/api/v1/experiments/{experiment_id}/trials", timeout=30)
        return list(answer.json()["items"])

    def running_trial(self, experiment_id: str) -> str:
        running = wait_until(
            lambda: [t["id"] for t in self.trials(experiment_id) if t["status"] == "RUNNING"], 30, what="a trial"
        )
        return str(running[0])


pytestmark = pytest.mark.xdist_group("nni-client")  # one manager for the module, on one pytest worker


@pytest.fixture(scope="module")
def manager(module_processes: Processes, tmp_path_factory: pytest.TempPathFactory) -> Manager:
    root = tmp_path_factory.mktemp("nni-client")
    home = root / "home"
    home.mkdir()
    module_processes.worker(args=("--concurrency", "6"))
    url = module_processes.manager("--nnictl-registry", env={"HOME": str(home)})
    return Manager(url, home, root, module_processes.running[-1], connect(module_processes.redis_url))


def test_the_client_and_nnictl_read_an_experiment(manager: Manager) -> None:
    experiment_id, _ = manager.create("reads", trials=3, concurrency=3, released=True)
    port = manager.port(experiment_id)
    wait_until(
        lambda: manager.status(experiment_id) == manager.entry(experiment_id)["status"] == "DONE",
        60,
        what="the experiment to finish, in the views and in nnictl's registry",
    )

    experiment = Experiment.connect(port)
    assert experiment.id == experiment_id and experiment.get_status() == "DONE"
    profile = experiment.get_experiment_profile()
    assert profile["id"] == experiment_id and profile["params"]["maxTrialNumber"] == 3
    metadata = experiment.get_experiment_metadata(experiment_id)
    assert (metadata["port"], metadata["status"], metadata["experimentName"]) == (port, "DONE", "reads")
    pid = metadata["pid"]  # the experiment's own process: alive while the manager keeps it open
    assert pid == manager.entry(experiment_id)["pid"] and pid != manager.process.pid and psutil.pid_exists(pid)

    jobs = experiment.list_trial_jobs()
    assert [job.sequenceId for job in jobs] == [0, 1, 2] and {job.status for job in jobs} == {"SUCCEEDED"}
    one = experiment.get_trial_job(jobs[1].trialJobId)
    assert isinstance(one, TrialJob) and one.trialJobId == jobs[1].trialJobId
    assert experiment.get_job_statistics() == [{"trialJobStatus": "SUCCEEDED", "trialJobNumber": 3}]
    metrics = experiment.get_job_metrics()
    assert set(metrics) == {job.trialJobId for job in jobs}
    for job in jobs:
        assert [(m.type, m.data) for m in metrics[job.trialJobId]] == [
            ("PERIODICAL", 0.5),
            ("FINAL", job.hyperParameters[0].parameters["x"]),
        ]
    assert list(experiment.get_job_metrics(jobs[0].trialJobId)) == [jobs[0].trialJobId]
    exported = {result.trialJobId: result for result in experiment.export_data()}
    assert set(exported) == {job.trialJobId for job in jobs}
    for job in jobs:
        assert exported[job.trialJobId].parameter == job.hyperParameters[0].parameters
        assert exported[job.trialJobId].value == job.finalMetricData[0].data

    home = manager.home
    listed = nnictl(home, "experiment", "list")
    assert experiment_id in listed and "reads" in listed and "DONE" in listed
    shown = nnictl(home, "experiment", "show", experiment_id)
    assert json.loads(shown[shown.index("{") :])["params"]["maxTrialNumber"] == 3
    assert json.loads(nnictl(home, "experiment", "status", experiment_id))["status"] == "DONE"
    listed_trials = nnictl(home, "trial", "ls", experiment_id)
    assert all(job.trialJobId in listed_trials for job in jobs), listed_trials
    as_json, as_csv = manager.root / "reads.json", manager.root / "reads.csv"
    nnictl(home, "experiment", "export", experiment_id, "--type", "json", "--filename", str(as_json))
    assert {row["trialJobId"] for row in json.loads(as_json.read_text())} == set(exported)
    nnictl(home, "experiment", "export", experiment_id, "--type", "csv", "--filename", str(as_csv))
    with as_csv.open(newline="") as file:
        rows = list(csv.DictReader(file))
    assert {row["trialJobId"]: float(row["reward"]) for row in rows} == {
        trial_id: result.value for trial_id, result in exported.items()
    }
    assert {float(row["x"]) for row in rows} == {result.parameter["x"] for result in exported.values()}

    deleted = web.delete(f"{manager.url}/api/v1/experiments/{experiment_id}", timeout=30)
    assert deleted.status_code == 200 and not psutil.pid_exists(pid)  # its process goes with it


def test_the_client_reads_the_profile_params_back_as_nni_config(manager: Manager) -> None:
    """The profile's params are NNI's canonical config for the config sent (NNI's launcher sends
    `ExperimentConfig.json()`, its manager serves it back): NNI's client reads them as its ExperimentConfig, a
    trialstream key (maxTrialRetries) left out, and an update keeps the form the client sent."""
    durations: dict[str, Any] = {"maxExperimentDuration": "1h", "maxTrialDuration": "10m"}
    experiment_id, code = manager.create("canonical", trials=1, released=True, maxTrialRetries=2, **durations)
    experiment = Experiment.connect(manager.port(experiment_id))
    params = experiment.get_experiment_profile()["params"]

    sent = experiment_config(code, 1, 1, experimentName="canonical", **durations)
    assert params == ExperimentConfig(**sent).json()
    experiment.config = ExperimentConfig(**params)  # what a script of NNI's does with them
    assert experiment.config.json() == params
    shown = nnictl(manager.home, "experiment", "show", experiment_id)
    assert json.loads(shown[shown.index("{") :])["params"] == params

    experiment.update_max_experiment_duration("2h")
    params = experiment.get_experiment_profile()["params"]
    assert params["maxExperimentDuration"] == "2h" and ExperimentConfig(**params).json() == params
    wait_until(lambda: experiment.get_status() == "DONE", 60, what="the experiment to finish")


def test_stop_stops_that_experiment_alone_and_returns(manager: Manager) -> None:
    """`stop()` sends DELETE /experiment, then waits for the pid it took for the experiment's manager (and
    SIGTERMs it if anything failed): that is the experiment's own process, so the wait ends once the experiment
    has stopped, and nothing else stops."""
    stopped, _ = manager.create("stopped", trials=2)
    other, other_code = manager.create("other", trials=1)
    manager.running_trial(stopped)
    manager.running_trial(other)
    experiment = Experiment.connect(manager.port(stopped))
    pid = experiment.get_experiment_metadata(stopped)["pid"]

    stopping = threading.Thread(target=experiment.stop, daemon=True)  # a wait that never ends fails, not hangs
    stopping.start()
    stopping.join(60)
    assert not stopping.is_alive() and experiment.port is None
    assert not psutil.pid_exists(pid)  # it returned once the process had ended (reaped: no zombie)
    assert manager.status(stopped) == "STOPPED"
    assert {t["status"] for t in manager.trials(stopped)} == {"SYS_CANCELED"}
    wait_until(lambda: manager.entry(stopped)["status"] == "STOPPED", 30, what="the registry entry, STOPPED")

    assert manager.process.poll() is None  # the manager serves on, and its other experiment runs on
    # NNI's registry says NO_MORE_TRIAL for a running experiment once its maxTrialNumber is submitted
    assert manager.status(other) == "RUNNING" and manager.entry(other)["status"] in ("RUNNING", "NO_MORE_TRIAL")
    assert psutil.pid_exists(manager.entry(other)["pid"])
    (other_code / "gates" / "all").touch()
    wait_until(lambda: manager.status(other) == "DONE", 60, what="the other experiment to finish")


def test_an_update_after_a_rest_longer_than_its_duration_runs_the_extra_trials(manager: Manager) -> None:
    """NNI counts against maxExperimentDuration only the time an experiment runs (its execDuration): one that
    rested DONE past its duration runs the trial an update adds; the rest counted, it was DONE again at once."""
    experiment_id, _ = manager.create("rested", trials=1, released=True, maxExperimentDuration="6s")
    experiment = Experiment.connect(manager.port(experiment_id))
    wait_until(lambda: experiment.get_status() == "DONE", 60, what="the experiment to finish")
    started_ms = experiment.get_experiment_profile()["startTime"]
    wait_until(lambda: time.time() * 1000 > started_ms + 7_000, 30, what="a rest past its 6 s")

    experiment.update_max_trial_number(2)
    wait_until(lambda: len(experiment.list_trial_jobs()) == 2, 60, what="the extra trial")
    wait_until(lambda: experiment.get_status() == "DONE", 60, what="the experiment to finish again")
    assert {job.status for job in experiment.list_trial_jobs()} == {"SUCCEEDED"}
    assert experiment.get_experiment_profile()["execDuration"] < 6  # its runs, not the rest between them


def test_an_update_takes_a_done_experiment_up_again(manager: Manager) -> None:
    """NNI's manager goes on with a finished experiment whose limits are raised: RUNNING again at once, the
    extra trials run, DONE again. Refusals are NNI's `{"error"}` with a 4xx."""
    experiment_id, code = manager.create("more", trials=1, released=True)
    port = manager.port(experiment_id)
    wait_until(lambda: manager.status(experiment_id) == "DONE", 60, what="the experiment to finish")
    experiment = Experiment.connect(port)
    pid = manager.entry(experiment_id)["pid"]
    wait_until(lambda: not manager.client.exists(keys.runner(experiment_id)), 30, what="the runner to let go")
    archive(manager.client, experiment_id, open_store(str(manager.root / "archive")))  # the update brings it back

    experiment.update_max_trial_number(3)
    assert archived(manager.client, experiment_id) is None
    # running again as the answer came: NO_MORE_TRIAL once the runner has submitted the two extra trials
    assert experiment.get_status() in ("RUNNING", "NO_MORE_TRIAL")
    assert experiment.get_experiment_profile()["params"]["maxTrialNumber"] == 3
    wait_until(lambda: experiment.get_status() == "DONE", 60, what="the extra trials to run")
    jobs = experiment.list_trial_jobs()
    assert [job.sequenceId for job in jobs] == [0, 1, 2] and {job.status for job in jobs} == {"SUCCEEDED"}
    wait_until(lambda: manager.entry(experiment_id)["status"] == "DONE", 30, what="the registry entry, DONE")
    assert manager.entry(experiment_id)["pid"] == pid  # one process, kept open through DONE

    experiment.update_trial_concurrency(2)  # taken, though it gives no more trials: DONE again
    experiment.update_max_experiment_duration("1h")
    experiment.update_search_space({"x": {"_type": "choice", "_value": [0.25]}})
    params = experiment.get_experiment_profile()["params"]
    assert (params["trialConcurrency"], params["maxExperimentDuration"]) == (2, "1h")  # as NNI keeps it
    assert params["searchSpace"] == {"x": {"_type": "choice", "_value": [0.25]}}
    assert "success" in nnictl(manager.home, "update", "concurrency", experiment_id, "--value", "3")
    assert experiment.get_experiment_profile()["params"]["trialConcurrency"] == 3
    wait_until(lambda: experiment.get_status() == "DONE", 60, what="the experiment to finish again")
    assert len(experiment.list_trial_jobs()) == 3

    nni = f"http://127.0.0.1:{port}/api/v1/nni"
    profile = experiment.get_experiment_profile()
    invalid = web.put(
        f"{nni}/experiment",
        params={"update_type": "MAX_TRIAL_NUM"},
        json={**profile, "params": {**profile["params"], "maxTrialNumber": 0}},
    )
    assert invalid.status_code == 400 and "maxTrialNumber" in invalid.json()["error"], invalid.text

    (code / "gates" / "all").unlink()  # the next trial waits: stopped while it runs
    experiment.update_max_trial_number(4)
    manager.running_trial(experiment_id)
    experiment.stop()  # the same process, kept through DONE, ends once the experiment has STOPPED
    assert not psutil.pid_exists(pid) and manager.status(experiment_id) == "STOPPED"
    refused = web.put(f"{nni}/experiment", params={"update_type": "MAX_TRIAL_NUM"}, json=profile)
    assert refused.status_code == 409 and "STOPPED" in refused.json()["error"], refused.text
    customized = web.post(f"{nni}/trial-jobs", json={"x": 0.5})
    assert customized.status_code == 409 and "error" in customized.json()


def test_a_write_is_read_at_once_while_the_projector_is_busy(manager: Manager) -> None:
    """NNI's manager changes the profile before it answers: a read right after an update shows it, here while
    the projector works through another experiment's long log (it folds that one first in each round)."""
    experiment_id, code = manager.create("reads-writes", trials=1)
    experiment = Experiment.connect(manager.port(experiment_id))
    manager.running_trial(experiment_id)
    busy = EventStore(manager.client, BUSY_EXPERIMENT)
    busy.append_all([ClusterMetadataSet(experiment_id=BUSY_EXPERIMENT, key="k", value="v")] * BUSY_EVENTS)
    busy_keys = ViewKeys(BUSY_EXPERIMENT)

    def busy_applied() -> int:
        return int(manager.client.hget(busy_keys.position, "applied") or 0)

    wait_until(lambda: busy_applied() > 0, 30, what="the projector to take the long log up")
    reads: list[tuple[int, Any]] = []
    while busy_applied() < BUSY_EVENTS:  # every write and read of this loop but the last: the projector is busy
        concurrency = 2 + len(reads) % 2
        experiment.update_trial_concurrency(concurrency)
        reads.append((concurrency, experiment.get_experiment_profile()["params"]["trialConcurrency"]))
    assert len(reads) >= 3, "the projector caught up too soon to tell"
    assert [read for read in reads if read[0] != read[1]] == []

    experiment.update_max_trial_number(2)
    assert experiment.get_experiment_profile()["params"]["maxTrialNumber"] == 2
    experiment.update_max_experiment_duration("2h")
    assert experiment.get_experiment_profile()["params"]["maxExperimentDuration"] == "2h"
    space = {"x": {"_type": "choice", "_value": [0.5, 0.75]}}
    experiment.update_search_space(space)
    assert experiment.get_experiment_profile()["params"]["searchSpace"] == space
    (code / "gates" / "all").touch()
    wait_until(lambda: experiment.get_status() == "DONE", 60, what="the experiment to finish")
    assert len(experiment.list_trial_jobs()) == 2
