"""The dlts platform beyond the conformance suite, through httpx against the simulated DLTS dashboard
(simulators/dltssim): NNI's keys and their checks, the wire format NNI's client used (query auth, the job's
body, the v2 status call), NNI's state mapping (queued, paused, killed outside), metrics read once across
a re-attached worker by the committed log cursor, and the password kept out of events and logs."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path
from typing import Any

import pytest
import redis
import yaml
from pydantic import ValidationError

from core import keys
from core.registry import platform_class
from core.settings import Settings
from manager.config import load_experiment_config
from manager.projector import Projector
from manager.runner import ExperimentRunner
from manager.training_service import TrainingService
from schemas.events import TrialReattached
from schemas.trial import TrialJobStatus
from simulators.dltssim import DltsSimulator
from tests.conftest import Processes, ServiceFactory, form, wait_for_status, wait_until
from tests.platforms.test_remote_config import redis_values
from tests.support.conformance import history
from tests.support.dlts_setup import CLUSTER, EMAIL, TEAM, dlts_cluster_fixture, dlts_section  # noqa: F401  (fixture)
from tests.support.gated_trial import GATED_TRIAL
from tests.support.workers import PlatformWorkers
from workers.platforms.dlts.adapter import DltsPlatform
from workers.platforms.dlts.config import DltsConfig


def check(config: dict[str, Any], code_dir: Path) -> list[str]:
    return DltsPlatform.check(DltsConfig.model_validate(config), code_dir, Settings())


@pytest.fixture
def dlts(make_service: ServiceFactory, code_dir: Path, dlts_cluster: DltsSimulator):
    """(**section) -> an experiment whose trials run GATED_TRIAL as jobs of the simulated cluster."""
    (code_dir / "trial.py").write_text(GATED_TRIAL)

    def make(gpu_number: int | None = None, **extra: Any) -> TrainingService:
        config = dlts_section(dlts_cluster, **extra)
        return make_service(f"{sys.executable} trial.py", platform_config=config, gpu_number=gpu_number)

    return make


def periodical(service: TrainingService, trial_id: str) -> list[int]:
    Projector(service.store.client).catch_up(service.experiment_id)
    return sorted(m.sequence for m in service.views.metrics(trial_id) if m.type == "PERIODICAL")


# ---------------------------------------------------------------------------------------------------
# config and checks before anything runs


def test_the_config_takes_nni_s_dlts_keys_and_says_what_is_wrong() -> None:
    config = DltsConfig.model_validate(
        {"platform": "dlts", "Dashboard": "http://dlts.example.com", "cluster": "eastus", "team": "platform",
         "email": "a@example.com", "password": "00ff", "image": "msranni/nni"}
    )  # fmt: skip
    assert config.dashboard == "http://dlts.example.com/" and config.cluster == "eastus"
    assert "00ff" not in repr(config) and "00ff" not in config.model_dump_json()
    assert DltsConfig.model_validate({"platform": "dlts", "dashboard": "http://d/"}).cluster == ".default"
    wrong: list[tuple[dict[str, Any], str]] = [
        ({"dashboard": "dlts.example.com"}, "dashboard"),
        ({"dashboard": "http://d/", "gpuNum": 1}, "gpuNum"),
    ]
    for given, named in wrong:
        with pytest.raises(ValidationError, match=named):
            DltsConfig.model_validate({"platform": "dlts", **given})


def test_team_email_and_password_come_from_a_dlts_job_s_environment_as_in_nni() -> None:
    config = DltsConfig.model_validate({"platform": "dlts", "dashboard": "http://d/"})
    environ = {"DLWS_VC_NAME": "platform", "DLWS_USER_EMAIL": "a@example.com", "DLTS_JOB_TOKEN": "beef"}
    access, problems = config.resolved(environ)
    assert problems == [] and access is not None
    assert (access.team, access.email, access.password.get_secret_value()) == ("platform", "a@example.com", "beef")
    access, problems = config.resolved({"DLWS_VC_NAME": "platform"})
    assert access is None and [line.split(":")[0] for line in problems] == ["email", "password"]
    assert "$DLWS_USER_EMAIL" in problems[0]


def test_a_usable_cluster_passes_the_check(dlts_cluster: DltsSimulator, code_dir: Path) -> None:
    assert check(dlts_section(dlts_cluster), code_dir) == []
    assert check(dlts_section(dlts_cluster, cluster=".default"), code_dir) == []


def test_each_problem_is_one_line_naming_the_key(dlts_cluster: DltsSimulator, code_dir: Path) -> None:
    cases = [
        ({"password": "0" * 32}, "password: ", "Invalid token"),
        ({"cluster": "westus"}, "cluster: ", "not a cluster"),
        ({"team": "marketing"}, "team: ", "may use"),
        ({"team": "research"}, "team: ", "may use"),  # a team of the cluster, but not alice's
        ({"dashboard": "http://127.0.0.1:9/"}, "dashboard: ", "cannot be reached"),
    ]
    for given, key, says in cases:
        [problem] = check(dlts_section(dlts_cluster, **given), code_dir)
        assert problem.startswith(key) and says in problem and "\n" not in problem
    config = {k: v for k, v in dlts_section(dlts_cluster).items() if k != "email"}
    assert "DLWS_USER_EMAIL" not in os.environ
    [problem] = check(config, code_dir)
    assert problem.startswith("email: ")


def test_code_beyond_what_a_job_command_carries_is_refused_at_the_check(
    dlts_cluster: DltsSimulator,
    code_dir: Path,
) -> None:
    (code_dir / "weights.bin").write_bytes(os.urandom(200 * 1024))  # random: packing cannot shrink it
    [problem] = check(dlts_section(dlts_cluster), code_dir)
    assert problem.startswith("trialCodeDirectory: ") and ".nniignore" in problem


def test_the_example_is_a_valid_config() -> None:
    spec = load_experiment_config(Path(__file__).parents[2] / "examples" / "dlts" / "config.yml")
    assert isinstance(spec.platform, platform_class("dlts").config_model)
    assert (spec.code_directory / "trial.py").is_file()


# ---------------------------------------------------------------------------------------------------
# jobs as NNI submitted and read them


def test_a_job_is_nni_s_job_config_sent_with_query_auth_and_read_through_the_v2_status(
    dlts,
    dlts_cluster: DltsSimulator,
    processes: Processes,
) -> None:
    service = dlts(gpu_number=2)
    PlatformWorkers(processes, "dlts").start()
    trial_id = service.submit_trial_job(form(0, before=[0, 1])).id
    trial = wait_for_status(service, trial_id, "SUCCEEDED", "FAILED", timeout=60)
    assert trial.status is TrialJobStatus.SUCCEEDED and trial.exit_code == 0, trial.message
    assert periodical(service, trial_id) == [0, 1]
    name = f"nni_exp_{service.experiment_id}_trial_{trial_id}"
    job = dlts_cluster.job_named(name)
    assert job is not None and job.user == EMAIL and job.team == TEAM
    params = job.params
    assert (params["gpuType"], params["resourcegpu"], params["image"]) == ("P40", 2, "msranni/nni:latest")
    assert (params["team"], params["vcName"], params["jobType"], params["jobtrainingtype"]) == (
        TEAM, TEAM, "training", "RegularJob"
    )  # fmt: skip
    assert trial.url == f"{dlts_cluster.url}job/{TEAM}/{CLUSTER}/{job.job_id}"  # NNI's link to the job's page
    calls = {(method, path) for method, path, _ in dlts_cluster.requests}
    assert {
        ("GET", f"/api/teams/{TEAM}/clusters/{CLUSTER}"),
        ("POST", f"/api/clusters/{CLUSTER}/jobs"),
        ("GET", f"/api/v2/clusters/{CLUSTER}/jobs/{job.job_id}"),
        ("GET", f"/api/clusters/{CLUSTER}/jobs/{job.job_id}/log"),
    } <= calls
    password = dlts_cluster.password(EMAIL)
    assert all(query.get("email") == EMAIL and query.get("password") == password for *_, query in dlts_cluster.requests)


def queued_trial(dlts, dlts_cluster: DltsSimulator, processes: Processes) -> tuple[TrainingService, str]:
    """A trial whose job the cluster holds in its queue (until `hold_queue(False)`)."""
    dlts_cluster.hold_queue(True)
    service = dlts()
    PlatformWorkers(processes, "dlts").start()
    trial_id = service.submit_trial_job(form(0)).id
    wait_until(lambda: dlts_cluster.job_named(job_name_of(service, trial_id)), 30, what="the job submitted")
    return service, trial_id


def test_a_queued_job_is_waiting_and_runs_once_the_cluster_takes_it(
    dlts,
    dlts_cluster: DltsSimulator,
    processes: Processes,
) -> None:
    service, trial_id = queued_trial(dlts, dlts_cluster, processes)
    assert service.get_trial_job(trial_id).status is TrialJobStatus.WAITING
    dlts_cluster.hold_queue(False)
    assert wait_for_status(service, trial_id, "SUCCEEDED", "FAILED", timeout=60).status is TrialJobStatus.SUCCEEDED


def job_name_of(service: TrainingService, trial_id: str) -> str:
    return f"nni_exp_{service.experiment_id}_trial_{trial_id}"


@pytest.mark.parametrize("how", ["paused", "killed"])
def test_a_job_paused_or_killed_on_the_cluster_is_sys_canceled(
    how: str,
    dlts,
    dlts_cluster: DltsSimulator,
    processes: Processes,
    tmp_path: Path,
) -> None:
    service = dlts()
    PlatformWorkers(processes, "dlts").start()
    started = tmp_path / "started"
    trial_id = service.submit_trial_job(form(0, started=str(started), gate=str(tmp_path / "never"))).id
    wait_for_status(service, trial_id, "RUNNING", timeout=60)
    wait_until(started.exists, 30, what="the trial to start")
    job = dlts_cluster.job_named(job_name_of(service, trial_id))
    assert job is not None
    if how == "paused":
        dlts_cluster.pause(job.job_id)
    else:
        dlts_cluster.set_status(job.cluster, job.job_id, job.user, "killing")
    trial = wait_for_status(service, trial_id, "SYS_CANCELED", "FAILED", "SUCCEEDED", timeout=60)
    assert trial.status is TrialJobStatus.SYS_CANCELED and how in (trial.message or "")
    dlts_cluster.wait_for(lambda: job.status in ("killed", "paused"))
    if how == "paused":  # NNI kills a paused job: it would never resume on its own
        assert ("PUT", f"/api/clusters/{CLUSTER}/jobs/{job.job_id}/status") in {
            (method, path) for method, path, _ in dlts_cluster.requests
        }


def test_cancel_kills_the_job_through_the_status_call(
    dlts,
    dlts_cluster: DltsSimulator,
    processes: Processes,
    tmp_path: Path,
) -> None:
    service = dlts()
    PlatformWorkers(processes, "dlts").start()
    trial_id = service.submit_trial_job(form(0, gate=str(tmp_path / "never"))).id
    wait_for_status(service, trial_id, "RUNNING", timeout=60)
    service.cancel_trial_job(trial_id)
    assert wait_for_status(service, trial_id, "USER_CANCELED", timeout=60).status is TrialJobStatus.USER_CANCELED
    job = dlts_cluster.job_named(job_name_of(service, trial_id))
    assert job is not None
    dlts_cluster.wait_for(lambda: job.status == "killed")


def test_a_failure_carries_its_exit_code_and_stderr_from_the_job_s_log(
    dlts,
    dlts_cluster: DltsSimulator,
    processes: Processes,
) -> None:
    service = dlts()
    PlatformWorkers(processes, "dlts").start()
    trial = wait_for_status(service, service.submit_trial_job(form(0, code=4)).id, "FAILED", "SUCCEEDED", timeout=60)
    assert trial.status is TrialJobStatus.FAILED and trial.exit_code == 4
    assert "exit code 4" in (trial.message or "") and "the last words" in (trial.message or "")


def test_metrics_are_read_once_across_a_re_attached_worker_from_the_committed_cursor(
    dlts,
    dlts_cluster: DltsSimulator,
    processes: Processes,
    tmp_path: Path,
) -> None:
    service = dlts()
    fast = {"TRIALSTREAM_TRIAL_LEASE_S": "1"}
    victim = PlatformWorkers(processes, "dlts").start(env=fast)
    gate, started = tmp_path / "gate", tmp_path / "started"
    trial_id = service.submit_trial_job(form(0, before=[0, 1], started=str(started), gate=str(gate), after=[2, 3])).id
    wait_until(lambda: started.exists() and periodical(service, trial_id) == [0, 1], 60, what="metrics 0 and 1")
    job = dlts_cluster.job_named(job_name_of(service, trial_id))
    assert job is not None
    log_path = f"/api/clusters/{CLUSTER}/jobs/{job.job_id}/log"
    PlatformWorkers(processes, "dlts").start(env=fast)
    victim.send_signal(signal.SIGKILL)
    victim.wait()
    seen = len(dlts_cluster.requests)
    wait_until(lambda: any(isinstance(e, TrialReattached) for e in history(service, trial_id)), 30)
    gate.touch()
    trial = wait_for_status(service, trial_id, "SUCCEEDED", "FAILED", timeout=60)
    assert trial.status is TrialJobStatus.SUCCEEDED and trial.attempt == 1, trial.message
    assert periodical(service, trial_id) == [0, 1, 2, 3]
    assert job.runs == 1  # the same job, followed again, never submitted twice
    after = [query for method, path, query in dlts_cluster.requests[seen:] if path == log_path]
    assert after and all(query.get("cursor") for query in after)  # resumed after what was read, not from the start


def test_the_password_reaches_the_dashboard_and_nothing_else(
    dlts_cluster: DltsSimulator,
    processes: Processes,
    client: redis.Redis,
    rq_connection: redis.Redis,
    tmp_path: Path,
) -> None:
    password = dlts_cluster.password(EMAIL)
    (tmp_path / "code").mkdir()
    (tmp_path / "code" / "trial.py").write_text(GATED_TRIAL)
    config = {
        "trialCommand": f"{sys.executable} trial.py",
        "trialCodeDirectory": "code",
        "trialConcurrency": 1,
        "maxTrialNumber": 1,
        "searchSpace": {"x": {"_type": "choice", "_value": [1]}},
        "tuner": {"name": "Random"},
        "trainingService": {**dlts_section(dlts_cluster), "pollInterval": "0.1s"},
        "experimentWorkingDirectory": str(tmp_path / "experiments"),
    }
    (tmp_path / "config.yml").write_text(yaml.safe_dump(config))
    processes.projector()
    PlatformWorkers(processes, "dlts").start()
    spec = load_experiment_config(tmp_path / "config.yml")
    runner = ExperimentRunner.create(spec, client, rq_connection, settings=Settings(experiments_dir=tmp_path / "x"))
    result = runner.run()
    assert [trial.status for trial in result.trials] == [TrialJobStatus.SUCCEEDED]  # the worker had the password
    holding = {
        key for key, values in redis_values(rq_connection).items() if any(password.encode() in v for v in values)
    }
    assert holding == {keys.secrets(runner.experiment_id, "dlts").encode()}  # only the secrets hash, beside the log
    service = TrainingService(client, rq_connection, runner.experiment_id)
    assert service.experiment_view().config["trainingService"]["password"] != password
    logs = processes.logs()
    assert logs.strip() and password not in logs


def test_clean_up_kills_the_experiment_s_queued_jobs_too(
    dlts,
    dlts_cluster: DltsSimulator,
    processes: Processes,
) -> None:
    service, trial_id = queued_trial(dlts, dlts_cluster, processes)
    service.clean_up()
    job = dlts_cluster.job_named(job_name_of(service, trial_id))
    assert job is not None
    dlts_cluster.wait_for(lambda: job.status == "killed")
    assert job.runs == 0
