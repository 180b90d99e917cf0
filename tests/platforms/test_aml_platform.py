"""The aml platform beyond the conformance suite, through the real azure-ai-ml SDK and DefaultAzureCredential
against the simulated workspace (simulators/amlsim, Azurite behind its datastore): the section's keys, the checks
before an experiment starts, job names, a job the compute has not started yet, a job canceled in the
workspace, the code uploaded once, a failure's message and logs from std_log, and no secret in the log."""

# ruff: noqa: F811  (the test functions take the aml_workspace fixture imported by name below)
from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from core.registry import platform_class
from core.settings import Settings
from manager.config import load_experiment_config
from manager.training_service import TrainingService
from schemas.trial import TrialJobStatus
from tests.conftest import Processes, ServiceFactory, form, wait_for_status, wait_until
from tests.support.aml_setup import AmlWorkers, aml_storage, aml_workspace  # noqa: F401  (the simulated workspace fixtures)
from tests.support.gated_trial import GATED_TRIAL
from workers.platforms.aml.config import AmlConfig

REPO = Path(__file__).resolve().parents[2]


def check(section: dict[str, Any], code_dir: Path) -> list[str]:
    adapter = platform_class("aml")
    return adapter.check(adapter.config_model.model_validate(section), code_dir, Settings())


@pytest.fixture
def aml(make_service: ServiceFactory, code_dir: Path, aml_workspace):
    """(**section) -> an experiment whose trials run GATED_TRIAL as jobs of the simulated workspace."""
    (code_dir / "trial.py").write_text(GATED_TRIAL)

    def make(**extra: Any) -> TrainingService:
        section = aml_workspace.section(pollInterval=0.5, **extra)
        return make_service(f"{sys.executable} trial.py", platform_config=section)

    return make


def test_the_section_takes_nni_s_keys_and_says_what_is_wrong() -> None:
    config = AmlConfig.model_validate(
        {"platform": "aml", "subscription_id": "sub", "ResourceGroup": "rg", "workspaceName": "ws",
         "computeTarget": "gpu-cluster", "dockerImage": "pytorch/pytorch", "maxTrialNumberPerGpu": 2,
         "credential": "azureCli", "pollInterval": "10s"}
    )  # fmt: skip
    assert (config.resource_group, config.compute_target, config.poll_interval) == ("rg", "gpu-cluster", 10.0)
    assert config.docker_image == "pytorch/pytorch" and config.credential == "azureCli"
    base = {"platform": "aml", "subscriptionId": "s", "resourceGroup": "r", "workspaceName": "w", "computeTarget": "c"}
    wrong = [
        ({k: v for k, v in base.items() if k != "computeTarget"}, "computeTarget"),
        ({**base, "credential": "password"}, "credential"),
        ({**base, "maxTrialNumberPerGpu": 0}, "maxTrialNumberPerGpu"),
        ({**base, "workspace": "w"}, "workspace"),
    ]
    for keys, named in wrong:
        with pytest.raises(ValueError, match=named):
            AmlConfig.model_validate(keys)


def test_the_example_is_a_valid_config() -> None:
    spec = load_experiment_config(REPO / "examples" / "aml" / "config.yml")
    assert isinstance(spec.platform, AmlConfig) and spec.platform.compute_target == "cpu-cluster"


def test_job_names_are_one_per_attempt_and_what_azure_ml_allows() -> None:
    from core.platform import TrialAssignment
    from workers.platforms.aml.adapter import job_name

    def name(trial: str, attempt: int) -> str:
        return job_name(TrialAssignment("Exp-1", trial, form(0), None, "", None, attempt))  # type: ignore[arg-type]

    names = {name("AbC", 1), name("AbC", 2), name("abc", 1)}
    assert len(names) == 3 and name("AbC", 1) == name("AbC", 1)
    assert all(n.replace("_", "").isalnum() and n.islower() and len(n) <= 255 for n in names)


