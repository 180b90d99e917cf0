"""NNI v2's `local` trainingService section: trials on the worker's own machine, and its GPUs."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from schemas.config import ExperimentConfig, IndexList, PlatformConfig


class LocalConfig(PlatformConfig):
    platform: Literal["local"] = "local"
    use_active_gpu: bool | None = None
    max_trial_number_per_gpu: int = Field(default=1, ge=1)
    gpu_indices: IndexList | None = None

    def problems_with(self, experiment: ExperimentConfig) -> dict[str, str]:
        if (experiment.trial_gpu_number or 0) > 0 and self.use_active_gpu is None:
            return {
                "useActiveGpu": "required when trialGpuNumber > 0; set true to share GPUs with other processes, "
                "false to use only idle GPUs"
            }
        return {}
