"""The conformance suite on the kubeflow platform, against the simulated cluster (simulators/kubesim): each
trial is a TFJob whose pod runs as a local process; its trials outlive their worker (a lost worker's
attempt is re-attached to its TFJob)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.support.conformance import PlatformConformance, PlatformHarness
from tests.support.kube_setup import kubeflow_section, running_cluster

pytestmark = pytest.mark.xdist_group("conformance-kubeflow")  # its class's parts and worker start once


class TestKubeflowConformance(PlatformConformance):
    @pytest.fixture(scope="class")
    def harness(self, tmp_path_factory: pytest.TempPathFactory) -> Iterator[PlatformHarness]:
        root = tmp_path_factory.mktemp("kubeflow")
        with running_cluster(root) as cluster:
            yield PlatformHarness(platform_config=kubeflow_section(cluster.write_kubeconfig(root / "kubeconfig")))
