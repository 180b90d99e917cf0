"""A protocol-level simulated Kubernetes cluster for tests: an HTTPS API server that the official `kubernetes`
Python client talks to unmodified, the Kubeflow training-operator (TFJob, PyTorchJob) and Microsoft
FrameworkController (Framework) reconciling in threads, and a kubelet that runs each pod's container command as a
local process. Module docstrings name the real sources each behaviour was taken from.
"""

from simulators.kubesim.cluster import Capacity, SimulatedCluster

__all__ = ["Capacity", "SimulatedCluster"]
