"""The conformance suite on the dlts platform, against the simulated DLTS cluster (simulators/dltssim): each
trial is a DLTS job, submitted through the dashboard's API, whose command runs as a local process; its
trials outlive their worker (a lost worker's attempt is re-attached to its job, found by name)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.support.conformance import PlatformConformance, PlatformHarness
from tests.support.dlts_setup import dlts_section, running_dlts

pytestmark = pytest.mark.xdist_group("conformance-dlts")  # its class's parts and worker start once


class TestDltsConformance(PlatformConformance):
    @pytest.fixture(scope="class")
    def harness(self, tmp_path_factory: pytest.TempPathFactory) -> Iterator[PlatformHarness]:
        with running_dlts(tmp_path_factory.mktemp("dlts")) as cluster:
            yield PlatformHarness(platform_config=dlts_section(cluster))
