"""Microsoft FrameworkController v1, following its state machine for Framework, FrameworkAttempt and Task.

Facts (microsoft/frameworkcontroller, `pkg/controller/controller.go`, `pkg/apis/frameworkcontroller/v1/types.go`,
`funcs.go`, `completion.go`, `constants.go`):
- A new Framework gets status {startTime, state AttemptCreationPending, retryPolicyStatus, attemptStatus{id 0,
  configMapName `<name>-attempt`, taskRoleStatuses[{name, instanceUID, taskStatuses[{index, state
  AttemptCreationPending, attemptStatus{podName `<framework>-<taskrole>-<index>`}}]}]}}. executionType Create keeps
  it there; Start (or empty) creates the attempt's ConfigMap `<name>-attempt` (controller-owned by the Framework,
  finalizer `foregroundDeletion`, label/annotation FC_FRAMEWORK_NAME...) -> AttemptCreationRequested ->
  AttemptPreparing (ConfigMap seen) -> AttemptRunning (a task's pod Running).
- Each task's pod is controller-owned by the ConfigMap, with labels FC_FRAMEWORK_NAME, FC_TASKROLE_NAME,
  FC_TASK_INDEX, the FC_* annotations, the FC_* env vars prepended to every container (FC_POD_UID from
  metadata.uid), `{{FC_*}}` placeholders replaced, and terminationMessagePolicy defaulted to
  FallbackToLogsOnError. Task states: AttemptCreationPending -> AttemptCreationRequested -> AttemptPreparing
  (Pending) -> AttemptRunning (Running) -> AttemptDeletionPending (pod Succeeded/Failed: completion status
  recorded) -> AttemptDeletionRequested (FC deletes the pod) -> AttemptDeleting -> AttemptCompleted (pod gone) ->
  Completed, or a retry (retryPolicy) back to AttemptCreationPending. So FC DELETES every task's pod as soon as it
  completes, and deletes the attempt's ConfigMap (hence any pod left, foreground) when the attempt completes.
- Task completion: Succeeded pod -> code 0 phrase Succeeded type {Succeeded, []} diagnostics "Pod succeeded";
  Failed pod -> exit code 200/201/210 -> ContainerTransientFailed/ContainerTransientConflictFailed/
  ContainerPermanentFailed ("Pod failed: PodPattern matched: {...}"), other non-zero exit -> that code,
  phrase ContainerUnrecognizedFailed, type {Failed, []} ("Pod failed: PodPattern unmatched: {...}"), no failed
  container -> -300 PodFailedWithoutFailedContainer; pod deleted by others -> -101 PodExternalDeleted
  (Transient); pod creation rejected as Invalid -> -200 PodCreationPermanentError.
- FrameworkAttemptCompletionPolicy per task role: minFailedTaskCount/minSucceededTaskCount >= 1 reached -> the
  attempt completes with the triggering task's completion status and trigger {message "FailedTaskCount 1 has
  reached MinFailedTaskCount 1 in the TaskRole" | "SucceededTaskCount ...", taskRoleName, taskIndex}; otherwise
  when all tasks completed: code 0 Succeeded, diagnostics "CompletedTaskCount <n> has reached TotalTaskCount <n>
  and no user specified conditions in FrameworkAttemptCompletionPolicy have ever been triggered".
- Attempt completion: AttemptDeletionPending -> AttemptDeletionRequested (ConfigMap delete) -> AttemptDeleting ->
  AttemptCompleted -> Completed (or retry per spec.retryPolicy: totalRetriedCount++, new attempt). Completed
  Frameworks are kept (frameworkCompletedRetainSec defaults to 30 days).
- executionType Stop: code -210 phrase StopFrameworkRequested type {Failed, [Permanent]} diagnostics "User has
  requested to stop the Framework"; unfinished tasks get -220 FrameworkAttemptCompletion "Stop to complete current
  FrameworkAttempt"; never retried.
- Retry (`funcs.go` ShouldRetry): -210/-220/-230 never retry; fancyRetryPolicy retries Transient failures without
  counting them and never Permanent ones; otherwise maxRetryCount -2 always retries, -1 retries failures,
  n retries failures while accountableRetriedCount < n.
"""

