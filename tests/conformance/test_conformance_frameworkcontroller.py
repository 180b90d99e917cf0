"""The conformance suite on the frameworkcontroller platform, against the simulated cluster
(simulators/kubesim): each trial is a Framework whose task's pod runs as a local process."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.support.conformance import PlatformConformance, PlatformHarness
from tests.support.kube_setup import frameworkcontroller_section, running_cluster

pytestmark = pytest.mark.xdist_group("conformance-frameworkcontroller")  # its class's parts and worker start once


class TestFrameworkControllerConformance(PlatformConformance):
    @pytest.fixture(scope="class")
    def harness(self, tmp_path_factory: pytest.TempPathFactory) -> Iterator[PlatformHarness]:
        root = tmp_path_factory.mktemp("frameworkcontroller")
        with running_cluster(root) as cluster:
            kubeconfig = cluster.write_kubeconfig(root / "kubeconfig")
            yield PlatformHarness(platform_config=frameworkcontroller_section(kubeconfig))
