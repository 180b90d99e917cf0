"""The conformance suite on the aml platform, against the simulated Azure ML workspace (simulators/amlsim):
each trial is a command job run by the real azure-ai-ml SDK, its std_log in Azurite; its trials outlive
their worker (a lost worker's attempt is re-attached to its job)."""

# ruff: noqa: F811  (the test functions take the aml_workspace fixture imported by name below)
from __future__ import annotations

import pytest

from tests.support.aml_setup import AmlWorkers, aml_storage, aml_workspace  # noqa: F401  (the simulated workspace fixtures)
from tests.support.conformance import PlatformConformance, PlatformHarness


class TestAmlConformance(PlatformConformance):
    @pytest.fixture
    def harness(self, processes, aml_workspace) -> PlatformHarness:
        section = aml_workspace.section(pollInterval=0.5)
        return PlatformHarness(platform_config=section, start_worker=AmlWorkers(processes, aml_workspace).start)
