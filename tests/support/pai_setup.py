"""What the openpai platform's tests share: a simulated OpenPAI cluster (simulators/paisim) with a user, two
virtual clusters and one storage config whose share is a directory of the test (the "local mount point";
jobs see it at /mnt/<storage>), the trainingService section for it, and workers serving the platform."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from simulators.paisim import SimulatedOpenpai, Storage

PAI_USER = "alice"
PAI_TOKEN = "pai-t0ken-4f9c2d7e"  # distinctive, so that tests can look for it anywhere
STORAGE = "confignfs"


@contextmanager
def running_openpai(root: Path) -> Iterator[SimulatedOpenpai]:
    share = root / "pai-share"
    share.mkdir()
    cluster = SimulatedOpenpai({PAI_USER: PAI_TOKEN}, [Storage(STORAGE, share)], virtual_clusters=("default", "gpu"))
    cluster.start()
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture
def pai_cluster(tmp_path: Path) -> Iterator[SimulatedOpenpai]:
    with running_openpai(tmp_path) as cluster:
        yield cluster


def pai_section(cluster: SimulatedOpenpai, **extra: Any) -> dict[str, Any]:
    """One job per trial in virtual cluster `default`, on the cluster's storage."""
    storage = cluster.storages[STORAGE]
    return {
        "platform": "openpai",
        "host": cluster.url,
        "username": PAI_USER,
        "token": PAI_TOKEN,
        "trialCpuNumber": 1,
        "trialMemorySize": "1gb",
        "trialGpuNumber": 0,
        "storageConfigName": STORAGE,
        "dockerImage": "msranni/nni:latest",
        "virtualCluster": "default",
        "localStorageMountPoint": str(storage.path),
        "containerStorageMountPoint": storage.mount_path,
        **extra,
    }
