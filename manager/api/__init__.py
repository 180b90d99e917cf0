"""The manager's HTTP API: trialstream's own under /api/v1, NNI's under /api/v1/nni, NNI's web UI."""
