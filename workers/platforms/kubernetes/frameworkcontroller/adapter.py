"""The frameworkcontroller platform (NNI's `frameworkcontroller` training service): each trial attempt
is one `frameworkcontroller.microsoft.com/v1` Framework, one task role per `taskRoles` entry, run by
the cluster's FrameworkController. How it is followed is workers.platforms.kubernetes.adapter'.
"""

from __future__ import annotations

from typing import Any, ClassVar

from core.platform import TrialAssignment
from schemas.trial import TrialJobStatus
from workers.platforms.kubernetes.adapter import KubernetesPlatform
from workers.platforms.kubernetes.cluster import JobState, ResourceKind, trial_labels
from workers.platforms.kubernetes.config import KubernetesConfig
from workers.platforms.kubernetes.frameworkcontroller.config import FrameworkControllerConfig

FRAMEWORK = ResourceKind("frameworkcontroller.microsoft.com", "v1", "frameworks", "Framework")
_NO_RETRY = {"fancyRetryPolicy": False, "maxRetryCount": 0}  # one attempt is one run: retries are maxTrialRetries'
_RUNNING_STATES = {"AttemptRunning", "AttemptDeletionPending", "AttemptDeletionRequested", "AttemptDeleting"}


class FrameworkControllerPlatform(KubernetesPlatform[FrameworkControllerConfig]):
    name: ClassVar[str] = "frameworkcontroller"
    config_model: ClassVar[type[KubernetesConfig]] = FrameworkControllerConfig

    @classmethod
    def resource_kind(cls, config: FrameworkControllerConfig) -> ResourceKind:
        return FRAMEWORK

    def manifest(
        self, trial: TrialAssignment[FrameworkControllerConfig], config: FrameworkControllerConfig, name: str
    ) -> dict[str, Any]:
        roles = [
            {
                "name": role.name,
                "taskNumber": role.task_number,
                "frameworkAttemptCompletionPolicy": {
                    "minFailedTaskCount": role.framework_attempt_completion_policy.min_failed_task_count,
                    "minSucceededTaskCount": role.framework_attempt_completion_policy.min_succeed_task_count,
                },
                "task": {
                    "retryPolicy": _NO_RETRY,
                    "pod": self.pod_template(
                        trial,
                        config,
                        name,
                        container=role.name,
                        image=role.docker_image,
                        command=role.command,
                        cpu=role.cpu_number,
                        memory_mib=role.memory_size,
                        gpus=role.gpu_number,
                    ),
                },
            }
            for role in config.task_roles
        ]
        return {
            "apiVersion": f"{FRAMEWORK.group}/{FRAMEWORK.version}",
            "kind": FRAMEWORK.kind,
            "metadata": {"name": name, "labels": trial_labels(trial)},
            "spec": {"executionType": "Start", "retryPolicy": _NO_RETRY, "taskRoles": roles},
        }

    @classmethod
    def state_of(cls, resource: dict[str, Any]) -> JobState:
        """NNI's reading of `status.state`; a Framework someone set to `executionType: Stop` was stopped
        by the cluster's side, not by the trial."""
        status = resource.get("status") or {}
        state = status.get("state")
        if state == "Completed":
            completion = (status.get("attemptStatus") or {}).get("completionStatus") or {}
            message = completion.get("diagnostics") or completion.get("phrase")
            if resource.get("spec", {}).get("executionType") == "Stop":
                return JobState("ended", TrialJobStatus.SYS_CANCELED, f"the Framework was stopped: {message}")
            succeeded = (completion.get("type") or {}).get("name") == "Succeeded"
            outcome = TrialJobStatus.SUCCEEDED if succeeded else TrialJobStatus.FAILED
            return JobState("ended", outcome, message, _primary_exit(status))
        if state in _RUNNING_STATES:
            return JobState("running")
        return JobState("waiting")

    @classmethod
    def primary_pod(cls, name: str, config: FrameworkControllerConfig) -> str:
        return f"{name}-{config.task_roles[0].name}-0"


def _primary_exit(status: dict[str, Any]) -> dict[str, Any] | None:
    """How task 0 of the first role ended, as the Framework records it: its pod is deleted by then."""
    roles = (status.get("attemptStatus") or {}).get("taskRoleStatuses") or []
    tasks = roles[0].get("taskStatuses") or [] if roles else []
    completion = ((tasks[0].get("attemptStatus") or {}).get("completionStatus") or {}) if tasks else {}
    containers = (completion.get("pod") or {}).get("containers") or []
    if not containers:
        return None
    return {"exitCode": containers[0].get("code"), "message": containers[0].get("message", "")}
