"""NNI v2's `frameworkcontroller` trainingService section: a Framework per trial, with its task roles."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from schemas.config import ExperimentConfig, MemoryMib, NniConfigModel
from workers.platforms.kubernetes.config import KubernetesConfig, gpu_number_problem


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
        return gpu_number_problem(experiment, "set gpuNumber of each task role instead")
