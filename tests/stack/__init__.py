"""The docker-compose stack and its Dockerfile."""
