"""The worker process: it serves one platform's RQ queue, runs each trial job through that platform, and turns
what the platform reports into events."""
