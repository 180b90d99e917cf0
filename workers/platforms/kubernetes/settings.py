"""The Kubernetes platforms' own settings (`TRIALSTREAM_KUBERNETES_SERVICE_ACCOUNT_DIR`)."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field

from core.settings import EnvironmentSettings


class KubernetesSettings(EnvironmentSettings):
    kubernetes_service_account_dir: Path = Field(
        default=Path("/var/run/secrets/kubernetes.io/serviceaccount"),
        description="the in-cluster account the Kubernetes platforms use when no kubeconfig is found",
    )
