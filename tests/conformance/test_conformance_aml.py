"""The conformance suite on the aml platform, against the simulated Azure ML workspace (simulators/amlsim):
each trial is a command job run by the real azure-ai-ml SDK, its std_log in Azurite; its trials outlive
their worker (a lost worker's attempt is re-attached to its job)."""

# ruff: noqa: F811  (the test functions take the aml_workspace fixture imported by name below)
from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.support.aml_setup import aml_storage, running_workspace  # noqa: F401  (aml_storage: a fixture)
from tests.support.conformance import PlatformConformance, PlatformHarness

pytestmark = pytest.mark.xdist_group("conformance-aml")  # its class's parts and worker start once


class TestAmlConformance(PlatformConformance):
    @pytest.fixture(scope="class")
    def harness(self, aml_storage) -> Iterator[PlatformHarness]:
        with running_workspace(aml_storage) as workspace:
            yield PlatformHarness(
                platform_config=workspace.section(pollInterval=0.5), worker_env=workspace.environment()
            )
