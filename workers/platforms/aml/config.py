"""NNI v2's `aml` trainingService section (Azure Machine Learning), plus how trialstream signs in."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from schemas.config import Duration, PlatformConfig


class AmlConfig(PlatformConfig):
    """Each trial is one command job on `computeTarget` in the workspace, running `dockerImage`."""

    platform: Literal["aml"] = "aml"
    subscription_id: str = Field(min_length=1)
    resource_group: str = Field(min_length=1)
    workspace_name: str = Field(min_length=1)
    compute_target: str = Field(min_length=1)
    docker_image: str = Field(default="msranni/nni:latest", min_length=1)
    max_trial_number_per_gpu: int = Field(default=1, ge=1)  # accepted as NNI has it; the compute target places jobs
    # trialstream: which azure-identity credential signs in. `default` is DefaultAzureCredential (environment,
    # workload identity, managed identity, Azure CLI, ... in its order); the others pick one of its links.
    credential: Literal["default", "environment", "managedIdentity", "azureCli"] = "default"
    # trialstream: the Azure cloud (AzureCloud, AzureChinaCloud, AzureUSGovernment); else the SDK's own choice
    # ($AZUREML_CURRENT_CLOUD, or the cloud whose metadata $ARM_CLOUD_METADATA_URL serves, else AzureCloud)
    cloud: str | None = Field(default=None, min_length=1)
    experiment_name: str | None = Field(default=None, min_length=1, max_length=255)  # trialstream: the jobs' experiment
    poll_interval: Duration = 2.0  # trialstream: how often a trial's job and its std_log are read
