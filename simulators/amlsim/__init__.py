"""A simulated Azure ML workspace for the aml platform's tests: a control plane speaking the REST API that
azure-ai-ml calls (over HTTPS with a self-signed CA), Azurite as the workspace's blob store, and a compute
that runs each command job as a local process, writing its std_log to Azurite."""

from simulators.amlsim.workspace import SimulatedWorkspace, storage_service

__all__ = ["SimulatedWorkspace", "storage_service"]
