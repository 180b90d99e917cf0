"""The local platform passes the platform conformance suite."""

from __future__ import annotations

import pytest

from tests.support.conformance import PlatformConformance, PlatformHarness

pytestmark = pytest.mark.xdist_group("conformance-local")  # its class's parts and worker start once


class TestLocalConformance(PlatformConformance):
    @pytest.fixture(scope="class")
    def harness(self) -> PlatformHarness:
        return PlatformHarness(platform_config={"platform": "local"})
