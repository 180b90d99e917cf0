"""NNI v2's `kubeflow` and `frameworkcontroller` trainingService sections, plus what trialstream adds
for reaching the cluster (`kubeconfig`, `context`) and for pods the cluster cannot schedule."""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Field, model_validator

from schemas.config import Duration, ExperimentConfig, NniConfigModel, PlatformConfig

_MEMORY = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(b|kb|mb|gb|tb|ki|mi|gi|ti|k|m|g|t)?\s*$", re.IGNORECASE)
_MIB_PER_UNIT = {
    "b": 1 / 2**20, "k": 1 / 1024, "kb": 1 / 1024, "ki": 1 / 1024, "m": 1, "mb": 1, "mi": 1,
    "g": 1024, "gb": 1024, "gi": 1024, "t": 2**20, "tb": 2**20, "ti": 2**20,
}  # fmt: skip


def parse_memory_mib(value: Any) -> Any:
    """NNI's memorySize: a number of MiB, or '8gb', '512mb', '2Gi' (NNI's units are binary)."""
    if isinstance(value, bool):
        raise ValueError(f"{value!r} is not a memory size: use a number of MiB or a size such as '8gb'")
    if isinstance(value, str):
        match = _MEMORY.match(value)
        if not match:
            raise ValueError(f"{value!r} is not a memory size: use a number of MiB or a size such as '8gb'")
        return max(1, round(float(match.group(1)) * _MIB_PER_UNIT[(match.group(2) or "m").lower()]))
    return value


MemoryMib = Annotated[int, BeforeValidator(parse_memory_mib), Field(ge=1)]


class NfsStorage(NniConfigModel):
    """NNI's `storage` of type nfs: here the pods mount it themselves (kubelet), for their output;
    the manager's host mounts nothing."""

    storage_type: Literal["nfs"] = "nfs"
    server: str = Field(min_length=1)
    path: str = Field(min_length=1)


def _storage(value: Any) -> Any:
    if isinstance(value, dict) and str(value.get("storageType", value.get("storage_type", ""))).lower() in {
        "azurestorage",
        "azure_storage",
    }:
        raise ValueError(
            "azureStorage is not supported: trialstream ships the code in ConfigMaps and reads metrics from the "
            "pods' logs, so no storage is needed; omit 'storage', or give an nfs storage for the trials' output"
        )
    return value


class KubernetesConfig(PlatformConfig):
    """What both Kubernetes platforms share: where the cluster is, and what to do about pods it cannot place."""

    namespace: str = Field(default="default", pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$", max_length=63)
    kubeconfig: str | None = None  # trialstream: else $KUBECONFIG, ~/.kube/config, or the in-cluster account
    context: str | None = None  # trialstream: a context of that kubeconfig other than its current one
    storage: Annotated[NfsStorage | None, BeforeValidator(_storage)] = None
    service_account_name: str | None = None
    reuse_mode: bool | None = None  # accepted as NNI has it; every trial is its own resource here
    report_unschedulable_after: Duration = 10.0  # trialstream: a pod the cluster cannot place is told in the trial
    fail_unschedulable_after: Duration | None = None  # trialstream: ... and the trial FAILED after this long


class KubeflowRole(NniConfigModel):
    """One replica type of a TFJob / PyTorchJob (`worker`, `ps`, `master`)."""

    replicas: int = Field(default=1, ge=1)
    command: str | None = Field(default=None, min_length=1)  # trialstream: defaults to the experiment's trialCommand
    gpu_number: int = Field(default=0, ge=0)
    cpu_number: float = Field(default=1, gt=0)
    memory_size: MemoryMib = 1024
    docker_image: str = Field(default="msranni/nni:latest", min_length=1)
    code_directory: str | None = None  # accepted as NNI has it; the code is the experiment's trialCodeDirectory


class KubeflowConfig(KubernetesConfig):
    platform: Literal["kubeflow"] = "kubeflow"
    operator: Literal["tf-operator", "pytorch-operator"]
    api_version: Literal["v1"] = "v1"
    worker: KubeflowRole | None = None
    ps: KubeflowRole | None = None
    master: KubeflowRole | None = None

    @model_validator(mode="after")
    def _roles(self) -> KubeflowConfig:
        if self.worker is None and self.master is None:
            raise ValueError("give a 'worker' role (and 'ps' or 'master' if the job has them)")
        if self.operator == "pytorch-operator" and self.ps is not None:
            raise ValueError("ps: a PyTorchJob has only 'master' and 'worker' roles; remove 'ps'")
        if self.operator == "pytorch-operator" and self.master is None:
            raise ValueError("master: a PyTorchJob needs a 'master' role (replicas: 1)")
        if self.operator == "pytorch-operator" and self.master is not None and self.master.replicas != 1:
            raise ValueError("master.replicas: a PyTorchJob has exactly one master; set it to 1")
        return self

    def roles(self) -> dict[str, KubeflowRole]:
        """NNI's role names -> their sections, the one whose pod is followed first."""
        named = {"master": self.master, "worker": self.worker, "ps": self.ps}
        return {name: role for name, role in named.items() if role is not None}

    def problems_with(self, experiment: ExperimentConfig) -> dict[str, str]:
        return _gpu_number_problem(experiment, "set gpuNumber of each role instead")


class CompletionPolicy(NniConfigModel):
    min_failed_task_count: int = Field(default=1, ge=-1)
    min_succeed_task_count: int = Field(default=-1, ge=-1)  # FrameworkController: minSucceededTaskCount


class TaskRole(NniConfigModel):
    name: str = Field(min_length=1, max_length=20, pattern=r"^[a-z0-9]+$")
    docker_image: str = Field(default="msranni/nni:latest", min_length=1)
    task_number: int = Field(default=1, ge=1)
    command: str | None = Field(default=None, min_length=1)  # trialstream: defaults to the experiment's trialCommand
    gpu_number: int = Field(default=0, ge=0)
    cpu_number: float = Field(default=1, gt=0)
    memory_size: MemoryMib = 1024
    framework_attempt_completion_policy: CompletionPolicy = Field(
        default_factory=lambda: CompletionPolicy.model_validate({})
    )


class FrameworkControllerConfig(KubernetesConfig):
    platform: Literal["frameworkcontroller"] = "frameworkcontroller"
    task_roles: list[TaskRole] = Field(min_length=1)

    @model_validator(mode="after")
    def _distinct_roles(self) -> FrameworkControllerConfig:
        names = [role.name for role in self.task_roles]
        twice = sorted({name for name in names if names.count(name) > 1})
        if twice:
            raise ValueError(f"taskRoles: the name {twice[0]!r} is used twice; give each task role its own name")
        return self

    def problems_with(self, experiment: ExperimentConfig) -> dict[str, str]:
        return _gpu_number_problem(experiment, "set gpuNumber of each task role instead")


def _gpu_number_problem(experiment: ExperimentConfig, fix: str) -> dict[str, str]:
    if experiment.trial_gpu_number:
        return {"trialGpuNumber": f"not used by this platform: {fix}"}
    return {}
