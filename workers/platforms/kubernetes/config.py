"""What NNI v2's `kubeflow` and `frameworkcontroller` trainingService sections share, plus what trialstream
adds for reaching the cluster (`kubeconfig`, `context`) and for pods the cluster cannot schedule."""

from __future__ import annotations

from typing import Annotated, Any, Literal, TypeVar

from pydantic import BeforeValidator, Field

from schemas.config import Duration, ExperimentConfig, NniConfigModel, PlatformConfig


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


def gpu_number_problem(experiment: ExperimentConfig, fix: str) -> dict[str, str]:
    if experiment.trial_gpu_number:
        return {"trialGpuNumber": f"not used by this platform: {fix}"}
    return {}


KubernetesConfigT = TypeVar("KubernetesConfigT", bound=KubernetesConfig)
"""The config model of one of the two platforms (KubernetesPlatform is generic over it)."""
