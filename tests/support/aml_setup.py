"""What the aml platform's tests share: a simulated Azure ML workspace (simulators/amlsim: the real azure-ai-ml
SDK speaks to its control plane over HTTPS, Azurite is its blob store, its compute runs each job as a local
process), the environment that points the SDK and DefaultAzureCredential at it, and workers for it."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

import pytest

from tests.support.workers import PlatformWorkers

if TYPE_CHECKING:
    from simulators.amlsim import SimulatedWorkspace
    from simulators.amlsim.azurite import Azurite
    from tests.conftest import Processes


@pytest.fixture(scope="session")
def aml_storage(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Azurite]:
    """Azurite (a Node.js process, a second to start): once per test run, each workspace in its own container."""
    pytest.importorskip("azure.ai.ml", reason="the aml platform needs azure-ai-ml: pip install .[aml]")
    if shutil.which("azurite-blob") is None:
        pytest.skip("Azurite is not installed: npm install -g azurite")
    from simulators.amlsim import storage_service

    storage = storage_service(tmp_path_factory.mktemp("aml-storage"))
    storage.start()
    try:
        yield storage
    finally:
        storage.stop()


@contextmanager
def running_workspace(storage: Azurite) -> Iterator[SimulatedWorkspace]:
    """A workspace of its own, its environment set in this process too (the platform's check() runs here)."""
    from simulators.amlsim import SimulatedWorkspace

    workspace = SimulatedWorkspace(storage)
    workspace.start()
    try:
        with pytest.MonkeyPatch.context() as environment:
            for name, value in workspace.environment().items():
                environment.setenv(name, value)
            yield workspace
    finally:
        workspace.stop()


@pytest.fixture
def aml_workspace(aml_storage: Azurite) -> Iterator[SimulatedWorkspace]:
    with running_workspace(aml_storage) as workspace:
        yield workspace


class AmlWorkers(PlatformWorkers):
    """`trialstream worker --platform aml` processes that reach the simulated workspace."""

    def __init__(self, processes: Processes, workspace: SimulatedWorkspace) -> None:
        super().__init__(processes, "aml")
        self.workspace = workspace

    @property
    def env(self) -> dict[str, str]:
        return self.workspace.environment()
