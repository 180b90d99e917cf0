"""Which platforms exist: a name -> the adapter class, imported only when asked for by name.

Built-in platforms are named in the table beside them (`workers/platforms/__init__.py`, read here by
module name, so core never imports the workers); others plug in through the `trialstream.platforms`
entry-point group of an installed package, or the `platforms` setting (`TRIALSTREAM_PLATFORMS=name=module:Class`)
for a module on the path: adding a platform never touches the manager.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Mapping
from importlib.metadata import entry_points
from typing import Any, cast

from core.platform import Platform

ENTRY_POINT_GROUP = "trialstream.platforms"
BUILTIN_TABLE = "workers.platforms"  # its PLATFORMS: name -> "module:Class"


class UnknownPlatform(LookupError):
    def __init__(self, name: str) -> None:
        super().__init__(f"unknown platform {name!r}; available platforms: {', '.join(available_platforms())}")


@functools.cache
def _targets() -> dict[str, str]:
    """Scanning the installed packages' entry points takes ~20 ms: once per process, not once per trial."""
    targets = dict(importlib.import_module(BUILTIN_TABLE).PLATFORMS)
    targets.update({point.name: point.value for point in entry_points(group=ENTRY_POINT_GROUP)})
    return targets


def add_platforms(targets: Mapping[str, str]) -> None:
    """Make the platforms of the `platforms` setting known to this process (where it starts)."""
    _targets().update(targets)


def available_platforms() -> list[str]:
    return sorted(_targets())


def platform_class(name: str) -> type[Platform[Any]]:
    target = _targets().get(name)
    if target is None:
        raise UnknownPlatform(name)
    module, _, attribute = target.partition(":")
    return cast(type[Platform[Any]], getattr(importlib.import_module(module), attribute))
