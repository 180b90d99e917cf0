"""A protocol-level simulator of a DLTS (DLWorkspace) cluster's dashboard API, for the dlts platform's tests."""

from simulators.dltssim.server import DltsSimulator, SimJob, token_for

__all__ = ["DltsSimulator", "SimJob", "token_for"]
