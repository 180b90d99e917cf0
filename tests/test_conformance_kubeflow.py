"""The conformance suite on the kubeflow platform, against the simulated cluster (simulators/kubesim): each
trial is a TFJob whose pod runs as a local process; its trials outlive their worker (a lost worker's
attempt is re-attached to its TFJob)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conformance import PlatformConformance, PlatformHarness
from tests.kube_setup import KubeWorkers, kubeflow_section


class TestKubeflowConformance(PlatformConformance):
    @pytest.fixture
    def harness(self, processes, kubeconfig: Path) -> PlatformHarness:
        return PlatformHarness(
            platform_config=kubeflow_section(kubeconfig), start_worker=KubeWorkers(processes, "kubeflow").start
        )
