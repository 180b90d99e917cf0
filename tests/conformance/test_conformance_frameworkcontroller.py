"""The conformance suite on the frameworkcontroller platform, against the simulated cluster
(simulators/kubesim): each trial is a Framework whose task's pod runs as a local process."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.conformance import PlatformConformance, PlatformHarness
from tests.support.kube_setup import frameworkcontroller_section
from tests.support.workers import PlatformWorkers


class TestFrameworkControllerConformance(PlatformConformance):
    @pytest.fixture
    def harness(self, processes, kubeconfig: Path) -> PlatformHarness:
        return PlatformHarness(
            platform_config=frameworkcontroller_section(kubeconfig),
            start_worker=PlatformWorkers(processes, "frameworkcontroller").start,
        )
