"""What the dlts platform's tests share: a simulated DLTS cluster (simulators/dltssim: a real HTTP server on
loopback speaking the dashboard's API; each job runs as a local process), the trainingService section
for it, and workers serving the platform's queue."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from simulators.dltssim import DltsSimulator

EMAIL = "alice@example.com"
TEAM = "platform"
CLUSTER = "eastus-p40"


@contextmanager
def running_dlts(root: Path) -> Iterator[DltsSimulator]:
    cluster = DltsSimulator(root / "dlts")
    cluster.start()
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture(name="dlts_cluster")
def dlts_cluster_fixture(tmp_path: Path) -> Iterator[DltsSimulator]:
    with running_dlts(tmp_path) as cluster:
        yield cluster


def dlts_section(sim: DltsSimulator, **extra: Any) -> dict[str, Any]:
    """NNI's dltsConfig keys for the simulated cluster's user, polled often (the tests wait on it)."""
    return {
        "platform": "dlts",
        "dashboard": sim.url,
        "cluster": CLUSTER,
        "team": TEAM,
        "email": EMAIL,
        "password": sim.password(EMAIL),
        "image": "msranni/nni:latest",
        "pollInterval": 0.1,
        **extra,
    }