def test_a_usable_workspace_passes_the_check_and_each_problem_is_one_line(
    aml_workspace,
    code_dir: Path,
    tmp_path: Path,
) -> None:
    assert check(aml_workspace.section(), code_dir) == []
    (missing,) = check(aml_workspace.section(workspaceName="elsewhere"), code_dir)
    assert missing.startswith("workspaceName: workspace 'elsewhere'") and "does not exist" in missing
    (compute,) = check(aml_workspace.section(computeTarget="gpu-cluster"), code_dir)
    assert compute.startswith("computeTarget: 'gpu-cluster' is not a compute of workspace 'nni-ws'")
    (code, _) = check(aml_workspace.section(workspaceName="elsewhere"), tmp_path / "nowhere")
    assert code.startswith("trialCodeDirectory: ") and "does not exist" in code
    aml_workspace.api.refuse_tokens = True
    (signed_out,) = check(aml_workspace.section(), code_dir)
    assert signed_out.startswith("credential: signing in to Azure failed (default)") and "\n" not in signed_out


def test_a_queued_job_keeps_its_trial_waiting_and_one_canceled_in_the_workspace_is_sys_canceled(
    aml,
    aml_workspace,
    processes: Processes,
    tmp_path: Path,
) -> None:
    service = aml()
    AmlWorkers(processes, aml_workspace).start()
    aml_workspace.compute.hold.set()
    started = tmp_path / "started"
    trial_id = service.submit_trial_job(form(0, before=[0], started=str(started), gate=str(tmp_path / "never"))).id

    def queued() -> bool:
        return any(job["properties"]["status"] == "Queued" for job in list(aml_workspace.jobs.values()))

    wait_until(queued, 60, what="the trial's job to be queued")
    assert service.get_trial_job(trial_id).status is TrialJobStatus.WAITING
    aml_workspace.compute.release_hold()
    wait_for_status(service, trial_id, "RUNNING", timeout=60)
    wait_until(started.exists, 60, what="the trial to start")
    (name,) = list(aml_workspace.jobs)
    aml_workspace.compute.cancel(name)  # by someone in the workspace, not by trialstream
    trial = wait_for_status(service, trial_id, "SYS_CANCELED", "FAILED", "SUCCEEDED", timeout=60)
    assert trial.status is TrialJobStatus.SYS_CANCELED
    assert trial.message == f"job {name} was canceled in the workspace"
    assert trial.exit_code == 128 + signal.SIGTERM  # told by the job's last line, not waited for in vain


def test_one_code_asset_a_failure_tells_its_stderr_and_no_secret_reaches_the_log(
    aml,
    aml_workspace,
    processes: Processes,
    redis_url: str,
) -> None:
    from simulators.amlsim.azurite import ACCOUNT_KEY

    service = aml()
    workers = AmlWorkers(processes, aml_workspace)
    workers.start()
    workers.start()
    first = service.submit_trial_job(form(0, before=[0, 1])).id
    failing = service.submit_trial_job(form(1, code=3)).id
    assert wait_for_status(service, first, "SUCCEEDED", "FAILED", timeout=90).status is TrialJobStatus.SUCCEEDED
    trial = wait_for_status(service, failing, "SUCCEEDED", "FAILED", timeout=90)
    assert trial.status is TrialJobStatus.FAILED and trial.exit_code == 3
    assert trial.message == "exit code 3; stderr: the last words"
    versions = [key for key in aml_workspace.assets if key[0] == "codes" and key[2] is not None]
    assert len(versions) == 1  # one code asset for the experiment, whichever worker ran which trial (or first)
    (code,) = {job["properties"]["codeId"] for job in list(aml_workspace.jobs.values())}
    assert code.endswith(f"/codes/{versions[0][1]}/versions/{versions[0][2]}")

    def logs(*extra: str) -> subprocess.CompletedProcess[bytes]:
        return subprocess.run(
            [sys.executable, "-m", "manager.cli", "trials", "logs", failing, "-e", service.experiment_id, *extra],
            env={**os.environ, "TRIALSTREAM_REDIS_URL": redis_url},
            capture_output=True,
            timeout=120,
        )

    shown = logs()
    assert shown.returncode == 0 and b"the last words" in shown.stdout and b'"FINAL"' in shown.stdout
    assert b"stdout and stderr as one std_log" in logs("--stderr").stderr
    secrets = [ACCOUNT_KEY, aml_workspace.api.identity_secret, *aml_workspace.api.tokens]
    recorded = "\n".join(stored.event.model_dump_json() for stored in service.store.read() if hasattr(stored, "event"))
    told = processes.logs() + recorded
    assert not [secret for secret in secrets if secret in told]


