"""The conformance suite on the openpai platform, against the simulated OpenPAI cluster (simulators/paisim):
each trial is a job submitted over real HTTP whose task runs as a local process, its output read from the
storage's local mount; its trials outlive their worker (a lost worker's attempt is re-attached to its job)."""

from __future__ import annotations

import pytest

from simulators.paisim import SimulatedOpenpai
from tests.support.conformance import PlatformConformance, PlatformHarness
from tests.support.pai_setup import pai_cluster, pai_section  # noqa: F401  (pai_cluster: a fixture)
from tests.support.workers import PlatformWorkers


class TestOpenpaiConformance(PlatformConformance):
    @pytest.fixture
    def harness(self, processes, pai_cluster: SimulatedOpenpai) -> PlatformHarness:  # noqa: F811
        return PlatformHarness(
            platform_config=pai_section(pai_cluster), start_worker=PlatformWorkers(processes, "openpai").start
        )
