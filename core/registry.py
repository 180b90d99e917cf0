"""Which platforms exist, and the RQ queue each one is served on.

Built-in platforms are listed here; others plug in through the `trialstream.platforms` entry-point
group, so adding a platform never touches the manager.
"""

from __future__ import annotations

import functools
import importlib
from importlib.metadata import entry_points
from typing import cast

from core.platform import Platform

ENTRY_POINT_GROUP = "trialstream.platforms"
BUILTIN_PLATFORMS = {"local": "workers.local:LocalPlatform"}


class UnknownPlatform(LookupError):
    def __init__(self, name: str) -> None:
        super().__init__(f"unknown platform {name!r}; available platforms: {', '.join(available_platforms())}")


@functools.cache
def _targets() -> dict[str, str]:
    """Scanning the installed packages' entry points takes ~20 ms: once per process, not once per trial."""
    targets = dict(BUILTIN_PLATFORMS)
    targets.update({point.name: point.value for point in entry_points(group=ENTRY_POINT_GROUP)})
    return targets


def available_platforms() -> list[str]:
    return sorted(_targets())


def platform_class(name: str) -> type[Platform]:
    target = _targets().get(name)
    if target is None:
        raise UnknownPlatform(name)
    module, _, attribute = target.partition(":")
    return cast(type[Platform], getattr(importlib.import_module(module), attribute))
