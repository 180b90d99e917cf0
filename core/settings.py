"""trialstream's own settings, in one object.

They are read once, where a process starts (`Settings.from_environment`, from `TRIALSTREAM_*`
variables and the CLI's flags), and passed down explicitly: no module reads the environment for a
setting of its own, and none of them reaches a trial (`trial_environment` strips them).

A platform's own settings are its own model (its folder's settings.py), read from the variables
these were read from (`Settings.of`): core names none of them.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Self, TypeVar

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, SecretStr, ValidationError

from core.connections import RedisOptions
from core.redis_urls import check_redis_url
from core.variables import PREFIX


def _platform_targets(value: object) -> object:
    """`TRIALSTREAM_PLATFORMS` reads `name=module:Class,other=module:Class`."""
    if not isinstance(value, str):
        return value
    targets = {}
    for item in filter(None, (part.strip() for part in value.split(","))):
        name, equals, target = item.partition("=")
        if not equals or ":" not in target:
            raise ValueError(f"{item!r}: write each platform as name=module:Class")
        targets[name.strip()] = target.strip()
    return targets


class SettingError(ValueError):
    """A setting that is not valid; the message names its variable (TRIALSTREAM_...)."""


class EnvironmentSettings(BaseModel):
    """Settings read from `TRIALSTREAM_<FIELD>` variables: trialstream's own (`Settings`) and each platform's."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    @classmethod
    def from_environment(cls, environ: Mapping[str, str] | None = None, **overrides: object) -> Self:
        """`TRIALSTREAM_<NAME>` for each field (TRIALSTREAM_TRIAL_LEASE_S, ...), then `overrides` (CLI flags)."""
        environ = os.environ if environ is None else environ
        values: dict[str, object] = {}
        for name in cls.model_fields:
            raw = environ.get(PREFIX + name.upper())
            if raw:
                values[name] = raw
        values.update({name: value for name, value in overrides.items() if value is not None})
        values.update(cls._unread(environ))
        try:
            return cls.model_validate(values)
        except ValidationError as invalid:
            first = invalid.errors()[0]
            name = PREFIX + "_".join(str(part) for part in first["loc"][:1]).upper()
            message = str(first["msg"]).removeprefix("Value error, ")
            raise SettingError(message if message.startswith(name) else f"{name}: {message}") from None

    @classmethod
    def _unread(cls, environ: Mapping[str, str]) -> dict[str, object]:
        """Values for fields that are not settings of their own (`Settings.platform_variables`)."""
        return {}


def _redis_url(value: object) -> object:
    """A URL trialstream can use (plain, TLS or Sentinel), checked where it is read."""
    return check_redis_url(value) if isinstance(value, str) else value


class Settings(EnvironmentSettings):
    # may hold a password
    redis_url: Annotated[str | None, AfterValidator(_redis_url)] = Field(default=None, repr=False)
    redis_tls_ca_file: Path | None = Field(default=None, description="rediss: verify Redis and sentinels with this CA")
    redis_tls_cert_file: Path | None = Field(default=None, description="rediss: a client certificate to present")
    redis_tls_key_file: Path | None = Field(default=None, description="rediss: the client certificate's key")
    redis_replicas: int | None = Field(
        default=None, ge=0, description="replicas an append waits for (WAIT); default 1 with Sentinel or replicas"
    )
    redis_replica_timeout_s: float = Field(default=1.0, gt=0, description="how long an append waits for its replicas")
    trial_lease_s: float = Field(default=10.0, gt=0, description="a silent worker loses its attempts after this")
    runner_lease_s: float = Field(
        default=5.0, gt=0, description="an experiment's runner that stalls past this lets a `resume` take it over"
    )
    redis_retry_s: float = Field(default=60.0, ge=0, description="how long a command retries while Redis is away")
    kill_grace_s: float = Field(default=5.0, ge=0, description="SIGTERM to SIGKILL, when a trial is stopped")
    served_wait_s: float = Field(
        default=10.0, gt=0, description="`run` on a shared Redis: how long to wait for a worker and a projector"
    )
    experiments_dir: Path = Path("~/trialstream-experiments")
    manager_token: SecretStr | None = Field(
        default=None, description="the bearer token `trialstream manager` requires, and the CLI sends to it"
    )
    manager_url: str | None = Field(default=None, description="talk to this `trialstream manager` instead of Redis")
    manager_wait_s: float = Field(
        default=60.0,
        ge=0,
        description="`run`, `resume`, `events --follow` and `trials logs --follow` with --manager: how long to keep"
        " asking a manager that does not answer",
    )
    archive_location: str | None = Field(
        default=None, description="where ended experiments are archived: a directory or s3://bucket/prefix"
    )  # default: <experiments_dir>/.archive
    archive_endpoint_url: str | None = Field(default=None, description="an S3-compatible server, for s3:// archives")
    archive_after_h: float | None = Field(
        default=None, ge=0, description="archive an experiment this many hours after it ended; default: by hand only"
    )
    archive_check_s: float = Field(default=60.0, gt=0, description="how often archive_after_h is applied")
    archive_thaw_s: float = Field(default=3600.0, gt=0, description="how long a read of an archived one stays in Redis")
    platforms: Annotated[dict[str, str], BeforeValidator(_platform_targets)] = Field(
        default_factory=dict, description="extra platform adapters: name=module:Class, comma-separated"
    )
    platform_variables: dict[str, str] = Field(
        default_factory=dict, exclude=True, repr=False, description="the other TRIALSTREAM_* variables, for `of`"
    )

    @classmethod
    def _unread(cls, environ: Mapping[str, str]) -> dict[str, object]:
        own = {PREFIX + name.upper() for name in cls.model_fields}
        return {"platform_variables": {k: v for k, v in environ.items() if k.startswith(PREFIX) and k not in own}}

    def redis_options(self) -> RedisOptions:
        """What connections need beyond the URL: TLS files, replica acknowledgements."""
        if self.redis_tls_cert_file and not self.redis_tls_key_file:
            raise SettingError("TRIALSTREAM_REDIS_TLS_KEY_FILE: required with TRIALSTREAM_REDIS_TLS_CERT_FILE")
        return RedisOptions(
            tls_ca_file=str(self.redis_tls_ca_file) if self.redis_tls_ca_file else None,
            tls_cert_file=str(self.redis_tls_cert_file) if self.redis_tls_cert_file else None,
            tls_key_file=str(self.redis_tls_key_file) if self.redis_tls_key_file else None,
            replicas=self.redis_replicas,
            replica_timeout_s=self.redis_replica_timeout_s,
        )

    def of(self, model: type[PlatformSettings]) -> PlatformSettings:
        """A platform's own settings, from the variables these settings were read from."""
        return model.from_environment(self.platform_variables)

    def as_environment(self) -> dict[str, str]:
        """The variables that give a child process these settings (the processes of the embedded stack), the
        platforms' with them."""
        the_cli_s = {"manager_token", "manager_url", "manager_wait_s"}  # not a service's
        values = self.model_dump(exclude_defaults=True, exclude=the_cli_s)
        if "platforms" in values:
            values["platforms"] = ",".join(f"{name}={target}" for name, target in self.platforms.items())
        own = {PREFIX + name.upper(): str(value) for name, value in values.items() if value is not None}
        return {**self.platform_variables, **own}


PlatformSettings = TypeVar("PlatformSettings", bound=EnvironmentSettings)


def trial_environment(environ: Mapping[str, str]) -> dict[str, str]:
    """The user's environment as a trial gets it: without any of trialstream's settings or secrets."""
    return {name: value for name, value in environ.items() if not name.startswith(PREFIX)}
