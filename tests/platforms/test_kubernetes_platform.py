"""The Kubernetes platforms beyond the conformance suite, through the real `kubernetes` client against the
simulated cluster (simulators/kubesim): the checks before an experiment starts, the manifests the operators
get, one watch per namespace and kind, pods the cluster cannot place, metrics read exactly once across
broken streams and restarted workers, resources that vanish or that the cluster stops, cancel and
clean-up deleting what they must."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import redis
from kubernetes import client as k8s
from kubernetes import config as kube_config

from core.connections import same_server
from core.platform import TrialAssignment
from core.registry import platform_class
from core.settings import Settings
from manager.config import load_experiment_config
from manager.experiments import finish_experiment
from manager.projector import Projector
from manager.training_service import TrainingService
from schemas.events import TrialLaunchSpec, TrialReattached
from schemas.trial import TrialJobStatus
from simulators.kubesim import Capacity, SimulatedCluster
from tests.conftest import Processes, ServiceFactory, form, wait_for_status, wait_until
from tests.platforms.test_local_platform import pid_alive
from tests.support.conformance import history
from tests.support.gated_trial import GATED_TRIAL
from tests.support.kube_setup import frameworkcontroller_section, kubeflow_section
from tests.support.workers import PlatformWorkers
from workers.platforms.kubernetes.cluster import resource_name
from workers.platforms.kubernetes.frameworkcontroller.config import FrameworkControllerConfig
from workers.platforms.kubernetes.kubeflow.adapter import KubeflowPlatform
from workers.platforms.kubernetes.kubeflow.config import KubeflowConfig

PLATFORMS = ["kubeflow", "frameworkcontroller"]
PLURALS = {"kubeflow": "tfjobs", "frameworkcontroller": "frameworks"}
GROUPS = {"kubeflow": ("kubeflow.org", "v1"), "frameworkcontroller": ("frameworkcontroller.microsoft.com", "v1")}


def section(platform: str, kubeconfig: Path, **extra: Any) -> dict[str, Any]:
    if platform == "kubeflow":
        return kubeflow_section(kubeconfig, **extra)
    return frameworkcontroller_section(kubeconfig, **extra)


@pytest.fixture
def kube(make_service: ServiceFactory, code_dir: Path, kubeconfig: Path):
    """(platform, **section) -> an experiment whose trials run TRIAL in the simulated cluster."""
    (code_dir / "trial.py").write_text(GATED_TRIAL)

    def make(platform: str, max_retries: int = 0, **extra: Any) -> TrainingService:
        config = section(platform, kubeconfig, **extra)
        return make_service(f"{sys.executable} trial.py", platform_config=config, max_retries=max_retries)

    return make


def periodical(service: TrainingService, trial_id: str) -> list[int]:
    Projector(service.store.client).catch_up(service.experiment_id)
    return sorted(m.sequence for m in service.views.metrics(trial_id) if m.type == "PERIODICAL")


def custom_api(kubeconfig: Path) -> k8s.CustomObjectsApi:
    return k8s.CustomObjectsApi(kube_config.new_client_from_config(config_file=str(kubeconfig)))


def check(platform: str, config: dict[str, Any], code_dir: Path, settings: Settings | None = None) -> list[str]:
    adapter = platform_class(platform)
    return adapter.check(adapter.config_model.model_validate(config), code_dir, settings or Settings())


# ---------------------------------------------------------------------------------------------------
# config and checks before anything runs


def test_the_configs_take_nni_s_keys_and_say_what_is_wrong() -> None:
    config = KubeflowConfig.model_validate(
        {
            "platform": "kubeflow",
            "operator": "pytorch-operator",
            "apiVersion": "v1",
            "namespace": "team-a",
            "storage": {"storageType": "nfs", "server": "10.0.0.5", "path": "/exports"},
            "master": {"replicas": 1, "command": "python3 main.py", "gpuNumber": 1, "cpuNumber": 2,
                       "memorySize": "8gb", "dockerImage": "pytorch/pytorch"},
            "worker": {"replicas": 2, "command": "python3 main.py", "memorySize": 512,
                       "dockerImage": "pytorch/pytorch"},
            "reuseMode": False,
        }
    )  # fmt: skip
    assert config.master is not None and config.master.memory_size == 8192 and config.roles()["worker"].replicas == 2
    framework = FrameworkControllerConfig.model_validate(
        {
            "platform": "frameworkcontroller",
            "serviceAccountName": "frameworkcontroller",
            "taskRoles": [{"name": "worker", "taskNumber": 2, "command": "python3 main.py", "memorySize": "1gb",
                           "frameworkAttemptCompletionPolicy": {"minFailedTaskCount": 1, "minSucceedTaskCount": 1}}],
        }
    )  # fmt: skip
    assert framework.task_roles[0].framework_attempt_completion_policy.min_succeed_task_count == 1
    wrong: list[tuple[dict[str, Any], str]] = [
        ({"operator": "mxnet-operator", "worker": {}}, "operator"),
        ({"operator": "pytorch-operator", "master": {}, "ps": {}}, "ps"),
        ({"operator": "tf-operator"}, "worker"),
        ({"operator": "tf-operator", "worker": {"memorySize": "lots"}}, "memory size"),
        ({"operator": "tf-operator", "worker": {}, "storage": {"storageType": "azureStorage"}}, "azureStorage"),
        ({"operator": "tf-operator", "worker": {}, "namespace": "Not_A_Name"}, "namespace"),
        ({"operator": "tf-operator", "worker": {"replica": 2}}, "worker.replica"),
    ]
    for keys, named in wrong:
        with pytest.raises(ValueError, match=named):
            KubeflowConfig.model_validate({"platform": "kubeflow", **keys})
    with pytest.raises(ValueError, match="used twice"):
        FrameworkControllerConfig.model_validate(
            {"platform": "frameworkcontroller", "taskRoles": [{"name": "a"}, {"name": "a"}]}
        )


@pytest.mark.parametrize("platform", PLATFORMS)
def test_a_usable_cluster_passes_the_check(platform: str, kubeconfig: Path, code_dir: Path) -> None:
    assert check(platform, section(platform, kubeconfig), code_dir) == []


def test_each_cluster_problem_is_one_line_before_any_trial(
    kube_cluster: SimulatedCluster, kubeconfig: Path, code_dir: Path, tmp_path: Path
) -> None:
    kube_cluster.add_token("team-a-token", namespaces=["default"])
    limited = kube_cluster.write_kubeconfig(tmp_path / "limited", token="team-a-token")
    unreachable = tmp_path / "unreachable"
    unreachable.write_text(kubeconfig.read_text().replace(kube_cluster.url, "https://127.0.0.1:9"))
    cases = [
        (section("kubeflow", tmp_path / "missing"), "does not exist"),
        (section("kubeflow", unreachable), "cannot be reached"),
        (section("kubeflow", kubeconfig, namespace="nowhere"), "namespace 'nowhere' does not exist"),
        (section("kubeflow", kubeconfig, context="elsewhere"), "elsewhere"),
    ]
    for config, expected in cases:
        [problem] = check("kubeflow", config, code_dir)
        assert expected in problem
    kube_cluster.remove_crd("tfjobs")
    [problem] = check("kubeflow", section("kubeflow", kubeconfig), code_dir)
    assert "TFJob (tfjobs.kubeflow.org/v1) custom resource is not installed" in problem
    assert check("frameworkcontroller", section("frameworkcontroller", kubeconfig), code_dir) == []
    [problem] = check("frameworkcontroller", section("frameworkcontroller", limited, namespace="team-b"), code_dir)
    assert "may not create frameworks" in problem and "team-b" in problem


def test_a_context_of_the_kubeconfig_is_chosen_by_name(
    kube_cluster: SimulatedCluster, code_dir: Path, tmp_path: Path
) -> None:
    kube_cluster.add_token("other-token", namespaces=["default"])
    kubeconfig = kube_cluster.write_kubeconfig(tmp_path / "config", extra_contexts={"restricted": "other-token"})
    config = section("kubeflow", kubeconfig, namespace="team-b")
    assert check("kubeflow", config, code_dir) == []  # the current context's account may use team-b
    [problem] = check("kubeflow", {**config, "context": "restricted"}, code_dir)
    assert "may not create tfjobs" in problem


def test_in_a_pod_the_service_account_is_used(
    kube_cluster: SimulatedCluster, code_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    account = tmp_path / "serviceaccount"
    account.mkdir()
    (account / "token").write_text("sim-admin-token")
    (account / "ca.crt").write_bytes(kube_cluster.ca_path.read_bytes())
    host, port = kube_cluster.url.removeprefix("https://").rsplit(":", 1)
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", host)
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", port)
    monkeypatch.delenv("KUBECONFIG", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # no ~/.kube/config
    settings = Settings.from_environment({"TRIALSTREAM_KUBERNETES_SERVICE_ACCOUNT_DIR": str(account)})
    config = {"platform": "kubeflow", "operator": "tf-operator", "worker": {}}
    assert check("kubeflow", config, code_dir, settings) == []
    (account / "token").write_text("a-token-the-cluster-never-issued")
    [problem] = check("kubeflow", config, code_dir, settings)
    assert "credentials were refused" in problem


@pytest.mark.parametrize(
    ("example", "platform"),
    [
        ("kubeflow/config.yml", "kubeflow"),
        ("kubeflow/pytorch.yml", "kubeflow"),
        ("frameworkcontroller/config.yml", "frameworkcontroller"),
    ],
)
def test_the_examples_are_valid_configs(example: str, platform: str) -> None:
    spec = load_experiment_config(Path(__file__).parents[2] / "examples" / example)
    assert isinstance(spec.platform, platform_class(platform).config_model)
    assert (spec.code_directory / "trial.py").is_file()


def test_code_beyond_what_configmaps_carry_is_refused_at_the_check(kubeconfig: Path, code_dir: Path) -> None:
    (code_dir / "weights.bin").write_bytes(os.urandom(31 * 2**20))  # random: packing cannot shrink it
    [problem] = check("kubeflow", section("kubeflow", kubeconfig), code_dir)
    assert problem.startswith("trialCodeDirectory:") and ".nniignore" in problem


def test_an_experiment_on_a_cluster_without_the_operator_stops_before_any_trial(
    kube_cluster: SimulatedCluster, kubeconfig: Path, code_dir: Path, tmp_path: Path, processes: Processes
) -> None:
    kube_cluster.remove_crd("pytorchjobs")
    processes.projector()
    PlatformWorkers(processes, "kubeflow").start()  # the check runs where the trials would
    config = tmp_path / "config.yml"
    config.write_text(
        json.dumps(
            {
                "trialCommand": "python3 trial.py",
                "trialCodeDirectory": str(code_dir),
                "trialConcurrency": 1,
                "maxTrialNumber": 1,
                "searchSpace": {"x": {"_type": "choice", "_value": [1]}},
                "trainingService": {
                    "platform": "kubeflow",
                    "operator": "pytorch-operator",
                    "kubeconfig": str(kubeconfig),
                    "master": {},
                },
            }
        )
    )
    run = subprocess.run(
        [sys.executable, "-m", "manager.cli", "run", str(config)],
        env={**os.environ, "TRIALSTREAM_REDIS_URL": processes.redis_url},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode != 0
    assert "PyTorchJob (pytorchjobs.kubeflow.org/v1) custom resource is not installed" in run.stderr
    assert kube_cluster.requests["create pytorchjobs"] == 0


# ---------------------------------------------------------------------------------------------------
# what the cluster gets


def test_a_tfjob_has_nni_s_labels_roles_resources_and_environment(
    kube, kube_cluster: SimulatedCluster, processes: Processes, tmp_path: Path
) -> None:
    role = {"replicas": 1, "cpuNumber": 0.5, "memorySize": "1gb", "dockerImage": "tensorflow/tensorflow"}
    service = kube("kubeflow", worker={**role, "replicas": 2}, ps=role, master=role)
    PlatformWorkers(processes, "kubeflow").start()
    trial = wait_for_status(service, service.submit_trial_job(form(0)).id, "SUCCEEDED", "FAILED", timeout=60)
    assert trial.status is TrialJobStatus.SUCCEEDED, trial.message
    [job] = kube_cluster.objects("tfjobs")
    labels = job["metadata"]["labels"]
    assert labels == {"app": "nni-kubernetes-trial", "expId": service.experiment_id, "trialId": trial.id}
    assert sorted(job["spec"]["tfReplicaSpecs"]) == ["Chief", "PS", "Worker"]
    pods = kube_cluster.objects("pods")
    assert len(pods) == 4
    for pod in pods:
        assert pod["metadata"]["labels"]["trialId"] == trial.id
        [owner] = pod["metadata"]["ownerReferences"]
        assert owner["kind"] == "TFJob" and owner["name"] == job["metadata"]["name"]
        [container] = pod["spec"]["containers"]
        assert container["name"] == "tensorflow" and container["image"] == "tensorflow/tensorflow"
        assert container["resources"]["limits"] == {"cpu": "500m", "memory": "1Gi"}  # the API server's canonical form
        environment = {variable["name"]: variable["value"] for variable in container["env"]}
        assert environment["NNI_PLATFORM"] == "kubeflow" and environment["NNI_TRIAL_JOB_ID"] == trial.id
        assert not any(name.startswith("TRIALSTREAM_") for name in environment)
    assert trial.url is not None and trial.url.endswith(f"{job['metadata']['name']}-chief-0")


def test_a_pytorchjob_and_a_framework_run_each_role_s_pods(
    kube, kube_cluster: SimulatedCluster, processes: Processes
) -> None:
    service = kube("kubeflow", operator="pytorch-operator", master={"gpuNumber": 0}, worker={"replicas": 2})
    PlatformWorkers(processes, "kubeflow").start()
    trial = wait_for_status(service, service.submit_trial_job(form(0)).id, "SUCCEEDED", "FAILED", timeout=60)
    assert trial.status is TrialJobStatus.SUCCEEDED, trial.message
    [job] = kube_cluster.objects("pytorchjobs")
    assert sorted(job["spec"]["pytorchReplicaSpecs"]) == ["Master", "Worker"]
    assert len([pod for pod in kube_cluster.objects("pods") if pod["metadata"]["labels"]["trialId"] == trial.id]) == 3
    roles = [{"name": "ps", "taskNumber": 1}, {"name": "worker", "taskNumber": 2, "gpuNumber": 0}]
    service = kube("frameworkcontroller", taskRoles=roles)
    PlatformWorkers(processes, "frameworkcontroller").start()
    trial = wait_for_status(service, service.submit_trial_job(form(0)).id, "SUCCEEDED", "FAILED", timeout=60)
    assert trial.status is TrialJobStatus.SUCCEEDED, trial.message
    [framework] = kube_cluster.objects("frameworks")
    assert [role["name"] for role in framework["spec"]["taskRoles"]] == ["ps", "worker"]
    assert framework["spec"]["taskRoles"][1]["taskNumber"] == 2


# ---------------------------------------------------------------------------------------------------
# following trials


@pytest.mark.parametrize("platform", PLATFORMS)
def test_one_watch_per_namespace_and_kind_serves_every_trial_without_polling(
    platform: str, kube, kube_cluster: SimulatedCluster, processes: Processes
) -> None:
    service = kube(platform)
    PlatformWorkers(processes, platform).start(args=("--concurrency", "4"))
    trial_ids = [service.submit_trial_job(form(n, before=[0, 1])).id for n in range(4)]
    for trial_id in trial_ids:
        trial = wait_for_status(service, trial_id, "SUCCEEDED", "FAILED", timeout=60)
        assert trial.status is TrialJobStatus.SUCCEEDED, trial.message
        assert periodical(service, trial_id) == [0, 1]
    requests = kube_cluster.requests
    plural = PLURALS[platform]
    assert requests[f"watch {plural}"] == 1 and requests["watch pods"] == 1
    assert requests[f"create {plural}"] == 4
    assert requests[f"get {plural}"] == 0 and requests["get pods"] == 0  # no polling per trial
    assert requests["follow pods/log"] + requests["get pods/log"] <= 3 * 4  # a stream per trial, a last read


@pytest.mark.parametrize("platform", PLATFORMS)
def test_metrics_survive_broken_streams_a_stale_watch_and_a_restarted_worker_exactly_once(
    platform: str, kube, kube_cluster: SimulatedCluster, processes: Processes, tmp_path: Path
) -> None:
    service = kube(platform)
    fast = {"TRIALSTREAM_TRIAL_LEASE_S": "1"}
    victim = PlatformWorkers(processes, platform).start(env=fast)
    gate, started = tmp_path / "gate", tmp_path / "started"
    trial_id = service.submit_trial_job(form(0, before=[0, 1], started=str(started), gate=str(gate), after=[2, 3])).id
    wait_until(lambda: started.exists() and periodical(service, trial_id) == [0, 1], 60, what="metrics 0 and 1")
    kube_cluster.break_log_streams()
    kube_cluster.break_watches()
    kube_cluster.compact()
    PlatformWorkers(processes, platform).start(env=fast)
    victim.send_signal(signal.SIGKILL)
    victim.wait()
    kube_cluster.reset_requests()
    wait_until(lambda: any(isinstance(e, TrialReattached) for e in history(service, trial_id)), 30)
    # FrameworkController deletes a pod as its task ends, and its log with it: the rest is read only
    # if a worker follows the log by then (the README says so), so the trial goes on once one does
    wait_until(lambda: kube_cluster.requests["follow pods/log"] >= 1, 30, what="the new worker to follow the log")
    gate.touch()
    trial = wait_for_status(service, trial_id, "SUCCEEDED", "FAILED", timeout=60)
    assert trial.status is TrialJobStatus.SUCCEEDED and trial.attempt == 1, trial.message
    Projector(service.store.client).catch_up(service.experiment_id)
    metrics = service.views.metrics(trial_id)
    assert sorted((m.type, m.sequence) for m in metrics) == [
        ("FINAL", 0), ("PERIODICAL", 0), ("PERIODICAL", 1), ("PERIODICAL", 2), ("PERIODICAL", 3)
    ]  # fmt: skip


@pytest.mark.parametrize("platform", PLATFORMS)
def test_a_pod_the_cluster_cannot_place_is_told_while_waiting_and_runs_once_it_fits(
    platform: str, kube, kube_cluster: SimulatedCluster, processes: Processes
) -> None:
    gpu = {"worker": {"gpuNumber": 1}} if platform == "kubeflow" else {"taskRoles": [{"name": "w", "gpuNumber": 1}]}
    service = kube(platform, reportUnschedulableAfter="0.5s", **gpu)
    PlatformWorkers(processes, platform).start()
    trial_id = service.submit_trial_job(form(0)).id
    waiting = wait_until(lambda: (t := service.get_trial_job(trial_id)).message and t, 30, what="the message")
    assert waiting.status is TrialJobStatus.WAITING
    assert "cannot be scheduled" in waiting.message and "nvidia.com/gpu" in waiting.message
    kube_cluster.set_capacity(Capacity(cpu=64, memory_mib=262144, gpu=1))
    trial = wait_for_status(service, trial_id, "SUCCEEDED", "FAILED", timeout=60)
    assert trial.status is TrialJobStatus.SUCCEEDED, trial.message


def test_a_pod_unschedulable_past_the_limit_fails_its_trial(
    kube, kube_cluster: SimulatedCluster, processes: Processes
) -> None:
    service = kube("kubeflow", worker={"cpuNumber": 1000}, reportUnschedulableAfter="0.2s", failUnschedulableAfter="1s")
    PlatformWorkers(processes, "kubeflow").start()
    trial = wait_for_status(service, service.submit_trial_job(form(0)).id, "FAILED", "SUCCEEDED", timeout=60)
    assert trial.status is TrialJobStatus.FAILED
    assert "cannot be scheduled" in (trial.message or "") and "Insufficient cpu" in (trial.message or "")
    wait_until(lambda: not kube_cluster.objects("tfjobs"), 30, what="the TFJob to be deleted")


@pytest.mark.parametrize("platform", PLATFORMS)
def test_a_resource_deleted_behind_trialstream_s_back_fails_its_trial_saying_so(
    platform: str, kube, kube_cluster: SimulatedCluster, kubeconfig: Path, processes: Processes, tmp_path: Path
) -> None:
    service = kube(platform)
    PlatformWorkers(processes, platform).start()
    started = tmp_path / "started"
    trial_id = service.submit_trial_job(form(0, started=str(started), gate=str(tmp_path / "never"))).id
    wait_until(started.exists, 60, what="the trial to start")
    [resource] = kube_cluster.objects(PLURALS[platform])
    group, version = GROUPS[platform]
    custom_api(kubeconfig).delete_namespaced_custom_object(
        group, version, "default", PLURALS[platform], resource["metadata"]["name"]
    )
    trial = wait_for_status(service, trial_id, "FAILED", "SUCCEEDED", "SYS_CANCELED", timeout=60)
    assert trial.status is TrialJobStatus.FAILED
    assert "deleted outside trialstream" in (trial.message or "")


def test_an_evicted_pod_is_the_cluster_stopping_the_trial(
    kube, kube_cluster: SimulatedCluster, processes: Processes, tmp_path: Path
) -> None:
    service = kube("kubeflow")
    PlatformWorkers(processes, "kubeflow").start()
    started = tmp_path / "started"
    trial_id = service.submit_trial_job(form(0, started=str(started), gate=str(tmp_path / "never"))).id
    wait_until(started.exists, 60, what="the trial to start")
    [pod] = kube_cluster.objects("pods")
    kube_cluster.evict("default", pod["metadata"]["name"], message="The node was low on resource: memory.")
    trial = wait_for_status(service, trial_id, "SYS_CANCELED", "FAILED", "SUCCEEDED", timeout=60)
    assert trial.status is TrialJobStatus.SYS_CANCELED
    assert "Evicted" in (trial.message or "") and "low on resource" in (trial.message or "")
    trial_pid = int(started.read_text())  # killed with its pod, though its keeper started it in a session of its own
    wait_until(lambda: not pid_alive(trial_pid), 10, what=f"the trial's process {trial_pid} to be killed")


def test_a_framework_stopped_by_someone_else_is_sys_canceled(
    kube, kube_cluster: SimulatedCluster, kubeconfig: Path, processes: Processes, tmp_path: Path
) -> None:
    service = kube("frameworkcontroller")
    PlatformWorkers(processes, "frameworkcontroller").start()
    started = tmp_path / "started"
    trial_id = service.submit_trial_job(form(0, started=str(started), gate=str(tmp_path / "never"))).id
    wait_until(started.exists, 60, what="the trial to start")
    [framework] = kube_cluster.objects("frameworks")
    custom_api(kubeconfig).patch_namespaced_custom_object(
        *GROUPS["frameworkcontroller"], "default", "frameworks", framework["metadata"]["name"],
        {"spec": {"executionType": "Stop"}},
    )  # fmt: skip
    trial = wait_for_status(service, trial_id, "SYS_CANCELED", "FAILED", "SUCCEEDED", timeout=60)
    assert trial.status is TrialJobStatus.SYS_CANCELED, trial.message


# ---------------------------------------------------------------------------------------------------
# what is deleted, and logs


@pytest.mark.parametrize("platform", PLATFORMS)
def test_cancel_deletes_the_resource_and_its_pods_and_clean_up_deletes_the_rest(
    platform: str, kube, kube_cluster: SimulatedCluster, processes: Processes, client: redis.Redis, tmp_path: Path
) -> None:
    service = kube(platform)
    PlatformWorkers(processes, platform).start(args=("--concurrency", "2"))
    started = tmp_path / "started"
    running = service.submit_trial_job(form(0, started=str(started), gate=str(tmp_path / "never"))).id
    done = service.submit_trial_job(form(1)).id
    wait_until(started.exists, 60, what="the trial to start")
    assert wait_for_status(service, done, "SUCCEEDED", "FAILED", timeout=60).status is TrialJobStatus.SUCCEEDED
    assert len(kube_cluster.objects(PLURALS[platform])) == 2
    service.cancel_trial_job(running)
    assert wait_for_status(service, running, "USER_CANCELED", timeout=60).status is TrialJobStatus.USER_CANCELED

    def canceled_gone() -> bool:
        names = [r["metadata"]["labels"]["trialId"] for r in kube_cluster.objects(PLURALS[platform])]
        pods = [p["metadata"]["labels"]["trialId"] for p in kube_cluster.objects("pods")]
        return running not in names and running not in pods

    wait_until(canceled_gone, 30, what="the canceled trial's resource and pods to go")
    assert kube_cluster.objects("configmaps")  # the code, until the experiment ends
    finish_experiment(client, same_server(client, decode=False), service.experiment_id, platform, "DONE")
    wait_until(
        lambda: not kube_cluster.objects(PLURALS[platform]) and not kube_cluster.objects("configmaps"),
        30,
        what="clean-up to delete the experiment's resources and code",
    )


def test_release_of_a_lost_attempt_deletes_its_resource(
    kube_cluster: SimulatedCluster, kubeconfig: Path, code_dir: Path, client: redis.Redis
) -> None:
    adapter = KubeflowPlatform(Settings(), client)
    section = kubeflow_section(kubeconfig)
    config = KubeflowConfig.model_validate(section)
    launch = TrialLaunchSpec(command="sleep 300", code_directory=str(code_dir), platform_config=section)
    trial = TrialAssignment("exp1", "Trial1", form(0), launch, str(code_dir), config)
    try:
        adapter.stage("exp1", launch, config)
        manifest = adapter.manifest(trial, config, resource_name(trial))  # what a worker lost at launch left
        custom_api(kubeconfig).create_namespaced_custom_object(*GROUPS["kubeflow"], "default", "tfjobs", manifest)
        wait_until(lambda: kube_cluster.objects("pods"), 30, what="its pod")
        adapter.release(trial)
        wait_until(lambda: not kube_cluster.objects("tfjobs") and not kube_cluster.objects("pods"), 30)
    finally:
        adapter.close()


def test_logs_of_a_pod_are_read_through_the_api_and_a_failure_carries_its_stderr(
    kube, kube_cluster: SimulatedCluster, processes: Processes, redis_url: str
) -> None:
    service = kube("kubeflow")
    PlatformWorkers(processes, "kubeflow").start()
    trial = wait_for_status(service, service.submit_trial_job(form(0, code=3)).id, "SUCCEEDED", "FAILED", timeout=60)
    assert trial.status is TrialJobStatus.FAILED and trial.exit_code == 3
    assert trial.message == "exit code 3; stderr: the last words"

    def logs(*extra: str) -> subprocess.CompletedProcess[bytes]:
        return subprocess.run(
            [sys.executable, "-m", "manager.cli", "trials", "logs", trial.id, "-e", service.experiment_id, *extra],
            env={**os.environ, "TRIALSTREAM_REDIS_URL": redis_url},
            capture_output=True,
            timeout=60,
        )

    shown = logs()
    assert shown.returncode == 0 and b"NNISDK_MEb'" in shown.stdout and b'"FINAL"' in shown.stdout
    assert b"stdout and stderr as one log" in logs("--stderr").stderr


def test_several_workers_serve_the_queue_and_no_trial_runs_twice(
    kube, kube_cluster: SimulatedCluster, processes: Processes
) -> None:
    service = kube("kubeflow")
    for _ in range(2):
        PlatformWorkers(processes, "kubeflow").start(args=("--concurrency", "3"))
    trial_ids = [service.submit_trial_job(form(n)).id for n in range(6)]
    for trial_id in trial_ids:
        assert wait_for_status(service, trial_id, "SUCCEEDED", "FAILED", timeout=60).status is TrialJobStatus.SUCCEEDED
    jobs = kube_cluster.objects("tfjobs")
    assert sorted(job["metadata"]["labels"]["trialId"] for job in jobs) == sorted(trial_ids)
    assert kube_cluster.requests["create tfjobs"] == 6
    workers = {service.get_trial_job(trial_id).worker for trial_id in trial_ids}
    assert len(workers) == 2


def test_trials_output_goes_to_the_nfs_storage_the_pods_mount(kube, processes: Processes, tmp_path: Path) -> None:
    service = kube("kubeflow", storage={"storageType": "nfs", "server": "nfs.example", "path": "/exports/nni"})
    PlatformWorkers(processes, "kubeflow").start()
    trial = wait_for_status(service, service.submit_trial_job(form(0)).id, "SUCCEEDED", "FAILED", timeout=60)
    assert trial.status is TrialJobStatus.SUCCEEDED, trial.message
    assert isinstance(trial.final_metric, dict)
    assert trial.final_metric["output"].endswith(f"/storage/{service.experiment_id}/{trial.id}")
    exported = tmp_path / "cluster" / "nfs" / "nfs.example" / "exports" / "nni" / service.experiment_id / trial.id
    assert exported.is_dir()
