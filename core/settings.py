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

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, SecretStr, ValidationError

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
            raise SettingError(f"{name}: {first['msg']}") from None

    @classmethod
    def _unread(cls, environ: Mapping[str, str]) -> dict[str, object]:
        """Values for fields that are not settings of their own (`Settings.platform_variables`)."""
        return {}


class Settings(EnvironmentSettings):
    redis_url: str | None = Field(default=None, repr=False)  # may hold a password
    trial_lease_s: float = Field(default=10.0, gt=0, description="a silent worker loses its attempts after this")
    redis_retry_s: float = Field(default=60.0, ge=0, description="how long a command retries while Redis is away")
    kill_grace_s: float = Field(default=5.0, ge=0, description="SIGTERM to SIGKILL, when a trial is stopped")
    experiments_dir: Path = Path("~/trialstream-experiments")
    manager_token: SecretStr | None = Field(
        default=None, description="the bearer token `trialstream manager` requires, and the CLI sends to it"
    )
    manager_url: str | None = Field(default=None, description="talk to this `trialstream manager` instead of Redis")
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

    def of(self, model: type[PlatformSettings]) -> PlatformSettings:
        """A platform's own settings, from the variables these settings were read from."""
        return model.from_environment(self.platform_variables)

    def as_environment(self) -> dict[str, str]:
        """The variables that give a child process these settings (the processes of the embedded stack), the
        platforms' with them."""
        values = self.model_dump(exclude_defaults=True, exclude={"manager_token", "manager_url"})  # not a service's
        if "platforms" in values:
            values["platforms"] = ",".join(f"{name}={target}" for name, target in self.platforms.items())
        own = {PREFIX + name.upper(): str(value) for name, value in values.items() if value is not None}
        return {**self.platform_variables, **own}


PlatformSettings = TypeVar("PlatformSettings", bound=EnvironmentSettings)


def trial_environment(environ: Mapping[str, str]) -> dict[str, str]:
    """The user's environment as a trial gets it: without any of trialstream's settings or secrets."""
    return {name: value for name, value in environ.items() if not name.startswith(PREFIX)}