from __future__ import annotations

import contextlib
import copy
import json
import uuid
from typing import TYPE_CHECKING, Any

from simulators.kubesim import resources
from simulators.kubesim.controller import Controller
from simulators.kubesim.errors import ApiError
from simulators.kubesim.store import Event, Store, now_rfc3339

if TYPE_CHECKING:
    from simulators.kubesim.cluster import SimulatedCluster

FAILED, SUCCEEDED = "Failed", "Succeeded"
TRANSIENT, PERMANENT, CONFLICT = "Transient", "Permanent", "Conflict"
CODES: dict[int, tuple[str, str, list[str]]] = {
    200: ("ContainerTransientFailed", FAILED, [TRANSIENT]),
    201: ("ContainerTransientConflictFailed", FAILED, [TRANSIENT, CONFLICT]),
    210: ("ContainerPermanentFailed", FAILED, [PERMANENT]),
    0: ("Succeeded", SUCCEEDED, []),
    -100: ("ConfigMapExternalDeleted", FAILED, [TRANSIENT]),
    -101: ("PodExternalDeleted", FAILED, [TRANSIENT]),
    -110: ("ConfigMapLocalCacheCreationTimeout", FAILED, [TRANSIENT]),
    -111: ("PodLocalCacheCreationTimeout", FAILED, [TRANSIENT]),
    -120: ("PodCreationTransientError", FAILED, [TRANSIENT]),
    -200: ("PodCreationPermanentError", FAILED, [PERMANENT]),
    -210: ("StopFrameworkRequested", FAILED, [PERMANENT]),
    -220: ("FrameworkAttemptCompletion", FAILED, [PERMANENT]),
    -230: ("DeleteTaskRequested", FAILED, [PERMANENT]),
    -300: ("PodFailedWithoutFailedContainer", FAILED, []),
    -310: ("PodCreationUnknownError", FAILED, []),
}
STOP_DIAG = "User has requested to stop the Framework"


def go_json(obj: Any) -> str:
    """encoding/json output: compact, HTML-escaped."""
    text = json.dumps(obj, separators=(",", ":"), ensure_ascii=False)
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def completion(
    code: int, diagnostics: str, phrase: str | None = None, type_: dict[str, Any] | None = None, **extra: Any
) -> dict[str, Any]:
    known = CODES.get(code)
    if phrase is None:
        phrase = known[0] if known else "ContainerUnrecognizedFailed"
    if type_ is None:
        type_ = {"name": known[1], "attributes": list(known[2])} if known else {"name": FAILED, "attributes": []}
    return {"code": code, "phrase": phrase, "type": type_, "diagnostics": diagnostics, **extra}


