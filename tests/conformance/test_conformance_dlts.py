"""The conformance suite on the dlts platform, against the simulated DLTS cluster (simulators/dltssim): each
trial is a DLTS job, submitted through the dashboard's API, whose command runs as a local process; its
trials outlive their worker (a lost worker's attempt is re-attached to its job, found by name)."""

from __future__ import annotations

import pytest

from simulators.dltssim import DltsSimulator
from tests.support.conformance import PlatformConformance, PlatformHarness
from tests.support.dlts_setup import dlts_cluster_fixture, dlts_section  # noqa: F401  (fixture)
from tests.support.workers import PlatformWorkers


class TestDltsConformance(PlatformConformance):
    @pytest.fixture
    def harness(self, processes, dlts_cluster: DltsSimulator) -> PlatformHarness:
        return PlatformHarness(
            platform_config=dlts_section(dlts_cluster), start_worker=PlatformWorkers(processes, "dlts").start
        )
