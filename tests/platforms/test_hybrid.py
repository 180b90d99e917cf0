"""Hybrid experiments (NNI's `trainingService` list): each trial is placed on one of the listed platforms,
where workers have room (round robin among those that do, else the least loaded), the placement is in the
log, the views, `trials list` and NNI's REST answers, and a retry after a lost worker is placed anew.

Every platform here is real or speaks the real wire format: local trials are processes, remote trials run
on real OpenSSH hosts (simulators/sshd.py), kubeflow trials are TFJobs of the simulated cluster (simulators/kubesim).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any, TypeVar

import pytest
import redis
import yaml
from rq import Queue
from rq.registry import FinishedJobRegistry

from core import keys
from core.event_store import StoredEvent
from core.queueing import queue_name
from core.settings import Settings
from core.variables import REDIS_URL_ENV
from manager.config import load_experiment_config
from manager.projection import apply_to_trial
from manager.projector import Projector
from manager.runner import ExperimentRunner, RunnerError
from manager.training_service import TrainingService
from manager.views import ViewStore
from schemas.config import ConfigError
from schemas.events import EVENT_ADAPTER, TrialAttemptLost, TrialSubmitted
from schemas.trial import TrialJobStatus
from schemas.upcasters import upcast
from simulators.sshd import SshHost, SshUser
from simulators.waiting import wait_until
from tests.conftest import Processes, ServiceFactory, form, wait_for_status
from tests.support import web
from tests.support.kube_setup import kubeflow_section
from tests.support.remote_setup import RemoteWorkers, remote_section
from tests.support.workers import PlatformWorkers

T = TypeVar("T")

# Holds until its `release` file exists, then reports its final result on stdout (as every platform reads it).
TRIAL = """
import json, os, sys, time

form = json.load(open(os.path.join(os.environ["NNI_SYS_DIR"], "parameter.cfg")))
params = form["parameters"]
deadline = time.time() + 120
while not os.path.exists(params["release"]) and time.time() < deadline:
    time.sleep(0.05)
record = {"parameter_id": form["parameter_id"], "type": "FINAL", "sequence": 0, "value": json.dumps(params["x"])}
print("NNISDK_MEb'" + json.dumps(record) + "'", flush=True)
"""

# The first run holds until interrupted (its worker is killed, and it with it); a later run ends at once.
HOLD_ONCE = """
import json, os, time

form = json.load(open(os.path.join(os.environ["NNI_SYS_DIR"], "parameter.cfg")))
marker = form["parameters"]["marker"]
if not os.path.exists(marker):
    open(marker, "a").close()
    while True:
        time.sleep(0.05)
