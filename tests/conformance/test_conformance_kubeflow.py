"""The conformance suite on the kubeflow platform, against the simulated cluster (simulators/kubesim): each
trial is a TFJob whose pod runs as a local process; its trials outlive their worker (a lost worker's
attempt is re-attached to its TFJob)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.conformance import PlatformConformance, PlatformHarness
from tests.support.kube_setup import kubeflow_section
from tests.support.workers import PlatformWorkers


class TestKubeflowConformance(PlatformConformance):
    @pytest.fixture
    def harness(self, processes, kubeconfig: Path) -> PlatformHarness:
        return PlatformHarness(
            platform_config=kubeflow_section(kubeconfig), start_worker=PlatformWorkers(processes, "kubeflow").start
        )
