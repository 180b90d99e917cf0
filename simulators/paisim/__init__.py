"""A simulated OpenPAI cluster for the openpai platform's tests: its REST server v2 over real HTTP
(loopback), speaking OpenPAI's wire format to the real client (httpx in workers/openpai.py), and a
"job runner" that runs each job's task commands as local processes."""

from simulators.paisim.cluster import SimulatedOpenpai, Storage

__all__ = ["SimulatedOpenpai", "Storage"]
