"""The local platform passes the platform conformance suite."""

from __future__ import annotations

import pytest

from tests.conftest import Processes
from tests.support.conformance import PlatformConformance, PlatformHarness


class TestLocalConformance(PlatformConformance):
    @pytest.fixture
    def harness(self, processes: Processes) -> PlatformHarness:
        return PlatformHarness(platform_config={"platform": "local"}, start_worker=processes.worker)
