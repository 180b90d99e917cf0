"""The conformance suite on the openpai platform, against the simulated OpenPAI cluster (simulators/paisim):
each trial is a job submitted over real HTTP whose task runs as a local process, its output read from the
storage's local mount; its trials outlive their worker (a lost worker's attempt is re-attached to its job)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.support.conformance import PlatformConformance, PlatformHarness
from tests.support.pai_setup import pai_section, running_openpai

pytestmark = pytest.mark.xdist_group("conformance-openpai")  # its class's parts and worker start once


class TestOpenpaiConformance(PlatformConformance):
    @pytest.fixture(scope="class")
    def harness(self, tmp_path_factory: pytest.TempPathFactory) -> Iterator[PlatformHarness]:
        with running_openpai(tmp_path_factory.mktemp("openpai")) as cluster:
            yield PlatformHarness(platform_config=pai_section(cluster))