def pod_completion_status(pod: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    status = pod.get("status") or {}
    if status.get("reason"):
        out["reason"] = status["reason"]
    if status.get("message"):
        out["message"] = status["message"]
    containers = []
    for cs in (status.get("initContainerStatuses") or []) + (status.get("containerStatuses") or []):
        c: dict[str, Any] = {"name": cs["name"]}
        term = (cs.get("state") or {}).get("terminated")
        if term:
            if term.get("reason"):
                c["reason"] = term["reason"]
            if term.get("message"):
                c["message"] = term["message"]
            if term.get("signal"):
                c["signal"] = term["signal"]
            c["code"] = term.get("exitCode", 0)
        else:
            c["code"] = 0
        containers.append(c)
    if containers:
        out["containers"] = containers
    return out


def match_failed_pod(pod: dict[str, Any]) -> dict[str, Any]:
    """completion.go MatchCompletionCodeInfos for a Failed pod."""
    statuses = ((pod.get("status") or {}).get("initContainerStatuses") or []) + (
        (pod.get("status") or {}).get("containerStatuses") or []
    )
    for code in (200, 201, 210):
        for cs in statuses:
            term = (cs.get("state") or {}).get("terminated")
            if term and term.get("exitCode") == code:
                matched: dict[str, Any] = {"name": cs["name"]}
                if term.get("message"):
                    matched["message"] = term["message"]
                matched["code"] = code
                return completion(
                    code,
                    "Pod failed: PodPattern matched: " + go_json({"containers": [matched]}),
                    pod=pod_completion_status(pod),
                )
    last, last_time = None, ""
    for cs in statuses:
        term = (cs.get("state") or {}).get("terminated")
        if term and term.get("exitCode", 0) != 0 and (last is None or (term.get("finishedAt") or "") > last_time):
            last, last_time = term["exitCode"], term.get("finishedAt") or ""
    diag = "Pod failed: PodPattern unmatched: " + go_json(pod_completion_status(pod))
    if last is None:
        return completion(-300, diag, pod=pod_completion_status(pod))
    return completion(
        last, diag, "ContainerUnrecognizedFailed", {"name": FAILED, "attributes": []}, pod=pod_completion_status(pod)
    )


def should_retry(policy: dict[str, Any], rps: dict[str, Any], cs: dict[str, Any]) -> tuple[bool, bool]:
    """(retry, accountable) as RetryPolicySpec.ShouldRetry decides (delays are 0 here)."""
    ctype = cs["type"]
    if cs["code"] in (-210, -220, -230):
        return False, True
    if policy.get("fancyRetryPolicy") and ctype["name"] == FAILED:
        if TRANSIENT in ctype["attributes"]:
            return True, False
        if PERMANENT in ctype["attributes"]:
            return False, True
    max_retry = int(policy.get("maxRetryCount", 0))
    failed = ctype["name"] == FAILED
    if max_retry == -2 or (failed and max_retry == -1) or (failed and rps["accountableRetriedCount"] < max_retry):
        return True, True
    return False, True


class FrameworkController(Controller):
    name = "frameworkcontroller"

    def __init__(self, cluster: SimulatedCluster) -> None:
        super().__init__()
        self.cluster = cluster
        self.store: Store = cluster.store
        self.store.subscribe(self._on_event)

    def _on_event(self, ev: Event) -> None:
        md = ev.obj["metadata"]
        if ev.plural == "frameworks":
            self.queue.add((ev.namespace, md["name"]))
        elif ev.plural == "configmaps":
            for ref in md.get("ownerReferences") or []:
                if ref.get("kind") == "Framework" and ref.get("controller"):
                    self.queue.add((ev.namespace, ref["name"]))
        elif ev.plural == "pods":
            name = (md.get("annotations") or {}).get("FC_FRAMEWORK_NAME")
            if name:
                self.queue.add((ev.namespace, name))

    # ---- status helpers -------------------------------------------------------------------------------------
    @staticmethod
    def _transition(status: dict[str, Any], state: str) -> None:
        """A Framework's or a task's status (they have the same times) moved to `state`."""
        if status["state"] == state:
            return
        now = now_rfc3339()
        if state == "AttemptRunning":
            status["attemptStatus"]["runTime"] = now
            status["runTime"] = status.get("runTime") or now
        if state == "AttemptCompleted":
            status["attemptStatus"]["completionTime"] = now
        if state == "Completed":
            status["completionTime"] = now
        status["state"] = state
        status["transitionTime"] = now

    @staticmethod
    def _task_attempt(f: dict[str, Any], role: str, index: int, attempt: int) -> dict[str, Any]:
        return {
            "id": attempt,
            "startTime": now_rfc3339(),
            "runTime": None,
            "completionTime": None,
            "instanceUID": None,
            "podName": f"{f['metadata']['name']}-{role}-{index}",
            "podUID": None,
            "podNodeName": None,
            "podIP": None,
            "podHostIP": None,
            "completionStatus": None,
        }

    def _task_status(self, f: dict[str, Any], role: str, index: int) -> dict[str, Any]:
        now = now_rfc3339()
        return {
            "index": index,
            "instanceUID": str(uuid.uuid4()),
            "startTime": now,
            "runTime": None,
            "completionTime": None,
            "state": "AttemptCreationPending",
            "transitionTime": now,
            "deletionPending": False,
            "retryPolicyStatus": {"totalRetriedCount": 0, "accountableRetriedCount": 0, "retryDelaySec": None},
            "attemptStatus": self._task_attempt(f, role, index, 0),
        }

    def _attempt(self, f: dict[str, Any], attempt: int) -> dict[str, Any]:
        roles = []
        for tr in f["spec"].get("taskRoles") or []:
            roles.append(
                {
                    "name": tr["name"],
                    "instanceUID": str(uuid.uuid4()),
                    "podGracefulDeletionTimeoutSec": (tr.get("task") or {}).get("podGracefulDeletionTimeoutSec"),
                    "taskStatuses": [self._task_status(f, tr["name"], i) for i in range(int(tr["taskNumber"]))],
                }
            )
        return {
            "id": attempt,
            "startTime": now_rfc3339(),
            "runTime": None,
            "completionTime": None,
            "instanceUID": None,
            "configMapName": f"{f['metadata']['name']}-attempt",
            "configMapUID": None,
            "completionStatus": None,
            "taskRoleStatuses": roles,
        }

    @staticmethod
    def _tasks(status: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
        return [(r["name"], t) for r in status["attemptStatus"]["taskRoleStatuses"] for t in r["taskStatuses"]]

    @staticmethod
    def _completing(status: dict[str, Any]) -> bool:
        return status["state"] in ("AttemptDeletionPending", "AttemptDeletionRequested", "AttemptDeleting")

    def _complete_task_attempt(self, ts: dict[str, Any], force: bool, cs: dict[str, Any] | None) -> None:
        if ts["attemptStatus"]["completionStatus"] is None:
            ts["attemptStatus"]["completionStatus"] = cs
        self._transition(ts, "AttemptCompleted" if force else "AttemptDeletionPending")

    def _complete_framework_attempt(self, status: dict[str, Any], force: bool, cs: dict[str, Any] | None) -> None:
        if status["attemptStatus"]["completionStatus"] is None:
            status["attemptStatus"]["completionStatus"] = cs
        for _, ts in self._tasks(status):
            if ts["attemptStatus"]["completionStatus"] is None:
                ts["attemptStatus"]["completionStatus"] = completion(-220, "Stop to complete current FrameworkAttempt")
        if force:
            for _, ts in self._tasks(status):
                if ts["state"] != "Completed":
                    if ts["state"] != "AttemptCompleted":
                        self._complete_task_attempt(ts, True, None)
                    ts["retryPolicyStatus"]["retryDelaySec"] = None
                    self._transition(ts, "Completed")
            self._transition(status, "AttemptCompleted")
        else:
            self._transition(status, "AttemptDeletionPending")

    # ---- reconcile ------------------------------------------------------------------------------------------
    def reconcile(self, key: Any) -> None:
        ns, name = key
        rt = self.cluster.registry.get("frameworks")
        if rt is None:
            return
        f = self.store.get(rt, ns, name)
        if f is None or f["metadata"].get("deletionTimestamp"):
            return
        old = copy.deepcopy(f.get("status"))
        if f.get("status") is None:
            now = now_rfc3339()
            f["status"] = {
                "startTime": now,
                "runTime": None,
                "completionTime": None,
                "state": "AttemptCreationPending",
                "transitionTime": now,
                "retryPolicyStatus": {"totalRetriedCount": 0, "accountableRetriedCount": 0, "retryDelaySec": None},
                "attemptStatus": self._attempt(f, 0),
            }
            again = True
        else:
            again = self._sync(f)
        if f["status"] != old:
            status = f["status"]

            def write(o: dict[str, Any]) -> None:
                o["status"] = status

            with contextlib.suppress(ApiError):
                self.store.update(rt, ns, name, write, expect_uid=f["metadata"]["uid"])
        if again:
            self.queue.add_after(key, 0.01)

    def _sync(self, f: dict[str, Any]) -> bool:
        """One syncFrameworkState pass; True when FC would enqueue itself again."""
        status = f["status"]
        spec = f.get("spec") or {}
        md = f["metadata"]
        stop = spec.get("executionType") == "Stop"
        if status["state"] == "Completed":
            return False
        cm = None
        if status["state"] != "AttemptCompleted":
            cm = self.store.get(resources.CONFIGMAPS, md["namespace"], f"{md['name']}-attempt")
            if cm is not None and cm["metadata"]["uid"] != status["attemptStatus"]["configMapUID"]:
                if any(
                    r.get("uid") == md["uid"] and r.get("controller")
                    for r in cm["metadata"].get("ownerReferences") or []
                ):
                    self._delete(resources.CONFIGMAPS, cm)
                cm = None
            if cm is None:
                if status["state"] != "AttemptCreationPending":
                    if status["attemptStatus"]["completionStatus"] is None:
                        self._complete_framework_attempt(
                            status, True, completion(-100, "ConfigMap was deleted by others")
                        )
                    else:
                        self._complete_framework_attempt(status, True, None)
                    return True
            elif not cm["metadata"].get("deletionTimestamp"):
                if status["state"] == "AttemptDeletionPending":
                    self._delete(resources.CONFIGMAPS, cm)
                    self._transition(status, "AttemptDeletionRequested")
                if status["state"] == "AttemptCreationRequested":
                    self._transition(status, "AttemptPreparing")
            else:
                if status["attemptStatus"]["completionStatus"] is None:
                    status["attemptStatus"]["completionStatus"] = completion(
                        -100, "ConfigMap is being deleted by others"
                    )
                self._transition(status, "AttemptDeleting")
        if status["state"] == "AttemptCompleted":
            rps = status["retryPolicyStatus"]
            retry, accountable = should_retry(
                spec.get("retryPolicy") or {}, rps, status["attemptStatus"]["completionStatus"]
            )
            if rps["retryDelaySec"] is None:
                if not retry:
                    self._transition(status, "Completed")
                    return False
                rps["retryDelaySec"] = 0
            rps["totalRetriedCount"] += 1
            if accountable:
                rps["accountableRetriedCount"] += 1
            rps["retryDelaySec"] = None
            status["attemptStatus"] = self._attempt(f, rps["totalRetriedCount"])
            self._transition(status, "AttemptCreationPending")
            return True
        if status["state"] == "AttemptCreationPending":
            if spec.get("executionType") == "Create":
                return False
            if stop:
                self._complete_framework_attempt(status, True, completion(-210, STOP_DIAG))
                return True
            cm = self._create_configmap(f)
            if cm is None:
                return False
            status["attemptStatus"]["configMapUID"] = cm["metadata"]["uid"]
            status["attemptStatus"]["instanceUID"] = f"{status['attemptStatus']['id']}_{cm['metadata']['uid']}"
            self._transition(status, "AttemptCreationRequested")
            return True
        if not self._completing(status) and stop:
            self._complete_framework_attempt(status, False, completion(-210, STOP_DIAG))
        if not self._completing(status):
            self._completion_policy(f)
        again = False
        for role, ts in self._tasks(status):
            again = self._sync_task(f, cm, role, ts) or again
        if status["state"] == "AttemptPreparing" and any(
            ts["state"] == "AttemptRunning" for _, ts in self._tasks(status)
        ):
            self._transition(status, "AttemptRunning")
        return again

    def _create_configmap(self, f: dict[str, Any]) -> dict[str, Any] | None:
        md = f["metadata"]
        cm = {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {
                "name": f"{md['name']}-attempt",
                "namespace": md["namespace"],
                "ownerReferences": [
                    {
                        "apiVersion": "frameworkcontroller.microsoft.com/v1",
                        "kind": "Framework",
                        "name": md["name"],
                        "uid": md["uid"],
                        "controller": True,
                        "blockOwnerDeletion": True,
                    }
                ],
                "finalizers": ["foregroundDeletion"],
                "annotations": {
                    "FC_FRAMEWORK_NAMESPACE": md["namespace"],
                    "FC_FRAMEWORK_NAME": md["name"],
                    "FC_CONFIGMAP_NAME": f"{md['name']}-attempt",
                    "FC_FRAMEWORK_UID": md["uid"],
                    "FC_FRAMEWORK_ATTEMPT_ID": str(f["status"]["attemptStatus"]["id"]),
                },
                "labels": {"FC_FRAMEWORK_NAME": md["name"]},
            },
        }
        try:
            return self.store.create(resources.CONFIGMAPS, cm)
        except ApiError:
            return None

    def _delete(self, rt: resources.ResourceType, obj: dict[str, Any]) -> None:
        with contextlib.suppress(ApiError):
            self.store.delete(
                rt, obj["metadata"]["namespace"], obj["metadata"]["name"], precondition_uid=obj["metadata"]["uid"]
            )

    def _completion_policy(self, f: dict[str, Any]) -> None:
        status = f["status"]
        roles = {r["name"]: r for r in status["attemptStatus"]["taskRoleStatuses"]}
        first: tuple[str, dict[str, Any]] | None = None
        for tr in f["spec"].get("taskRoles") or []:
            trs = roles.get(tr["name"])
            if trs is None:
                continue
            policy = tr.get("frameworkAttemptCompletionPolicy") or {}
            done = sorted(
                (t for t in trs["taskStatuses"] if t["state"] == "Completed"),
                key=lambda t: (t["completionTime"] or "", t["index"]),
            )
            for kind, minimum in (
                ("Failed", int(policy.get("minFailedTaskCount", 0))),
                ("Succeeded", int(policy.get("minSucceededTaskCount", 0))),
            ):
                chosen = [t for t in done if t["attemptStatus"]["completionStatus"]["type"]["name"] == kind]
                if minimum >= 1 and len(chosen) >= minimum:
                    trigger = chosen[minimum - 1]
                    if first is None or (trigger["completionTime"] or "") < (first[1]["completionTime"] or ""):
                        cs = {k: v for k, v in trigger["attemptStatus"]["completionStatus"].items() if k != "pod"}
                        cs["trigger"] = {
                            "message": f"{kind}TaskCount {len(chosen)} has reached Min{kind}TaskCount {minimum} "
                            "in the TaskRole",
                            "taskRoleName": tr["name"],
                            "taskIndex": trigger["index"],
                        }
                        first = (tr["name"], {**trigger, "cs": cs})
        if first is not None:
            self._complete_framework_attempt(status, False, first[1]["cs"])
            return
        total = sum(int(tr["taskNumber"]) for tr in f["spec"].get("taskRoles") or [])
        tasks = self._tasks(status)
        completed = [(r, t) for r, t in tasks if t["state"] == "Completed"]
        if total >= 1 and len(completed) >= total:
            role, last = max(completed, key=lambda rt: (rt[1]["completionTime"] or "", rt[1]["index"]))
            diag = (
                f"CompletedTaskCount {len(completed)} has reached TotalTaskCount {total} and no user specified "
                "conditions in FrameworkAttemptCompletionPolicy have ever been triggered"
            )
            self._complete_framework_attempt(
                status,
                False,
                completion(0, diag, trigger={"message": diag, "taskRoleName": role, "taskIndex": last["index"]}),
            )

    def _task_spec(self, f: dict[str, Any], role: str) -> dict[str, Any] | None:
        return next((tr for tr in f["spec"].get("taskRoles") or [] if tr["name"] == role), None)

    def _sync_task(self, f: dict[str, Any], cm: dict[str, Any] | None, role: str, ts: dict[str, Any]) -> bool:
        status = f["status"]
        md = f["metadata"]
        if ts["state"] == "Completed":
            return False
        if ts["state"] != "AttemptCompleted":
            pod = self.store.get(resources.PODS, md["namespace"], ts["attemptStatus"]["podName"])
            if pod is not None and pod["metadata"]["uid"] != ts["attemptStatus"]["podUID"]:
                if cm is not None and any(
                    r.get("uid") == cm["metadata"]["uid"] and r.get("controller")
                    for r in pod["metadata"].get("ownerReferences") or []
                ):
                    self._delete(resources.PODS, pod)
                pod = None
            if pod is None:
                if ts["state"] != "AttemptCreationPending":
                    if ts["attemptStatus"]["completionStatus"] is None:
                        self._complete_task_attempt(ts, True, completion(-101, "Pod was deleted by others"))
                    else:
                        self._complete_task_attempt(ts, True, None)
                    return True
            elif not pod["metadata"].get("deletionTimestamp"):
                if ts["state"] == "AttemptDeletionPending":
                    self._delete(resources.PODS, pod)
                    self._transition(ts, "AttemptDeletionRequested")
                if ts["state"] == "AttemptDeletionRequested":
                    return False
                if ts["state"] == "AttemptCreationRequested":
                    self._transition(ts, "AttemptPreparing")
                att = ts["attemptStatus"]
                att["podNodeName"] = pod["spec"].get("nodeName", "")
                att["podIP"] = (pod.get("status") or {}).get("podIP", "")
                att["podHostIP"] = (pod.get("status") or {}).get("hostIP", "")
                phase = (pod.get("status") or {}).get("phase")
                if phase == "Pending":
                    self._transition(ts, "AttemptPreparing")
                elif phase == "Running":
                    self._transition(ts, "AttemptRunning")
                elif phase == "Succeeded":
                    self._complete_task_attempt(
                        ts, False, completion(0, "Pod succeeded", pod=pod_completion_status(pod))
                    )
                    return True
                elif phase == "Failed":
                    self._complete_task_attempt(ts, False, match_failed_pod(pod))
                    return True
                return False
            else:
                if ts["attemptStatus"]["completionStatus"] is None:
                    ts["attemptStatus"]["completionStatus"] = completion(-101, "Pod is being deleted by others")
                self._transition(ts, "AttemptDeleting")
                return False
        if ts["state"] in ("AttemptPreparing", "AttemptRunning"):
            return False
        if ts["state"] == "AttemptCompleted":
            tr = self._task_spec(f, role)
            rps = ts["retryPolicyStatus"]
            if tr is None:
                retry, accountable = False, True
            else:
                retry, accountable = should_retry(
                    (tr.get("task") or {}).get("retryPolicy") or {}, rps, ts["attemptStatus"]["completionStatus"]
                )
            if rps["retryDelaySec"] is None:
                if retry:
                    rps["retryDelaySec"] = 0
                else:
                    self._transition(ts, "Completed")
            if rps["retryDelaySec"] is not None:
                rps["totalRetriedCount"] += 1
                if accountable:
                    rps["accountableRetriedCount"] += 1
                rps["retryDelaySec"] = None
                ts["attemptStatus"] = self._task_attempt(f, role, ts["index"], rps["totalRetriedCount"])
                self._transition(ts, "AttemptCreationPending")
                return True
        if ts["state"] == "AttemptCreationPending":
            if self._completing(status) or cm is None:
                return False
            return self._create_task_pod(f, cm, role, ts)
        if ts["state"] == "Completed" and not self._completing(status):
            self._completion_policy(f)
        return False

    def _create_task_pod(self, f: dict[str, Any], cm: dict[str, Any], role: str, ts: dict[str, Any]) -> bool:
        md = f["metadata"]
        status = f["status"]
        tr = self._task_spec(f, role)
        if tr is None:
            return False
        index = str(ts["index"])
        pod_name = ts["attemptStatus"]["podName"]
        att = status["attemptStatus"]
        role_status = next(r for r in att["taskRoleStatuses"] if r["name"] == role)
        text = json.dumps((tr.get("task") or {}).get("pod") or {})
        for placeholder, value in (
            ("FC_FRAMEWORK_NAMESPACE", md["namespace"]),
            ("FC_FRAMEWORK_NAME", md["name"]),
            ("FC_TASKROLE_NAME", role),
            ("FC_TASK_INDEX", index),
            ("FC_CONFIGMAP_NAME", att["configMapName"]),
            ("FC_POD_NAME", pod_name),
        ):
            text = text.replace("{{" + placeholder + "}}", value)
        template = json.loads(text)
        pod_md = dict(template.get("metadata") or {})
        annotations = dict(pod_md.get("annotations") or {})
        values = {
            "FC_FRAMEWORK_NAMESPACE": md["namespace"],
            "FC_FRAMEWORK_NAME": md["name"],
            "FC_TASKROLE_NAME": role,
            "FC_TASK_INDEX": index,
            "FC_CONFIGMAP_NAME": att["configMapName"],
            "FC_POD_NAME": pod_name,
            "FC_FRAMEWORK_UID": md["uid"],
            "FC_FRAMEWORK_ATTEMPT_ID": str(att["id"]),
            "FC_FRAMEWORK_ATTEMPT_INSTANCE_UID": att["instanceUID"],
            "FC_CONFIGMAP_UID": cm["metadata"]["uid"],
            "FC_TASKROLE_UID": role_status["instanceUID"],
            "FC_TASK_UID": ts["instanceUID"],
            "FC_TASK_ATTEMPT_ID": str(ts["attemptStatus"]["id"]),
        }
        annotations.update(values)
        labels = dict(pod_md.get("labels") or {})
        labels.update({"FC_FRAMEWORK_NAME": md["name"], "FC_TASKROLE_NAME": role, "FC_TASK_INDEX": index})
        predefined = [{"name": k, "value": v} for k, v in values.items()]
        predefined.insert(13, {"name": "FC_POD_UID", "valueFrom": {"fieldRef": {"fieldPath": "metadata.uid"}}})
        predefined.append(
            {"name": "FC_TASK_ATTEMPT_INSTANCE_UID", "value": f"{ts['attemptStatus']['id']}_$(FC_POD_UID)"}
        )
        spec = template.get("spec") or {}
        for c in (spec.get("containers") or []) + (spec.get("initContainers") or []):
            c["env"] = copy.deepcopy(predefined) + list(c.get("env") or [])
            c.setdefault("terminationMessagePolicy", "FallbackToLogsOnError")
        pod = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                **{k: v for k, v in pod_md.items() if k in ("labels", "annotations", "finalizers")},
                "name": pod_name,
                "namespace": md["namespace"],
                "labels": labels,
                "annotations": annotations,
                "ownerReferences": [
                    *(pod_md.get("ownerReferences") or []),
                    {
                        "apiVersion": "v1",
                        "kind": "ConfigMap",
                        "name": cm["metadata"]["name"],
                        "uid": cm["metadata"]["uid"],
                        "controller": True,
                        "blockOwnerDeletion": True,
                    },
                ],
            },
            "spec": spec,
        }
        try:
            created = self.cluster.create_pod(pod)
        except ApiError as e:
            diag = "Failed to create Pod: " + go_json({"ErrStatus": e.status()})
            if e.code == 422 or e.code == 413:
                code = -200
            elif e.code in (400, 403):
                code = -310
            else:
                raise  # transient: FC retries
            self._complete_task_attempt(ts, True, completion(code, diag))
            return True
        ts["attemptStatus"]["podUID"] = created["metadata"]["uid"]
        ts["attemptStatus"]["instanceUID"] = f"{ts['attemptStatus']['id']}_{created['metadata']['uid']}"
        self._transition(ts, "AttemptCreationRequested")
        return True
