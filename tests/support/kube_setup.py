"""What the Kubernetes platforms' tests share: a simulated cluster (simulators/kubesim: the real client
speaks to it over HTTPS; its operators run each pod's command as a local process), a kubeconfig for
it, the trainingService sections, and workers serving the platforms' queues."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from simulators.kubesim import SimulatedCluster


@contextmanager
def running_cluster(root: Path) -> Iterator[SimulatedCluster]:
    cluster = SimulatedCluster(root / "cluster", namespaces=("default", "team-b"))
    cluster.start()
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture
def kube_cluster(tmp_path: Path) -> Iterator[SimulatedCluster]:
    with running_cluster(tmp_path) as cluster:
        yield cluster


@pytest.fixture
def kubeconfig(kube_cluster: SimulatedCluster, tmp_path: Path) -> Path:
    return kube_cluster.write_kubeconfig(tmp_path / "kubeconfig")


def kubeflow_section(kubeconfig: Path, **extra: Any) -> dict[str, Any]:
    """A TFJob of one worker running the experiment's trialCommand."""
    return {"platform": "kubeflow", "operator": "tf-operator", "kubeconfig": str(kubeconfig), "worker": {}, **extra}


def frameworkcontroller_section(kubeconfig: Path, **extra: Any) -> dict[str, Any]:
    """A Framework of one task role of one task running the experiment's trialCommand."""
    return {
        "platform": "frameworkcontroller",
        "kubeconfig": str(kubeconfig),
        "taskRoles": [{"name": "worker", "taskNumber": 1}],
        **extra,
    }
