"""The kubeflow platform (NNI's `kubeflow` training service): each trial attempt is one Kubeflow
training job, a `kubeflow.org/v1` TFJob (`operator: tf-operator`) or PyTorchJob (`pytorch-operator`),
run by the cluster's training-operator. How it is followed is workers.platforms.kubernetes.adapter'.
"""

from __future__ import annotations

from typing import Any, ClassVar

from core.platform import TrialAssignment
from schemas.trial import TrialJobStatus
from workers.platforms.kubernetes.adapter import KubernetesPlatform
from workers.platforms.kubernetes.cluster import JobState, ResourceKind, trial_labels
from workers.platforms.kubernetes.config import KubernetesConfig
from workers.platforms.kubernetes.kubeflow.config import KubeflowConfig

_KINDS = {
    "tf-operator": ResourceKind("kubeflow.org", "v1", "tfjobs", "TFJob"),
    "pytorch-operator": ResourceKind("kubeflow.org", "v1", "pytorchjobs", "PyTorchJob"),
}
# NNI's role names -> the operators' replica types (a TFJob's master is its Chief)
_REPLICA_TYPES = {
    "tf-operator": {"master": "Chief", "worker": "Worker", "ps": "PS"},
    "pytorch-operator": {"master": "Master", "worker": "Worker"},
}
_CONTAINERS = {"tf-operator": "tensorflow", "pytorch-operator": "pytorch"}  # the names the operators look for
_SPEC_KEYS = {"tf-operator": "tfReplicaSpecs", "pytorch-operator": "pytorchReplicaSpecs"}


class KubeflowPlatform(KubernetesPlatform[KubeflowConfig]):
    name: ClassVar[str] = "kubeflow"
    config_model: ClassVar[type[KubernetesConfig]] = KubeflowConfig

    @classmethod
    def resource_kind(cls, config: KubeflowConfig) -> ResourceKind:
        return _KINDS[config.operator]

    def manifest(self, trial: TrialAssignment[KubeflowConfig], config: KubeflowConfig, name: str) -> dict[str, Any]:
        kind = self.resource_kind(config)
        replicas = {
            _REPLICA_TYPES[config.operator][role_name]: {
                "replicas": role.replicas,
                "restartPolicy": "Never",  # one attempt is one run: retries are maxTrialRetries'
                "template": self.pod_template(
                    trial,
                    config,
                    name,
                    container=_CONTAINERS[config.operator],
                    image=role.docker_image,
                    command=role.command,
                    cpu=role.cpu_number,
                    memory_mib=role.memory_size,
                    gpus=role.gpu_number,
                ),
            }
            for role_name, role in config.roles().items()
        }
        return {
            "apiVersion": f"{kind.group}/{kind.version}",
            "kind": kind.kind,
            "metadata": {"name": name, "labels": trial_labels(trial)},
            "spec": {
                "runPolicy": {"cleanPodPolicy": "None"},  # ended pods keep their logs until clean-up
                _SPEC_KEYS[config.operator]: replicas,
            },
        }

    @classmethod
    def state_of(cls, resource: dict[str, Any]) -> JobState:
        """NNI's reading of the job's conditions, whatever their order: a true Succeeded or Failed ends it;
        Suspended (by a queueing system) is the cluster stopping it; Running or Restarting runs."""
        conditions = {
            condition["type"]: condition
            for condition in resource.get("status", {}).get("conditions") or []
            if condition.get("status") == "True"
        }
        for kind, status in (
            ("Succeeded", TrialJobStatus.SUCCEEDED),
            ("Failed", TrialJobStatus.FAILED),
            ("Suspended", TrialJobStatus.SYS_CANCELED),
        ):
            if kind in conditions:
                return JobState("ended", status, conditions[kind].get("message"))
        if "Running" in conditions or "Restarting" in conditions:
            return JobState("running")
        return JobState("waiting")

    @classmethod
    def primary_pod(cls, name: str, config: KubeflowConfig) -> str:
        if config.master is not None:
            return f"{name}-{_REPLICA_TYPES[config.operator]['master'].lower()}-0"
        return f"{name}-worker-0"
