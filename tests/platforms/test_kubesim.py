"""The simulated Kubernetes cluster, driven only through the official `kubernetes` client, as the platforms use it."""

from __future__ import annotations

import datetime as dt
import json
import os
import re
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import pytest
from kubernetes import client, config, watch
from kubernetes.client.exceptions import ApiException
from urllib3 import HTTPResponse

from simulators.kubesim import Capacity, SimulatedCluster
from simulators.waiting import wait_until

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
    job = custom.get_namespaced_custom_object(*TF, "default", plural, name)
    assert isinstance(job, dict)
    return job


def as_configmap(manifest: dict[str, Any]) -> client.V1ConfigMap:
    """A plain-dict ConfigMap: the client sends it as it is, though its types name only the model class."""
    return cast(client.V1ConfigMap, manifest)


def error_status(error: ApiException) -> Any:
    """The Status object an API error carries as its body."""
    assert error.body is not None
    return json.loads(error.body)


def metadata(obj: client.V1Pod | client.V1ConfigMap) -> client.V1ObjectMeta:
    """What every object read back from the cluster has (the client's models type each field optional)."""
    assert obj.metadata is not None
    return obj.metadata


def phase(pod: client.V1Pod) -> str | None:
    assert pod.status is not None
    return pod.status.phase


def terminated(pod: client.V1Pod) -> client.V1ContainerStateTerminated:
    """How the pod's first container ended."""
    assert pod.status is not None and pod.status.container_statuses
    state = pod.status.container_statuses[0].state
    assert state is not None and state.terminated is not None
    return state.terminated


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
    assert error_status(err.value)["reason"] == "NotFound"


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
    status = error_status(err.value)
    assert err.value.status == 403 and status["reason"] == "Forbidden"
    assert status["message"] == (
        'tfjobs.kubeflow.org is forbidden: User "system:serviceaccount:default:trialstream" cannot list resource '
        '"tfjobs" in API group "kubeflow.org" in the namespace "elsewhere"'
    )
    review = client.AuthorizationV1Api(good).create_self_subject_access_review(
        cast(  # a plain dict, sent as it is, though the client's types name only the model class
            client.V1SelfSubjectAccessReview,
            {
                "spec": {
                    "resourceAttributes": {
                        "namespace": "elsewhere",
                        "verb": "create",
                        "group": "kubeflow.org",
                        "resource": "tfjobs",
                    }
                }
            },
        )
    )
    assert review.status is not None and review.status.allowed is False

    with pytest.raises(ApiException) as err:
        custom.get_namespaced_custom_object(*TF, "default", "tfjobs", "missing")
    assert err.value.status == 404
    assert error_status(err.value)["message"] == 'tfjobs.kubeflow.org "missing" not found'

    job = tfjob("dup", python("pass"))
    custom.create_namespaced_custom_object(*TF, "default", "tfjobs", job)
    with pytest.raises(ApiException) as err:
        custom.create_namespaced_custom_object(*TF, "default", "tfjobs", job)
    assert (err.value.status, error_status(err.value)["reason"]) == (409, "AlreadyExists")

    broken = tfjob("broken", python("pass"))
    broken["spec"]["tfReplicaSpecs"]["Worker"]["replicas"] = "two"
    with pytest.raises(ApiException) as err:
        custom.create_namespaced_custom_object(*TF, "default", "tfjobs", broken)
    status = error_status(err.value)
    assert err.value.status == 422 and status["reason"] == "Invalid"
    assert [c["field"] for c in status["details"]["causes"]] == ["spec.tfReplicaSpecs.Worker.replicas"]

    admin = client.CustomObjectsApi(config.new_client_from_config(str(cluster.write_kubeconfig(tmp_path / "a"))))
    with pytest.raises(ApiException) as err:
        admin.create_namespaced_custom_object(*TF, "nowhere", "tfjobs", tfjob("x", python("pass")))
    assert err.value.status == 404
    assert error_status(err.value)["message"] == 'namespaces "nowhere" not found'


