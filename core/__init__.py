"""The core every layer builds on: the event log, keys, connections, queueing, leases and the platform port."""
