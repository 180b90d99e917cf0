"""NNI's `dlts` trainingService section (DLTS, Microsoft's DLWorkspace; NNI removed it in 2.4): the keys of
NNI's `dltsConfig` (`dashboard`, and optionally `cluster`, `team`, `email`, `password`) plus the job's
`image`, written in v2 style as `trainingService: {platform: dlts, ...}`.

As in NNI, `team`, `email` and `password` may be left out where the process runs inside a DLTS job:
they are then read from the job's `DLWS_VC_NAME`, `DLWS_USER_EMAIL` and `DLTS_JOB_TOKEN` (`resolved`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from pydantic import Field, SecretStr, field_validator

from schemas.config import Duration, PlatformConfig

# NNI's fallbacks when running in a DLTS job: key -> the job's environment variable
FROM_ENVIRONMENT = {"team": "DLWS_VC_NAME", "email": "DLWS_USER_EMAIL", "password": "DLTS_JOB_TOKEN"}


@dataclass(frozen=True)
class DltsAccess:
    """Where and as whom the dashboard is called, every key resolved."""

    dashboard: str  # ends with "/": NNI appends `api/...` to it
    cluster: str
    team: str
    email: str
    password: SecretStr


class DltsConfig(PlatformConfig):
    platform: Literal["dlts"] = "dlts"
    dashboard: str = Field(min_length=1)
    cluster: str = Field(default=".default", min_length=1)  # DLWorkspace's name for its first cluster
    team: str | None = Field(default=None, min_length=1)
    email: str | None = Field(default=None, min_length=1)
    password: SecretStr | None = None  # the hex token shown on the dashboard; sent as NNI sent it, in the query
    image: str = Field(default="msranni/nni:latest", min_length=1)  # NNI's trial.image: the job's docker image
    poll_interval: Duration = 3.0  # trialstream: how often a job's status and log are read (NNI: every 3 s)

    @field_validator("dashboard")
    @classmethod
    def _dashboard_url(cls, value: str) -> str:
        if not value.startswith(("http://", "https://")):
            raise ValueError(f"{value!r} is not a URL: give the cluster's dashboard as http(s)://host/")
        return value if value.endswith("/") else value + "/"

    def resolved(self, environ: Mapping[str, str] | None = None) -> tuple[DltsAccess | None, list[str]]:
        """The access, with NNI's fallbacks from `environ` (the process's), or one line per missing key."""
        environ = os.environ if environ is None else environ
        values: dict[str, str] = {}
        problems: list[str] = []
        for key, variable in FROM_ENVIRONMENT.items():
            given = getattr(self, key)
            value = given.get_secret_value() if isinstance(given, SecretStr) else given
            value = value or environ.get(variable, "")
            if not value:
                problems.append(
                    f"{key}: not given, and ${variable} is not set (it is only inside a DLTS job): add '{key}' "
                    "to the trainingService section"
                )
            values[key] = value
        if problems:
            return None, problems
        access = DltsAccess(
            self.dashboard, self.cluster, values["team"], values["email"], SecretStr(values["password"])
        )
        return access, []