def test_strict_field_validation_names_unknown_fields(custom: client.CustomObjectsApi) -> None:
    job = tfjob("strict", python("pass"))
    job["spec"]["tfReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]["bogus"] = 1
    with pytest.raises(ApiException) as err:
        custom.create_namespaced_custom_object(*TF, "default", "tfjobs", job, field_validation="Strict")
    assert err.value.status == 400
    assert (
        'unknown field "spec.tfReplicaSpecs.Worker.template.spec.containers[0].bogus"'
        in error_status(err.value)["message"]
    )
    created, _, headers = custom.create_namespaced_custom_object_with_http_info(*TF, "default", "tfjobs", job)
    assert isinstance(created, dict)
    assert "bogus" not in created["spec"]["tfReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]
    assert headers["Warning"] == (
        '299 - "unknown field \\"spec.tfReplicaSpecs.Worker.template.spec.containers[0].bogus\\""'
    )


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
    assert pod.metadata is not None and pod.metadata.labels is not None and pod.metadata.owner_references
    assert pod.metadata.labels["training.kubeflow.org/job-name"] == "ok"
    assert pod.metadata.labels["training.kubeflow.org/replica-type"] == "worker"
    assert pod.metadata.owner_references[0].controller is True
    assert phase(pod) == "Succeeded"
    assert terminated(pod).exit_code == 0
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
    ended = terminated(core.read_namespaced_pod("bad-worker-0", "default"))
    assert (ended.exit_code, ended.reason, ended.message) == (3, "Error", "boom\n")


def pytorchjob(name: str, code: str) -> dict[str, Any]:
    def replica(n: int) -> dict[str, Any]:
        return {
            "replicas": n,
            "restartPolicy": "Never",
            "template": {"spec": {"containers": [{"name": "pytorch", "image": "pytorch:2", "command": python(code)}]}},
        }

    return {
        "apiVersion": "kubeflow.org/v1",
        "kind": "PyTorchJob",
        "metadata": {"name": name},
        "spec": {"pytorchReplicaSpecs": {"Master": replica(1), "Worker": replica(1)}},
    }


def test_pytorchjob_master_decides_success(custom: client.CustomObjectsApi, core: client.CoreV1Api) -> None:
    code = "import os; print(os.environ['RANK'], os.environ['WORLD_SIZE'], os.environ['MASTER_ADDR'])"
    custom.create_namespaced_custom_object(*TF, "default", "pytorchjobs", pytorchjob("pt", code))
    done = wait_until(lambda: condition(get_job(custom, "pytorchjobs", "pt"), "Succeeded"), 20, what="success")
    assert done["message"] == "PyTorchJob pt is successfully completed."
    assert core.read_namespaced_pod_log("pt-master-0", "default") == "0 2 pt-master-0\n"
    wait_until(lambda: phase(core.read_namespaced_pod("pt-worker-0", "default")) == "Succeeded", 20)
    assert core.read_namespaced_pod_log("pt-worker-0", "default") == "1 2 pt-master-0\n"
    master = core.read_namespaced_pod("pt-master-0", "default")
    assert master.metadata is not None and master.metadata.labels is not None
    assert master.metadata.labels["training.kubeflow.org/job-role"] == "master"


def framework(name: str, code: str, *, execution: str = "Start") -> dict[str, Any]:
    return {
        "apiVersion": "frameworkcontroller.microsoft.com/v1",
        "kind": "Framework",
        "metadata": {"name": name},
        "spec": {
            "executionType": execution,
            "retryPolicy": {"fancyRetryPolicy": False, "maxRetryCount": 0},
            "taskRoles": [
                {
                    "name": "worker",
                    "taskNumber": 1,
                    "frameworkAttemptCompletionPolicy": {"minFailedTaskCount": 1, "minSucceededTaskCount": 1},
                    "task": {
                        "retryPolicy": {"fancyRetryPolicy": False, "maxRetryCount": 0},
                        "pod": {
                            "spec": {
                                "restartPolicy": "Never",
                                "containers": [{"name": "main", "image": "python:3.11", "command": python(code)}],
                            }
                        },
                    },
                }
            ],
        },
    }


def fc_status(custom: client.CustomObjectsApi, name: str) -> dict[str, Any]:
    framework = custom.get_namespaced_custom_object(*FC, "default", "frameworks", name)
    assert isinstance(framework, dict)
    return framework.get("status") or {}


def test_framework_success_failure_and_stop(cluster: SimulatedCluster, custom: client.CustomObjectsApi) -> None:
    custom.create_namespaced_custom_object(*FC, "default", "frameworks", framework("good", "print('ok')"))
    custom.create_namespaced_custom_object(
        *FC, "default", "frameworks", framework("bad", "import sys; print('no', file=sys.stderr); sys.exit(7)")
    )
    custom.create_namespaced_custom_object(
        *FC, "default", "frameworks", framework("long", "import time; time.sleep(60)")
    )
    wait_until(lambda: fc_status(custom, "long").get("state") == "AttemptRunning", 20, what="running Framework")
    custom.patch_namespaced_custom_object(*FC, "default", "frameworks", "long", {"spec": {"executionType": "Stop"}})

    for name in ("good", "bad", "long"):

        def completed(n: str = name) -> bool:
            return fc_status(custom, n).get("state") == "Completed"

        wait_until(completed, 20, what=f"{name} Completed")
    good = fc_status(custom, "good")["attemptStatus"]["completionStatus"]
    assert (good["code"], good["phrase"], good["type"]["name"]) == (0, "Succeeded", "Succeeded")
    bad = fc_status(custom, "bad")["attemptStatus"]["completionStatus"]
    assert (bad["code"], bad["phrase"], bad["type"]) == (
        7,
        "ContainerUnrecognizedFailed",
        {"name": "Failed", "attributes": []},
    )
    task = fc_status(custom, "bad")["attemptStatus"]["taskRoleStatuses"][0]["taskStatuses"][0]
    assert task["attemptStatus"]["completionStatus"]["pod"]["containers"][0]["message"] == "no\n"
    stop = fc_status(custom, "long")["attemptStatus"]["completionStatus"]
    assert (stop["code"], stop["phrase"], stop["type"]["attributes"]) == (-210, "StopFrameworkRequested", ["Permanent"])
    assert cluster.objects("pods") == []  # FC deletes each task's pod, and the attempt's ConfigMap
    assert cluster.objects("configmaps") == []


def test_watch_resumes_after_broken_connections_without_losing_events(
    cluster: SimulatedCluster, core: client.CoreV1Api
) -> None:
    seen: list[str] = []
    errors: list[BaseException] = []
    stop = threading.Event()
    listed = core.list_namespaced_config_map("default")
    assert listed.metadata is not None
    start_rv = listed.metadata.resource_version

    def consume() -> None:
        w = watch.Watch()
        rv = start_rv
        while not stop.is_set():
            try:
                for ev in w.stream(core.list_namespaced_config_map, "default", resource_version=rv):
                    rv = ev["object"].metadata.resource_version
                    if ev["type"] == "ADDED":
                        seen.append(ev["object"].metadata.name)
                    if stop.is_set():
                        w.stop()
            except ApiException as e:
                errors.append(e)
                return
            except Exception:  # the connection was cut: resume from the last resourceVersion seen
                continue

    consumer = threading.Thread(target=consume, daemon=True)
    consumer.start()
    names = [f"cm-{i}" for i in range(12)]
    for i, name in enumerate(names):
        core.create_namespaced_config_map("default", as_configmap({"metadata": {"name": name}, "data": {"i": str(i)}}))
        if i % 4 == 3:

            def seen_all(n: int = i) -> bool:
                return len(seen) >= n + 1

            wait_until(seen_all, 10, what="events before the cut")
            assert cluster.break_watches() >= 1
    wait_until(lambda: len(seen) >= len(names), 10, what="every ADDED event")
    wait_until(lambda: cluster.requests["watch configmaps"] >= 4, 10, what="the watch reopened after each cut")
    stop.set()
    core.create_namespaced_config_map("default", as_configmap({"metadata": {"name": "wake"}}))
    consumer.join(5)
    assert not errors
    assert seen[: len(names)] == names


def test_compacted_history_answers_410_gone(cluster: SimulatedCluster, core: client.CoreV1Api) -> None:
    listed = core.list_namespaced_config_map("default")
    assert listed.metadata is not None
    old_rv = listed.metadata.resource_version
    core.create_namespaced_config_map("default", as_configmap({"metadata": {"name": "a"}}))
    cluster.compact()
    with pytest.raises(ApiException) as err:
        for _ in watch.Watch().stream(
            core.list_namespaced_config_map, "default", resource_version=old_rv, timeout_seconds=5
        ):
            pytest.fail("no event may come from a compacted resourceVersion")
    assert err.value.status == 410
    assert "Expired" in err.value.reason


def test_bookmarks_arrive(custom: client.CustomObjectsApi) -> None:
    w = watch.Watch()
    bookmarks = []
    for ev in w.stream(
        custom.list_namespaced_custom_object, *TF, "default", "tfjobs", allow_watch_bookmarks=True, timeout_seconds=5
    ):
        if ev["type"] == "BOOKMARK":
            bookmarks.append(ev["raw_object"])
            w.stop()
    assert bookmarks and bookmarks[0]["kind"] == "TFJob"
    assert int(bookmarks[0]["metadata"]["resourceVersion"]) > 0


def pod_fs(cluster: SimulatedCluster, core: client.CoreV1Api, name: str) -> Path:
    uid = metadata(core.read_namespaced_pod(name, "default")).uid
    assert uid is not None
    return cluster.root / "pods" / "default" / uid / "fs"


def wait_running(core: client.CoreV1Api, name: str) -> client.V1Pod:
    def probe() -> client.V1Pod | None:
        try:
            pod = core.read_namespaced_pod(name, "default")
        except ApiException:
            return None
        return pod if phase(pod) == "Running" else None

    return wait_until(probe, 20, what=f"pod {name} Running")


GATED = (
    "import os, time\n"
    "print('first', flush=True)\n"
    "while not os.path.exists('go'): time.sleep(0.01)\n"
    "print('second', flush=True)\n"
)


def raw_log(api: client.ApiClient, pod: str, **query: str) -> str:
    """GET .../log with query parameters the generated client lacks (sinceTime), through the same ApiClient."""
    request = api.param_serialize(
        "GET",
        "/api/v1/namespaces/default/pods/{name}/log",
        path_params={"name": pod},
        query_params=list(query.items()),
        auth_settings=["BearerToken"],
    )
    response = api.call_api(*request)
    response.read()
    return api.response_deserialize(response, {"200": "str"}).data


def test_pod_log_follow_with_timestamps_and_since_time(
    cluster: SimulatedCluster, custom: client.CustomObjectsApi, core: client.CoreV1Api
) -> None:
    custom.create_namespaced_custom_object(*TF, "default", "tfjobs", tfjob("logs", python(GATED)))
    wait_running(core, "logs-worker-0")
    resp = cast(  # the client's types say str, as if _preload_content were True
        HTTPResponse,
        core.read_namespaced_pod_log("logs-worker-0", "default", follow=True, timestamps=True, _preload_content=False),
    )
    lines: list[str] = []

    def read() -> None:
        for chunk in resp.stream(1):
            lines.append(chunk.decode())

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    wait_until(lambda: "".join(lines).endswith("first\n"), 10, what="the first line, while the container runs")
    first_ts, first = "".join(lines).split(" ", 1)
    assert first == "first\n"
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{9}Z", first_ts)
    first_second = dt.datetime.fromisoformat(first_ts[:19] + "+00:00")
    next_second = first_second + dt.timedelta(seconds=1)
    wait_until(lambda: dt.datetime.now(dt.UTC) >= next_second, 3, what="the next second")
    (pod_fs(cluster, core, "logs-worker-0") / "go").touch()
    reader.join(10)
    assert not reader.is_alive(), "the follow stream ends when the container exits"
    text = "".join(lines)
    assert [line.split(" ", 1)[1] for line in text.splitlines()] == ["first", "second"]

    since = raw_log(core.api_client, "logs-worker-0", sinceTime=next_second.strftime("%Y-%m-%dT%H:%M:%SZ"))
    assert since == "second\n"
    inclusive = raw_log(core.api_client, "logs-worker-0", sinceTime=first_second.strftime("%Y-%m-%dT%H:%M:%SZ"))
    assert inclusive == "first\nsecond\n"
    assert core.read_namespaced_pod_log("logs-worker-0", "default", tail_lines=1) == "second\n"
    assert cluster.requests["follow pods/log"] == 1


TERM_AWARE = (
    "import os, signal, sys, time\n"
    "open('pid', 'w').write(str(os.getpid()))\n"
    "def term(*_):\n"
    "    open('got-term', 'w').write('yes')\n"
    "    sys.exit(0)\n"
    "signal.signal(signal.SIGTERM, term)\n"
    "print('ready', flush=True)\n"
    "while True: time.sleep(0.05)\n"
)


def test_background_deletion_terminates_and_removes_pods(
    cluster: SimulatedCluster, custom: client.CustomObjectsApi, core: client.CoreV1Api
) -> None:
    custom.create_namespaced_custom_object(*TF, "default", "tfjobs", tfjob("del", python(TERM_AWARE)))
    wait_running(core, "del-worker-0")
    fs = pod_fs(cluster, core, "del-worker-0")
    wait_until(lambda: core.read_namespaced_pod_log("del-worker-0", "default") == "ready\n", 10, what="ready")
    pid = int((fs / "pid").read_text())
    listed = core.list_namespaced_pod("default", label_selector="training.kubeflow.org/job-name=del")
    assert listed.metadata is not None
    custom.delete_namespaced_custom_object(*TF, "default", "tfjobs", "del")
    events: list[tuple[str, client.V1Pod]] = []
    w = watch.Watch()
    for ev in w.stream(
        core.list_namespaced_pod,
        "default",
        label_selector="training.kubeflow.org/job-name=del",
        resource_version=listed.metadata.resource_version,
        timeout_seconds=15,
    ):
        events.append((ev["type"], ev["object"]))
        if ev["type"] == "DELETED":
            w.stop()
    assert events[-1][0] == "DELETED"
    terminating = [pod for type_, pod in events if type_ == "MODIFIED" and metadata(pod).deletion_timestamp]
    assert terminating and metadata(terminating[0]).deletion_grace_period_seconds == 30
    assert (fs / "got-term").read_text() == "yes"
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    with pytest.raises(ApiException) as err:
        get_job(custom, "tfjobs", "del")
    assert err.value.status == 404


def test_orphan_deletion_keeps_pods(custom: client.CustomObjectsApi, core: client.CoreV1Api) -> None:
    custom.create_namespaced_custom_object(*TF, "default", "tfjobs", tfjob("orph", python(GATED)))
    wait_running(core, "orph-worker-0")
    custom.delete_namespaced_custom_object(*TF, "default", "tfjobs", "orph", propagation_policy="Orphan")
    wait_until(
        lambda: not metadata(core.read_namespaced_pod("orph-worker-0", "default")).owner_references,
        10,
        what="the owner reference to go",
    )
    with pytest.raises(ApiException):
        get_job(custom, "tfjobs", "orph")
    assert phase(core.read_namespaced_pod("orph-worker-0", "default")) == "Running"


def test_unschedulable_gpu_pod_runs_once_capacity_grows(
    cluster: SimulatedCluster, custom: client.CustomObjectsApi, core: client.CoreV1Api
) -> None:
    job = tfjob("gpu", python("print('gpu')"), resources={"limits": {"nvidia.com/gpu": 1}})
    custom.create_namespaced_custom_object(*TF, "default", "tfjobs", job)

    def unschedulable() -> client.V1PodCondition | None:
        try:
            pod = core.read_namespaced_pod("gpu-worker-0", "default")
        except ApiException:
            return None
        assert pod.status is not None
        return next((c for c in pod.status.conditions or [] if c.type == "PodScheduled" and c.status == "False"), None)

    cond = wait_until(unschedulable, 10, what="PodScheduled=False")
    assert cond.reason == "Unschedulable"
    assert cond.message is not None and cond.message.startswith(
        "0/1 nodes are available: 1 Insufficient nvidia.com/gpu."
    )
    assert phase(core.read_namespaced_pod("gpu-worker-0", "default")) == "Pending"
    with pytest.raises(ApiException) as err:
        core.read_namespaced_pod_log("gpu-worker-0", "default")
    assert err.value.status == 400
    cluster.set_capacity(Capacity(cpu=64, memory_mib=262144, gpu=1))
    wait_until(lambda: condition(get_job(custom, "tfjobs", "gpu"), "Succeeded"), 20, what="the job to run")
    assert core.read_namespaced_pod_log("gpu-worker-0", "default") == "gpu\n"


def test_eviction_fails_the_pod_and_the_job(
    cluster: SimulatedCluster, custom: client.CustomObjectsApi, core: client.CoreV1Api
) -> None:
    custom.create_namespaced_custom_object(*TF, "default", "tfjobs", tfjob("ev", python(GATED)))
    wait_running(core, "ev-worker-0")
    cluster.evict("default", "ev-worker-0", message="The node was low on resource: memory.")
    pod = core.read_namespaced_pod("ev-worker-0", "default")
    assert pod.status is not None
    assert (pod.status.phase, pod.status.reason) == ("Failed", "Evicted")
    assert pod.status.message == "The node was low on resource: memory."
    failed = wait_until(lambda: condition(get_job(custom, "tfjobs", "ev"), "Failed"), 10, what="the job to fail")
    assert failed["reason"] == "TFJobFailed"


def test_configmaps_label_selectors_and_size_limit(core: client.CoreV1Api) -> None:
    for name, labels in (("a", {"trial": "1", "kind": "x"}), ("b", {"trial": "2"}), ("c", {})):
        core.create_namespaced_config_map("default", as_configmap({"metadata": {"name": name, "labels": labels}}))

    def names(selector: str) -> list[str | None]:
        return [metadata(c).name for c in core.list_namespaced_config_map("default", label_selector=selector).items]

    assert names("trial=1") == ["a"]
    assert names("trial!=1") == ["b", "c"]
    assert names("trial in (1,2)") == ["a", "b"]
    assert names("trial notin (1)") == ["b", "c"]
    assert names("trial,!kind") == ["b"]
    core.delete_collection_namespaced_config_map("default", label_selector="trial")
    assert names("") == ["c"]
    with pytest.raises(ApiException) as err:
        core.create_namespaced_config_map(
            "default", as_configmap({"metadata": {"name": "big"}, "data": {"x": "y" * (1 << 20 + 1)}})
        )
    status = error_status(err.value)
    assert err.value.status == 422
    assert status["message"] == 'ConfigMap "big" is invalid: []: Too long: must have at most 1048576 bytes'


ENV_AND_FILES = (
    "import json, os\n"
    "home = os.environ['HOME']\n"
    "def read(p):\n"
    "    return open(os.path.join(home, p)).read()\n"
    "open(os.path.join(home, 'scratch/w'), 'w').write('ok')\n"
    "open(os.path.join(home, 'shared/out'), 'w').write('nfs')\n"
    "print(json.dumps({'env': dict(os.environ), 'cwd': os.getcwd(), 'argv': os.sys.argv[1:],\n"
    "                  'conf': read('etc/conf/renamed'), 'bin': read('etc/conf/blob'),\n"
    "                  'scratch_mode': oct(os.stat(os.path.join(home, 'scratch')).st_mode & 0o777)}))\n"
)


def test_kubelet_runs_the_command_with_only_the_pod_environment_and_volumes(
    cluster: SimulatedCluster,
    custom: client.CustomObjectsApi,
    core: client.CoreV1Api,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("LEAK_ME", "secret")
    core.create_namespaced_config_map(
        "default",
        as_configmap({"metadata": {"name": "conf"}, "data": {"key": "value"}, "binaryData": {"blob": "AAEC"}}),
    )
    job = tfjob(
        "files",
        [sys.executable, "-c", ENV_AND_FILES, "$(GREETING)", "$$(GREETING)", "$(UNDEFINED)"],
        env=[{"name": "GREETING", "value": "hello"}, {"name": "COMBINED", "value": "$(GREETING)-world"}],
        workingDir="/workspace",
        volumeMounts=[
            {"name": "conf", "mountPath": "/etc/conf"},
            {"name": "scratch", "mountPath": "/scratch"},
            {"name": "shared", "mountPath": "/shared"},
        ],
    )
    job["spec"]["tfReplicaSpecs"]["Worker"]["template"]["spec"]["volumes"] = [
        {
            "name": "conf",
            "configMap": {
                "name": "conf",
                "items": [{"key": "key", "path": "renamed"}, {"key": "blob", "path": "blob"}],
            },
        },
        {"name": "scratch", "emptyDir": {}},
        {"name": "shared", "nfs": {"server": "nfs.example", "path": "/exports/trials"}},
    ]
    custom.create_namespaced_custom_object(*TF, "default", "tfjobs", job)
    wait_until(lambda: condition(get_job(custom, "tfjobs", "files"), "Succeeded"), 20, what="the job to succeed")
    report = json.loads(core.read_namespaced_pod_log("files-worker-0", "default"))
    fs = pod_fs(cluster, core, "files-worker-0")
    assert report["argv"] == ["hello", "$(GREETING)", "$(UNDEFINED)"]
    assert report["env"]["COMBINED"] == "hello-world"
    assert "LEAK_ME" not in report["env"]
    assert report["env"]["HOME"] == str(fs)
    assert report["env"]["HOSTNAME"] == "files-worker-0"
    assert {"PATH", "KUBERNETES_SERVICE_HOST", "KUBERNETES_SERVICE_PORT"} <= set(report["env"])
    assert Path(report["cwd"]).resolve() == (fs / "workspace").resolve()
    assert (report["conf"], report["bin"]) == ("value", "\x00\x01\x02")
    assert report["scratch_mode"] == "0o777"
    assert (cluster.root / "nfs" / "nfs.example" / "exports" / "trials" / "out").read_text() == "nfs"


def test_admission_rejections_look_like_the_real_ones(custom: client.CustomObjectsApi) -> None:
    no_tensorflow = tfjob("nocontainer", python("pass"))
    no_tensorflow["spec"]["tfReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]["name"] = "main"
    with pytest.raises(ApiException) as err:
        custom.create_namespaced_custom_object(*TF, "default", "tfjobs", no_tensorflow)
    status = error_status(err.value)
    assert (err.value.status, status["reason"]) == (403, "Forbidden")
    assert status["message"] == (
        'admission webhook "validator.tfjob.training-operator.kubeflow.org" denied the request: '
        "spec.tfReplicaSpecs[Worker].template.spec.containers: Required value: must have at least one container "
        "with name tensorflow"
    )
    bad_policy = tfjob("badpolicy", python("pass"), restart="Sometimes")
    with pytest.raises(ApiException) as err:
        custom.create_namespaced_custom_object(*TF, "default", "tfjobs", bad_policy)
    cause = error_status(err.value)["details"]["causes"][0]
    assert (err.value.status, cause["reason"], cause["field"]) == (
        422,
        "FieldValueNotSupported",
        "spec.tfReplicaSpecs.Worker.restartPolicy",
    )
    bad_label = tfjob("badlabel", python("pass"))
    bad_label["metadata"]["labels"] = {"trial": "not valid!"}
    with pytest.raises(ApiException) as err:
        custom.create_namespaced_custom_object(*TF, "default", "tfjobs", bad_label)
    assert error_status(err.value)["details"]["causes"][0]["field"] == "metadata.labels"
    hyphen = framework("has-hyphen", "pass")
    with pytest.raises(ApiException) as err:
        custom.create_namespaced_custom_object(*FC, "default", "frameworks", hyphen)
    assert err.value.status == 422
    assert "metadata.name in body should match '^[a-z0-9]{1,63}$'" in error_status(err.value)["message"]
    typo = framework("typo", "pass")
    typo["spec"]["taskRoles"][0]["task"]["pod"]["spec"]["containers"][0]["comand"] = ["x"]
    with pytest.raises(ApiException) as err:
        custom.create_namespaced_custom_object(*FC, "default", "frameworks", typo, field_validation="Strict")
    assert 'unknown field "spec.taskRoles[0].task.pod.spec.containers[0].comand"' in error_status(err.value)["message"]


def test_merge_patch_and_status_subresource(custom: client.CustomObjectsApi) -> None:
    created = custom.create_namespaced_custom_object(
        *FC, "default", "frameworks", framework("patched", "pass", execution="Create")
    )
    assert isinstance(created, dict)
    assert created["metadata"]["generation"] == 1
    wait_until(lambda: fc_status(custom, "patched").get("state") == "AttemptCreationPending", 10)
    patched = custom.patch_namespaced_custom_object(
        *FC, "default", "frameworks", "patched", {"metadata": {"labels": {"x": "y"}}}
    )
    assert isinstance(patched, dict)
    assert patched["metadata"]["labels"] == {"x": "y"}
    custom.create_namespaced_custom_object(*TF, "default", "tfjobs", tfjob("sub", python("pass")))

    def replace() -> dict[str, Any] | None:
        job = get_job(custom, "tfjobs", "sub")
        job["status"] = {"conditions": [{"type": "Failed", "status": "True"}]}
        job["spec"]["runPolicy"] = {"cleanPodPolicy": "All"}
        try:
            replaced = custom.replace_namespaced_custom_object(*TF, "default", "tfjobs", "sub", job)
            assert isinstance(replaced, dict)
            return replaced
        except ApiException as e:
            assert e.status == 409  # the operator wrote status in between: optimistic concurrency, as for real
            return None

    job = wait_until(replace, 10, what="a replace without conflict")
    assert job["spec"]["runPolicy"] == {"cleanPodPolicy": "All"}
    assert job["metadata"]["generation"] == 2
    assert {"type": "Failed", "status": "True"} not in (job.get("status") or {}).get("conditions", [])


def test_stop_kills_every_pod_process(tmp_path: Path) -> None:
    sim = SimulatedCluster(tmp_path / "own").start()
    try:
        api = config.new_client_from_config(str(sim.write_kubeconfig(tmp_path / "kc")))
        custom, core = client.CustomObjectsApi(api), client.CoreV1Api(api)
        custom.create_namespaced_custom_object(*TF, "default", "tfjobs", tfjob("forever", python(TERM_AWARE)))
        wait_running(core, "forever-worker-0")
        fs = pod_fs(sim, core, "forever-worker-0")
        wait_until(lambda: (fs / "pid").exists() and (fs / "pid").read_text(), 10, what="the pid file")
        pid = int((fs / "pid").read_text())
    finally:
        sim.stop()
    wait_until(lambda: not Path(f"/proc/{pid}").exists(), 10, what="the process to be gone")


def test_foreground_deletion_waits_for_dependents(custom: client.CustomObjectsApi, core: client.CoreV1Api) -> None:
    custom.create_namespaced_custom_object(*TF, "default", "tfjobs", tfjob("fg", python(TERM_AWARE)))
    wait_running(core, "fg-worker-0")
    deleting = custom.delete_namespaced_custom_object(
        *TF, "default", "tfjobs", "fg", body=client.V1DeleteOptions(propagation_policy="Foreground")
    )
    assert isinstance(deleting, dict)
    assert deleting["metadata"]["deletionTimestamp"]
    assert "foregroundDeletion" in deleting["metadata"]["finalizers"]

    def gone() -> bool:
        try:
            get_job(custom, "tfjobs", "fg")
        except ApiException as e:
            return e.status == 404
        return False

    wait_until(gone, 15, what="the job to go after its pod")
    assert core.list_namespaced_pod("default").items == []


def test_break_log_streams_cuts_a_follow(
    cluster: SimulatedCluster, custom: client.CustomObjectsApi, core: client.CoreV1Api
) -> None:
    custom.create_namespaced_custom_object(*TF, "default", "tfjobs", tfjob("cut", python(GATED)))
    wait_running(core, "cut-worker-0")
    resp = cast(
        HTTPResponse, core.read_namespaced_pod_log("cut-worker-0", "default", follow=True, _preload_content=False)
    )
    outcome: list[BaseException | str] = []

    def read() -> None:
        try:
            for chunk in resp.stream(64):
                outcome.append(chunk.decode())
        except Exception as e:  # urllib3 ProtocolError: the response ended without its last chunk
            outcome.append(e)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    wait_until(lambda: "first\n" in outcome, 10, what="the first line")
    assert cluster.break_log_streams() == 1
    reader.join(10)
    assert isinstance(outcome[-1], Exception)
