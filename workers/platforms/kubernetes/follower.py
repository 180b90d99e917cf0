"""Following one attempt (one custom resource and its pods) to its end: launched, watched, its metrics read
from its primary pod's log, its outcome told from the resource's state and its pods' exit codes."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

import urllib3
from kubernetes import client as k8s
from kubernetes.client.exceptions import ApiException

from core.platform import (
    Abandoned,
    Lost,
    TrialAssignment,
    TrialControl,
    TrialOutcome,
)
from schemas.trial import TrialJobStatus
from workers.platforms.kubernetes.cluster import (
    REQUEST_TIMEOUT,
    WORK_DIR,
    JobState,
    describe,
    resource_name,
)
from workers.platforms.kubernetes.config import KubernetesConfig, KubernetesConfigT
from workers.platforms.kubernetes.pod_log import LogFollower
from workers.platforms.kubernetes.watch import WatchedKind
from workers.platforms.shared.trial_contract import (
    failure_message,
)

log = logging.getLogger(__name__)

FOLLOW_IDLE_S = 5.0  # a safety net: the watches, a stop or the log follower wake an attempt at once
UNSEEN_CHECK_S = 30.0  # a resource created but never seen by the watch is looked up directly after this
LOG_DRAIN_S = 60.0  # how long an ended attempt waits for the rest of its pod's log
PRIMARY_END_WAIT_S = 5.0  # how long an ended job waits for its primary pod to end (for its exit code)

if TYPE_CHECKING:  # the platform makes its followers
    from workers.platforms.kubernetes.adapter import KubernetesPlatform


class AttemptFollower:
    """One attempt of a trial: its custom resource, created, then followed to its end."""

    def __init__(
        self,
        platform: KubernetesPlatform[Any],
        trial: TrialAssignment[KubernetesConfigT],
        control: TrialControl | None,
        config: KubernetesConfig,
    ) -> None:
        self.platform, self.trial, self.config = platform, trial, config
        self.control = control
        self.kind = platform.resource_kind(config)
        self.name = resource_name(trial)
        self.pod = platform.primary_pod(self.name, config)
        self.custom = k8s.CustomObjectsApi(platform._api(config))
        self.started = False
        self.seen = False
        self.deleted = False
        self.logs: LogFollower | None = None
        self.unschedulable_since: float | None = None
        self.told: str | None = None
        self.created_at = time.monotonic()
        self.last_primary: dict[str, Any] | None = None  # FrameworkController deletes pods as the attempt ends
        self.unknown = False
        self.ended_at: float | None = None
        self.recheck_s = FOLLOW_IDLE_S

    def create(self) -> None:
        kind = self.kind
        try:
            self.custom.create_namespaced_custom_object(
                kind.group,
                kind.version,
                self.config.namespace,
                kind.plural,
                self.platform.manifest(self.trial, self.config, self.name),
                field_validation="Strict",
                _request_timeout=REQUEST_TIMEOUT,
            )
        except ApiException as error:
            if error.status != 409:  # 409: an earlier delivery of this attempt created it: it is followed
                raise
        self.created_at = time.monotonic()

    def exists(self) -> bool:
        kind = self.kind
        try:
            self.custom.get_namespaced_custom_object(
                kind.group,
                kind.version,
                self.config.namespace,
                kind.plural,
                self.name,
                _request_timeout=REQUEST_TIMEOUT,
            )
        except ApiException as error:
            if error.status == 404:
                return False
            raise
        self.created_at = time.monotonic()
        return True

    def delete(self) -> None:
        """With its pods (background propagation). What the cluster cannot be asked now, clean-up deletes."""
        kind = self.kind
        self.deleted = True
        try:
            self.custom.delete_namespaced_custom_object(
                kind.group,
                kind.version,
                self.config.namespace,
                kind.plural,
                self.name,
                propagation_policy="Background",
                _request_timeout=REQUEST_TIMEOUT,
            )
        except ApiException as error:
            if error.status != 404:
                log.warning("deleting %s %s: %s", kind.kind, self.name, describe(error))
        except urllib3.exceptions.HTTPError as error:
            log.warning("deleting %s %s: %s", kind.kind, self.name, describe(error))

    def follow(self) -> TrialOutcome | Lost | Abandoned:
        control = self.control
        assert control is not None
        resources = self.platform.watched(self.config, "resources")
        pods = self.platform.watched(self.config, "pods")
        resources.listen(self.name, control.wake)
        pods.listen(self.name, control.wake)
        try:
            while True:
                self.recheck_s = FOLLOW_IDLE_S
                outcome = self._step(resources, pods, control)
                if outcome is not None:
                    return outcome
                control.wait(self.recheck_s)
        finally:
            resources.forget(self.name, control.wake)
            pods.forget(self.name, control.wake)
            if self.logs is not None:
                self.logs.stop()

    def _step(
        self, resources: WatchedKind, pods: WatchedKind, control: TrialControl
    ) -> TrialOutcome | Abandoned | None:
        stop = control.stop_request()
        if stop is not None:
            if stop.lease_lost:  # another worker follows it now; it runs on
                return Abandoned(stop.reason)
            self.delete()
            return TrialOutcome(stop.status, message=stop.reason)
        trouble = resources.trouble() or pods.trouble()
        if self.started and (trouble is not None) != self.unknown:  # UNKNOWN while the cluster cannot be followed
            self.unknown = trouble is not None
            control.unreachable(f"the cluster cannot be reached: {trouble}" if trouble else None)
        if trouble is not None:
            self.recheck_s = 1.0
            return None
        resource = resources.get(self.name)
        if resource is None:
            if not (self.seen or self._gone_unseen(resources)):
                return None
            return TrialOutcome(
                TrialJobStatus.FAILED,
                message=f"the {self.kind.kind} {self.config.namespace}/{self.name} was deleted outside trialstream",
            )
        self.seen = True
        state = self.platform.state_of(resource)
        own_pods = {pod["metadata"]["name"]: pod for pod in pods.grouped(self.name)}
        primary = own_pods.get(self.pod) or self.last_primary
        self.last_primary = primary
        self._note_start(state, primary, pods, control)
        stopped = _stopped_by_cluster(own_pods.values())
        if stopped is not None and state.phase != "waiting":
            state = JobState("ended", TrialJobStatus.SYS_CANCELED, stopped)
        if state.phase == "ended":
            return self._ended(state, primary, pods, control)
        if state.phase == "waiting":
            return self._unschedulable(own_pods.values(), control)
        return None

    def _note_start(
        self, state: JobState, primary: dict[str, Any] | None, pods: WatchedKind, control: TrialControl
    ) -> None:
        """RUNNING once the resource runs or its primary container started; its log followed from then on."""
        if not self.started and (state.phase != "waiting" or _container_started(primary)):
            self.started = True
            control.started(WORK_DIR, url=f"kubernetes://{self.config.namespace}/pods/{self.pod}")
        if self.logs is None and _container_started(primary):
            self.logs = LogFollower(
                k8s.CoreV1Api(self.platform._api(self.config)),
                self.config.namespace,
                self.pod,
                control,
                lambda: _container_ended(pods.get(self.pod)),
            )
            self.logs.start()

    def _ended(
        self, state: JobState, primary: dict[str, Any] | None, pods: WatchedKind, control: TrialControl
    ) -> TrialOutcome | None:
        """The outcome once the primary pod ended too (for its exit code) and its log is read to the end."""
        primary_now = pods.get(self.pod)
        if self._primary_still_ending(primary_now):
            return None
        if _container_ended(primary_now):  # else its log has no end to wait for
            self._drain_logs(control)
        if state.status is TrialJobStatus.SYS_CANCELED:
            self.delete()  # nothing of it may start again unobserved (a suspended job resumed)
        return self._outcome(state, primary)

    def _primary_still_ending(self, primary: dict[str, Any] | None) -> bool:
        """The job's end can be seen before its primary pod's: its exit code is worth a moment's wait."""
        if _container_ended(primary):
            return False
        now = time.monotonic()
        if self.ended_at is None:
            self.ended_at = now
        self.recheck_s = 0.2
        return now - self.ended_at < PRIMARY_END_WAIT_S

    def _gone_unseen(self, resources: WatchedKind) -> bool:
        """Created, yet never seen by the watch: after a while, asked directly whether it exists."""
        if not resources.synced.is_set() or time.monotonic() - self.created_at < UNSEEN_CHECK_S:
            return False
        if self.exists():
            self.seen = True  # it is there; the watch will bring it
            return False
        return True

    def _drain_logs(self, control: TrialControl) -> None:
        """Every metric of the pod's log read before the end is recorded (the stream ends with the container)."""
        if self.logs is None:
            return
        deadline = time.monotonic() + LOG_DRAIN_S
        while not self.logs.done.is_set() and time.monotonic() < deadline:
            if control.stop_request() is not None:
                return
            control.wait(0.5)

    def _outcome(self, state: JobState, primary: dict[str, Any] | None) -> TrialOutcome:
        terminated = _terminated(primary) or state.primary_exit or {}
        exit_code = terminated.get("exitCode") if terminated else None
        status = state.status or TrialJobStatus.FAILED
        if status is TrialJobStatus.FAILED:
            if exit_code:
                return TrialOutcome(
                    status, exit_code, failure_message(exit_code, terminated.get("message", "").strip())
                )
            return TrialOutcome(status, exit_code, state.message or "the job failed")
        return TrialOutcome(status, exit_code, state.message if status is not TrialJobStatus.SUCCEEDED else None)

    def _unschedulable(self, pods: Any, control: TrialControl) -> TrialOutcome | None:
        """A pod the cluster cannot place: told in the trial's message after a while, FAILED after its limit."""
        reasons = [
            f"pod {pod['metadata']['name']} cannot be scheduled: {condition.get('message') or 'Unschedulable'}"
            for pod in pods
            for condition in pod.get("status", {}).get("conditions") or []
            if condition.get("type") == "PodScheduled" and condition.get("reason") == "Unschedulable"
        ]
        if not reasons:
            self.unschedulable_since = None
            return None
        now = time.monotonic()
        if self.unschedulable_since is None:
            self.unschedulable_since = now
        waited = now - self.unschedulable_since
        limit = self.config.fail_unschedulable_after
        if limit is not None and waited >= limit:
            self.delete()
            return TrialOutcome(TrialJobStatus.FAILED, message=f"{reasons[0]} (for {waited:.0f} s)")
        if waited >= self.config.report_unschedulable_after:
            if reasons[0] != self.told:
                self.told = reasons[0]
                control.waiting(reasons[0])
        else:
            self.recheck_s = min(self.recheck_s, self.config.report_unschedulable_after - waited)
        if limit is not None:
            self.recheck_s = min(self.recheck_s, max(0.1, limit - waited))
        return None


def _container_status(pod: dict[str, Any] | None) -> dict[str, Any]:
    statuses = (pod or {}).get("status", {}).get("containerStatuses") or []
    return statuses[0].get("state") or {} if statuses else {}


def _container_started(pod: dict[str, Any] | None) -> bool:
    state = _container_status(pod)
    return "running" in state or "terminated" in state


def _container_ended(pod: dict[str, Any] | None) -> bool:
    return pod is None or "terminated" in _container_status(pod)


def _terminated(pod: dict[str, Any] | None) -> dict[str, Any]:
    terminated: dict[str, Any] = _container_status(pod).get("terminated") or {}
    return terminated


def _stopped_by_cluster(pods: Any) -> str | None:
    """A pod the cluster took away (evicted, preempted): the trial did not fail, it was stopped."""
    for pod in pods:
        status = pod.get("status", {})
        if status.get("phase") == "Failed" and status.get("reason") in ("Evicted", "Preempted", "Shutdown"):
            detail = f": {status['message']}" if status.get("message") else ""
            return f"the cluster stopped pod {pod['metadata']['name']} ({status['reason']}{detail})"
    return None
