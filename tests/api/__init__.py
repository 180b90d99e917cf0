"""The manager's HTTP APIs (its own and NNI's), NNI's web UI, client, nnictl and SDK against them."""
