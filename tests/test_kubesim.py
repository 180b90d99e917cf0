"""The simulated Kubernetes cluster, driven only through the official `kubernetes` client, as the platforms use it."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client, config
from kubernetes.client.exceptions import ApiException

from tests.kubesim import SimulatedCluster
from tests.waiting import wait_until

TF = ("kubeflow.org", "v1")
FC = ("frameworkcontroller.microsoft.com", "v1")


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[SimulatedCluster]:
    with SimulatedCluster(tmp_path / "sim", bookmark_interval_s=0.2) as c:
        yield c


@pytest.fixture
def api(cluster: SimulatedCluster, tmp_path: Path) -> client.ApiClient:
    return config.new_client_from_config(str(cluster.write_kubeconfig(tmp_path / "kubeconfig")))


@pytest.fixture
def core(api: client.ApiClient) -> client.CoreV1Api:
    return client.CoreV1Api(api)


@pytest.fixture
def custom(api: client.ApiClient) -> client.CustomObjectsApi:
    return client.CustomObjectsApi(api)


def python(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def tfjob(name: str, command: list[str], *, restart: str = "Never", **container: Any) -> dict[str, Any]:
    return {
        "apiVersion": "kubeflow.org/v1",
        "kind": "TFJob",
        "metadata": {"name": name, "labels": {"app": "trial"}},
        "spec": {
            "tfReplicaSpecs": {
                "Worker": {
                    "replicas": 1,
                    "restartPolicy": restart,
                    "template": {
                        "spec": {
                            "containers": [
                                {"name": "tensorflow", "image": "python:3.11", "command": command, **container}
                            ]
                        }
                    },
                }
            }
        },
    }


def condition(obj: dict[str, Any], type_: str) -> dict[str, Any] | None:
    found = [
        c for c in (obj.get("status") or {}).get("conditions") or [] if c["type"] == type_ and c["status"] == "True"
    ]
    return found[0] if found else None


def get_job(custom: client.CustomObjectsApi, plural: str, name: str) -> dict[str, Any]:
    return custom.get_namespaced_custom_object(*TF, "default", plural, name)


def test_discovery_lists_installed_crds_and_forgets_removed_ones(
    cluster: SimulatedCluster, api: client.ApiClient
) -> None:
    assert client.VersionApi(api).get_code().major == "1"
    groups = {g.name for g in client.ApisApi(api).get_api_versions().groups}
    assert {"kubeflow.org", "frameworkcontroller.microsoft.com", "authorization.k8s.io"} <= groups
    kubeflow = client.CustomObjectsApi(api).get_api_resources(*TF)
    by_name = {r.name: r for r in kubeflow.resources}
    assert by_name["tfjobs"].kind == "TFJob" and by_name["tfjobs"].namespaced
    assert "pytorchjobs" in by_name and "tfjobs/status" in by_name

    cluster.remove_crd("frameworks")
    with pytest.raises(ApiException) as err:
        client.CustomObjectsApi(api).get_api_resources(*FC)
    assert err.value.status == 404
    groups = {g.name for g in client.ApisApi(api).get_api_versions().groups}
    assert "frameworkcontroller.microsoft.com" not in groups
    with pytest.raises(ApiException) as err:
        client.CustomObjectsApi(api).list_namespaced_custom_object(*FC, "default", "frameworks")
    assert err.value.status == 404
    assert json.loads(err.value.body)["reason"] == "NotFound"


def test_errors_arrive_as_status_objects(cluster: SimulatedCluster, tmp_path: Path) -> None:
    cluster.add_token("limited", namespaces=["default"])
    cluster.add_token("stranger", namespaces=["default"])
    good = config.new_client_from_config(
        str(cluster.write_kubeconfig(tmp_path / "kc", token="limited", extra_contexts={"bad": "no-such-token"}))
    )
    custom = client.CustomObjectsApi(good)

    bad = client.CustomObjectsApi(config.new_client_from_config(str(tmp_path / "kc"), context="bad"))
    with pytest.raises(ApiException) as err:
        bad.list_namespaced_custom_object(*TF, "default", "tfjobs")
    assert (err.value.status, err.value.reason) == (401, "Unauthorized")

    with pytest.raises(ApiException) as err:
        custom.list_namespaced_custom_object(*TF, "elsewhere", "tfjobs")
    status = json.loads(err.value.body)
    assert err.value.status == 403 and status["reason"] == "Forbidden"
    assert status["message"] == (
        'tfjobs.kubeflow.org is forbidden: User "system:serviceaccount:default:trialstream" cannot list resource '
        '"tfjobs" in API group "kubeflow.org" in the namespace "elsewhere"'
    )
    review = client.AuthorizationV1Api(good).create_self_subject_access_review(
        {
            "spec": {
                "resourceAttributes": {
                    "namespace": "elsewhere",
                    "verb": "create",
                    "group": "kubeflow.org",
                    "resource": "tfjobs",
                }
            }
        }
    )
    assert review.status.allowed is False

    with pytest.raises(ApiException) as err:
        custom.get_namespaced_custom_object(*TF, "default", "tfjobs", "missing")
    assert err.value.status == 404
    assert json.loads(err.value.body)["message"] == 'tfjobs.kubeflow.org "missing" not found'

    job = tfjob("dup", python("pass"))
    custom.create_namespaced_custom_object(*TF, "default", "tfjobs", job)
    with pytest.raises(ApiException) as err:
        custom.create_namespaced_custom_object(*TF, "default", "tfjobs", job)
    assert (err.value.status, json.loads(err.value.body)["reason"]) == (409, "AlreadyExists")

    broken = tfjob("broken", python("pass"))
    broken["spec"]["tfReplicaSpecs"]["Worker"]["replicas"] = "two"
    with pytest.raises(ApiException) as err:
        custom.create_namespaced_custom_object(*TF, "default", "tfjobs", broken)
    status = json.loads(err.value.body)
    assert err.value.status == 422 and status["reason"] == "Invalid"
    assert [c["field"] for c in status["details"]["causes"]] == ["spec.tfReplicaSpecs.Worker.replicas"]

    admin = client.CustomObjectsApi(config.new_client_from_config(str(cluster.write_kubeconfig(tmp_path / "a"))))
    with pytest.raises(ApiException) as err:
        admin.create_namespaced_custom_object(*TF, "nowhere", "tfjobs", tfjob("x", python("pass")))
    assert err.value.status == 404
    assert json.loads(err.value.body)["message"] == 'namespaces "nowhere" not found'


def test_strict_field_validation_names_unknown_fields(custom: client.CustomObjectsApi) -> None:
    job = tfjob("strict", python("pass"))
    job["spec"]["tfReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]["bogus"] = 1
    with pytest.raises(ApiException) as err:
        custom.create_namespaced_custom_object(*TF, "default", "tfjobs", job, field_validation="Strict")
    assert err.value.status == 400
    assert (
        'unknown field "spec.tfReplicaSpecs.Worker.template.spec.containers[0].bogus"'
        in json.loads(err.value.body)["message"]
    )
    created = custom.create_namespaced_custom_object(*TF, "default", "tfjobs", job)
    assert "bogus" not in created["spec"]["tfReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]


def test_tfjob_runs_its_pod_to_success(
    cluster: SimulatedCluster, custom: client.CustomObjectsApi, core: client.CoreV1Api
) -> None:
    custom.create_namespaced_custom_object(*TF, "default", "tfjobs", tfjob("ok", python("print('hi')")))
    done = wait_until(lambda: condition(get_job(custom, "tfjobs", "ok"), "Succeeded"), 20, what="TFJob success")
    assert done["reason"] == "TFJobSucceeded" and done["message"] == "TFJob default/ok successfully completed."
    job = get_job(custom, "tfjobs", "ok")
    running = [c for c in job["status"]["conditions"] if c["type"] == "Running"]
    assert running == [] or running[0]["status"] == "False"
    assert job["status"]["replicaStatuses"]["Worker"]["succeeded"] == 1
    pod = core.read_namespaced_pod("ok-worker-0", "default")
    assert pod.metadata.labels["training.kubeflow.org/job-name"] == "ok"
    assert pod.metadata.labels["training.kubeflow.org/replica-type"] == "worker"
    assert pod.metadata.owner_references[0].controller is True
    assert pod.status.phase == "Succeeded"
    assert pod.status.container_statuses[0].state.terminated.exit_code == 0
    assert core.read_namespaced_pod_log("ok-worker-0", "default") == "hi\n"


def test_failing_tfjob_reports_exit_code_and_termination_message(
    custom: client.CustomObjectsApi, core: client.CoreV1Api
) -> None:
    code = "import sys; print('boom', file=sys.stderr); sys.exit(3)"
    custom.create_namespaced_custom_object(
        *TF, "default", "tfjobs", tfjob("bad", python(code), terminationMessagePolicy="FallbackToLogsOnError")
    )
    failed = wait_until(lambda: condition(get_job(custom, "tfjobs", "bad"), "Failed"), 20, what="TFJob failure")
    assert failed["message"] == "TFJob default/bad has failed because 1 Worker replica(s) failed."
    terminated = core.read_namespaced_pod("bad-worker-0", "default").status.container_statuses[0].state.terminated
    assert (terminated.exit_code, terminated.reason, terminated.message) == (3, "Error", "boom\n")