def test_release_and_clean_up_cancel_the_jobs_a_lost_worker_left_running(
    aml, aml_workspace, processes: Processes, tmp_path: Path, client
) -> None:
    import signal

    from core.assignments import load_assignment
    from core.registry import platform_class
    from workers.platforms.aml.adapter import AmlPlatform

    service = aml()
    worker = AmlWorkers(processes, aml_workspace).start(args=("--concurrency", "2"))
    gate = str(tmp_path / "never")
    held = [service.submit_trial_job(form(i, started=str(tmp_path / f"started-{i}"), gate=gate)).id for i in range(2)]
    for index in range(2):
        wait_until((tmp_path / f"started-{index}").exists, 90, what=f"trial {index} to start")
    worker.send_signal(signal.SIGKILL)  # its jobs run on in the workspace, followed by no one
    worker.wait()
    names = {job["properties"]["tags"]["nni.trial"]: name for name, job in list(aml_workspace.jobs.items())}
    platform = AmlPlatform(Settings(), client)
    try:
        platform.release(load_assignment(client, platform_class("aml"), service.experiment_id, held[0], 1))
        wait_until(lambda: aml_workspace.job(names[held[0]])["properties"]["status"] == "Canceled", 30)
        assert aml_workspace.job(names[held[1]])["properties"]["status"] == "Running"
        platform.clean_up(service.experiment_id, AmlConfig.model_validate(aml_workspace.section()))
        wait_until(lambda: aml_workspace.job(names[held[1]])["properties"]["status"] == "Canceled", 30)
    finally:
        platform.close()


def test_metrics_are_read_once_across_a_killed_worker_from_the_committed_std_log_offset(
    aml, aml_workspace, processes: Processes, tmp_path: Path
) -> None:
    import signal

    from core import keys
    from manager.projector import Projector
    from schemas.events import TrialReattached
    from simulators.amlsim.compute import std_log_path
    from tests.support.conformance import history

    service = aml()
    fast = {"TRIALSTREAM_TRIAL_LEASE_S": "1"}
    workers = AmlWorkers(processes, aml_workspace)
    victim = workers.start(env=fast)
    gate = tmp_path / "gate"
    trial_id = service.submit_trial_job(form(0, before=[0, 1], gate=str(gate), after=[2, 3])).id

    def metrics() -> list[tuple[str, int]]:
        Projector(service.store.client).catch_up(service.experiment_id)
        return sorted((m.type, m.sequence) for m in service.views.metrics(trial_id))

    wait_until(lambda: len(metrics()) == 2, 60, what="the metrics before the gate")
    (name,) = list(aml_workspace.jobs)
    std_log = aml_workspace.compute.blobs().get_blob_client(aml_workspace.container, std_log_path(name))
    text = std_log.download_blob().readall()
    after_second = text.index(b"\n", text.index(b'"sequence": 1')) + 1
    committed = service.store.client.hget(keys.read_offsets(service.experiment_id, trial_id, 1), "std_log")
    assert committed is not None and int(committed) == after_second  # where the next worker resumes reading
    workers.start(env=fast)
    victim.send_signal(signal.SIGKILL)
    victim.wait()
    wait_until(lambda: any(isinstance(e, TrialReattached) for e in history(service, trial_id)), 60)
    gate.touch()
    assert wait_for_status(service, trial_id, "SUCCEEDED", "FAILED", timeout=60).status is TrialJobStatus.SUCCEEDED
    assert metrics() == [("FINAL", 0), ("PERIODICAL", 0), ("PERIODICAL", 1), ("PERIODICAL", 2), ("PERIODICAL", 3)]
    assert len(aml_workspace.jobs) == 1  # the same job, followed again