record = {"parameter_id": form["parameter_id"], "type": "FINAL", "sequence": 0, "value": "1.0"}
print("NNISDK_MEb'" + json.dumps(record) + "'", flush=True)
"""


@pytest.fixture
def tmp_path(shared_tmp_path: Path) -> Path:
    """Trials on the sshd hosts (another user) read and write the markers these tests create."""
    return shared_tmp_path


def hybrid_service(make_service: ServiceFactory, code_dir: Path, sections: list[dict[str, Any]], **options: Any):
    (code_dir / "trial.py").write_text(textwrap.dedent(TRIAL))
    (code_dir / "hold_once.py").write_text(textwrap.dedent(HOLD_ONCE))
    script = options.pop("script", "trial.py")
    return make_service(f"{sys.executable} {script}", platform_config=sections, **options)


def events_of(service: TrainingService, kind: type[T]) -> list[T]:
    return [e.event for e in service.store.read() if isinstance(e, StoredEvent) and isinstance(e.event, kind)]


def nni_trial_jobs(base_url: str, experiment_id: str) -> dict[str, dict[str, Any]]:
    answer = web.get(f"{base_url}/nni/{experiment_id}/api/v1/nni/trial-jobs", timeout=10)
    answer.raise_for_status()
    return {job["trialJobId"]: job for job in answer.json()}


# ---------------------------------------------------------------- config


def write_config(directory: Path, training_service: Any) -> Path:
    (directory / "trial.py").write_text("print('hi')\n")
    config = {
        "trialCommand": "python3 trial.py",
        "trialCodeDirectory": ".",
        "trialConcurrency": 2,
        "maxTrialNumber": 2,
        "searchSpace": {"x": {"_type": "choice", "_value": [1, 2]}},
        "trainingService": training_service,
    }
    path = directory / "config.yml"
    path.write_text(yaml.safe_dump(config))
    return path


def test_a_list_of_platforms_is_one_experiment_on_all_of_them(tmp_path: Path) -> None:
    remote = {
        "platform": "remote",
        "machineList": [{"host": "10.0.0.12", "user": "alice", "password": "s3cret", "useActiveGpu": False}],
    }
    spec = load_experiment_config(write_config(tmp_path, [{"platform": "local"}, remote]))

    assert spec.hybrid and spec.platform_names == ["local", "remote"]
    stored = spec.as_event_config["trainingService"]
    assert [section["platform"] for section in stored] == ["local", "remote"]
    assert stored[1]["machineList"][0]["password"] == "**********"  # masked in the log ...
    assert spec.secrets == {"1.machineList.0.password": "s3cret"}  # ... kept beside it, by path from the list


def test_a_platform_listed_twice_is_refused_naming_both(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as refused:
        load_experiment_config(write_config(tmp_path, [{"platform": "local"}, {"platform": "local"}]))

    assert str(refused.value) == (
        f"{tmp_path / 'config.yml'}: trainingService.1.platform: local is listed twice (also trainingService.0); "
        "list each platform once, with all its machines or settings in one section"
    )


def test_a_listed_platform_failing_its_check_stops_the_experiment_before_any_trial(
    client: redis.Redis, rq_connection: redis.Redis, tmp_path: Path
) -> None:
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))  # bound, never listening: connections are refused
    port = closed.getsockname()[1]
    key = tmp_path / "id_ed25519"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=True, timeout=30)
    remote = {
        "platform": "remote",
        "machineList": [{"host": "127.0.0.1", "port": port, "user": "u", "sshKeyFile": str(key)}],
    }
    spec = load_experiment_config(write_config(tmp_path, [{"platform": "local"}, remote]))

    with pytest.raises(RunnerError) as refused:
        ExperimentRunner.create(spec, client, rq_connection)
    closed.close()

    lines = str(refused.value).splitlines()
    assert lines[0] == "trainingService.1 (remote): cannot run trials there:"
    assert f"u@127.0.0.1:{port}" in lines[1] and "connection refused" in lines[1]
    assert client.zcard(keys.EXPERIMENTS) == 0  # no experiment, no trial


# ---------------------------------------------------------------- local + remote (real sshd hosts)


def test_trials_go_where_workers_have_room_on_local_and_remote(
    processes: Processes,
    remote_workers: RemoteWorkers,
    ssh_hosts: list[SshHost],
    ssh_user: SshUser,
    make_service: ServiceFactory,
    code_dir: Path,
    tmp_path: Path,
) -> None:
    """One local slot and two remote ones: the first trial takes the local slot (round robin starts at the
    first listed), the next two the remote ones, and a fourth, with no room anywhere, goes to the least
    loaded platform (remote: 3 for 2 slots beats local's 2 for 1). Each is shown where it runs."""
    processes.worker("local")
    remote_workers.start(args=("--concurrency", "2"))
    service = hybrid_service(make_service, code_dir, [{"platform": "local"}, remote_section(ssh_hosts, ssh_user)])
    release = tmp_path / "release"
    placed = []
    for sequence in range(4):
        trial = service.submit_trial_job(form(sequence, x=sequence, release=str(release)))
        placed.append(trial.platform)
        if sequence < 3:  # running, so the next placement counts it
            wait_for_status(service, trial.id, "RUNNING", timeout=60)
    assert placed == ["local", "remote", "remote", "remote"]
    assert [event.platform for event in events_of(service, TrialSubmitted)] == placed  # the log says where each went

    release.touch()
    trials = [wait_for_status(service, trial.id, "SUCCEEDED", timeout=60) for trial in service.list_trial_jobs()]
    assert [(trial.platform, trial.final_metric) for trial in trials] == [
        ("local", 0),
        ("remote", 1),
        ("remote", 2),
        ("remote", 3),
    ]
    base_url = processes.manager()  # NNI's REST answers carry the platform as an extra field

    def all_answered() -> dict[str, dict[str, Any]] | None:
        found = nni_trial_jobs(base_url, service.experiment_id)
        return found if len(found) == len(trials) else None

    jobs = wait_until(all_answered, 30, what="NNI's answer to list every trial")
    assert {trial_id: job["platform"] for trial_id, job in jobs.items()} == {t.id: t.platform for t in trials}

    listed = subprocess.run(
        [sys.executable, "-m", "manager.cli", "trials", "list", "-e", service.experiment_id],
        env={**os.environ, REDIS_URL_ENV: processes.redis_url},
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    cells = [[cell.strip() for cell in line.replace("┃", "│").split("│")] for line in listed.splitlines()]
    header = next(row for row in cells if "platform" in row)
    shown = {row[header.index("id")]: row[header.index("platform")] for row in cells if len(row) == len(header)}
    assert {trial.id: shown[trial.id] for trial in trials} == {trial.id: trial.platform for trial in trials}


def test_a_retry_after_a_lost_worker_is_placed_anew_and_replays_the_same(
    processes: Processes,
    remote_workers: RemoteWorkers,
    ssh_hosts: list[SshHost],
    ssh_user: SshUser,
    make_service: ServiceFactory,
    code_dir: Path,
    tmp_path: Path,
    client: redis.Redis,
) -> None:
    """A local trial whose worker is killed is retried on remote: the local platform's only worker is gone
    (its slot still counted as taken), remote has room. The log records where the retry went, and a
    rebuild of the views from the log shows the same."""
    lease = {"TRIALSTREAM_TRIAL_LEASE_S": "2"}
    local = processes.worker("local", env=lease)
    remote_workers.start(env=lease, args=("--concurrency", "2"))
    service = hybrid_service(
        make_service,
        code_dir,
        [{"platform": "local"}, remote_section(ssh_hosts, ssh_user)],
        script="hold_once.py",
        max_retries=1,
    )
    held = tmp_path / "held"
    trial = service.submit_trial_job(form(0, marker=str(held)))
    assert trial.platform == "local"
    wait_until(held.exists, 60, what="the first attempt to run")

    local.send_signal(signal.SIGKILL)
    local.wait()
    done = wait_for_status(service, trial.id, "SUCCEEDED", timeout=90)

    assert (done.platform, done.attempt, done.final_metric) == ("remote", 2, 1.0)
    [lost] = [
        e.event for e in service.store.read() if isinstance(e, StoredEvent) and isinstance(e.event, TrialAttemptLost)
    ]
    assert (lost.attempt, lost.status, lost.retry_platform) == (1, TrialJobStatus.WAITING, "remote")

    Projector(client, namespace="scratch").rebuild(service.experiment_id)
    [rebuilt] = ViewStore(client, service.experiment_id, "scratch").trials()
    assert (rebuilt.platform, rebuilt.attempt, rebuilt.status) == ("remote", 2, TrialJobStatus.SUCCEEDED)


def test_an_experiment_on_local_and_remote_runs_to_its_end_on_both(
    processes: Processes,
    remote_workers: RemoteWorkers,
    ssh_hosts: list[SshHost],
    ssh_user: SshUser,
    client: redis.Redis,
    rq_connection: redis.Redis,
    tmp_path: Path,
) -> None:
    """The whole experiment loop: the runner submits, each trial is placed (the first on local, the second
    on remote: round robin while both have room), every trial succeeds, the experiment is DONE, and each
    listed platform is asked to clean up after it."""
    processes.projector()
    processes.worker("local")
    remote_workers.start(args=("--concurrency", "2"))
    (tmp_path / "release").touch()  # the trials end at once
    (tmp_path / "trial.py").write_text(textwrap.dedent(TRIAL))
    config = {
        "trialCommand": f"{sys.executable} trial.py",
        "trialCodeDirectory": ".",
        "trialConcurrency": 2,
        "maxTrialNumber": 4,
        "searchSpace": {
            "x": {"_type": "choice", "_value": [1, 2, 3]},
            "release": {"_type": "choice", "_value": [str(tmp_path / "release")]},
        },
        "experimentWorkingDirectory": str(tmp_path / "experiments"),
        "trainingService": [{"platform": "local"}, remote_section(ssh_hosts, ssh_user)],
    }
    (tmp_path / "config.yml").write_text(yaml.safe_dump(config))
    settings = Settings.from_environment({"TRIALSTREAM_KNOWN_HOSTS": str(remote_workers.known_hosts)})
    runner = ExperimentRunner.create(
        load_experiment_config(tmp_path / "config.yml"), client, rq_connection, settings=settings
    )
    result = runner.run()

    assert [trial.status for trial in result.trials] == [TrialJobStatus.SUCCEEDED] * 4
    assert [trial.platform for trial in result.trials[:2]] == ["local", "remote"]
    assert {trial.platform for trial in result.trials} == {"local", "remote"}
    assert TrainingService(client, rq_connection, runner.experiment_id).experiment_view().status == "DONE"

    def cleaned_up(platform: str) -> bool:
        finished = FinishedJobRegistry(queue=Queue(queue_name(platform), connection=rq_connection))
        return any("--clean-up-" in job_id for job_id in finished.get_job_ids())

    wait_until(lambda: cleaned_up("local") and cleaned_up("remote"), 60, what="both platforms to clean up")


# ---------------------------------------------------------------- local + a simulated Kubernetes cluster


def test_local_and_kubeflow_take_turns_while_both_have_room(
    processes: Processes, kubeconfig: Path, make_service: ServiceFactory, code_dir: Path, tmp_path: Path
) -> None:
    processes.worker("local", args=("--concurrency", "2"))
    PlatformWorkers(processes, "kubeflow").start(args=("--concurrency", "2"))
    service = hybrid_service(make_service, code_dir, [{"platform": "local"}, kubeflow_section(kubeconfig)])
    release = tmp_path / "release"
    placed = []
    for sequence in range(4):
        trial = service.submit_trial_job(form(sequence, x=sequence, release=str(release)))
        placed.append(trial.platform)
        wait_for_status(service, trial.id, "RUNNING", timeout=60)
    assert placed == ["local", "kubeflow", "local", "kubeflow"]

    release.touch()
    trials = [wait_for_status(service, t.id, "SUCCEEDED", timeout=90) for t in service.list_trial_jobs()]
    assert [(trial.platform, trial.final_metric) for trial in trials] == [
        ("local", 0),
        ("kubeflow", 1),
        ("local", 2),
        ("kubeflow", 3),
    ]


# ---------------------------------------------------------------- old logs


def test_v1_submissions_and_lost_attempts_read_as_placed_where_they_always_ran() -> None:
    """Before hybrid experiments a trial had one platform: a v1 TrialSubmitted has no list of sections, and
    a v1 TrialAttemptLost's retry ran where the lost attempt had (the view keeps the trial's platform)."""
    launch = {"command": "true", "codeDirectory": "/code", "platformConfig": {"platform": "local"}}
    submitted = {"type": "TrialSubmitted", "v": 1, "experimentId": "e", "trialId": "t", "platform": "local"}
    submitted |= {"form": form(0).model_dump(by_alias=True), "workingDirectory": "/w", "launch": launch}
    lost = {"type": "TrialAttemptLost", "v": 1, "experimentId": "e", "trialId": "t", "attempt": 1}
    lost |= {"worker": "w", "reason": "gone", "status": "WAITING"}

    events = [EVENT_ADAPTER.validate_python(upcast(payload)) for payload in (submitted, lost)]
    assert isinstance(events[0], TrialSubmitted) and events[0].v == 2 and events[0].launch.platform_configs is None
    assert isinstance(events[1], TrialAttemptLost) and events[1].v == 2 and events[1].retry_platform is None
    view = apply_to_trial(apply_to_trial(None, events[0]), events[1])
    assert view is not None and (view.platform, view.attempt, view.status) == ("local", 2, TrialJobStatus.WAITING)


def test_the_example_config_lists_local_and_remote() -> None:
    spec = load_experiment_config(Path(__file__).resolve().parents[2] / "examples" / "hybrid" / "config.yml")

    assert spec.platform_names == ["local", "remote"] and spec.config.max_trial_retries == 1


def test_trialstream_run_serves_every_listed_platform_itself(
    remote_workers: RemoteWorkers, ssh_hosts: list[SshHost], ssh_user: SshUser, tmp_path: Path
) -> None:
    """Without a Redis URL, `run` starts its own Redis and workers for each listed platform."""
    (tmp_path / "release").touch()
    (tmp_path / "code").mkdir()  # apart from the experiments: the embedded Redis's socket is never shipped
    (tmp_path / "code" / "trial.py").write_text(textwrap.dedent(TRIAL))
    config = {
        "trialCommand": f"{sys.executable} trial.py",
        "trialCodeDirectory": "code",
        "trialConcurrency": 2,
        "maxTrialNumber": 4,
        "searchSpace": {
            "x": {"_type": "choice", "_value": [1, 2]},
            "release": {"_type": "choice", "_value": [str(tmp_path / "release")]},
        },
        "experimentWorkingDirectory": str(tmp_path / "experiments"),
        "trainingService": [{"platform": "local"}, remote_section(ssh_hosts, ssh_user)],
    }
    (tmp_path / "config.yml").write_text(yaml.safe_dump(config))
    env = {key: value for key, value in os.environ.items() if not key.startswith("TRIALSTREAM_")}
    ran = subprocess.run(
        [sys.executable, "-m", "manager.cli", "run", str(tmp_path / "config.yml"), "--json"],
        env={**env, **remote_workers.env},
        cwd=Path(__file__).resolve().parents[2],
        capture_output=True,
        text=True,
        timeout=300,
    )

    assert ran.returncode == 0, ran.stderr[-3000:]
    result = json.loads(ran.stdout.strip().splitlines()[-1])
    assert [trial["status"] for trial in result["trials"]] == ["SUCCEEDED"] * 4
    listed = subprocess.run(
        [sys.executable, "-m", "manager.cli", "trials", "list", "-e", result["experimentId"], "--json"],
        env={**env, "TRIALSTREAM_EXPERIMENTS_DIR": str(tmp_path / "experiments")},
        cwd=Path(__file__).resolve().parents[2],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    platforms = [trial["platform"] for trial in json.loads(listed.stdout)]
    assert platforms[:2] == ["local", "remote"] and set(platforms) == {"local", "remote"}
