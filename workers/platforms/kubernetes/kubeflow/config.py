"""NNI v2's `kubeflow` trainingService section: a TFJob or PyTorchJob per trial, with its roles."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from schemas.config import ExperimentConfig, MemoryMib, NniConfigModel
from workers.platforms.kubernetes.config import KubernetesConfig, gpu_number_problem


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
        return gpu_number_problem(experiment, "set gpuNumber of each role instead")
