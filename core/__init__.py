"""The core every layer builds on: the event log, keys, connections, dispatch, leases and the platform port."""
