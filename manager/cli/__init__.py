"""The `trialstream` command line. Errors are one clear line, never a traceback."""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from typing import TYPE_CHECKING, NoReturn

from core.lean_imports import import_redis
from core.variables import MANAGER_TOKEN_ENV, PREFIX, REDIS_URL_ENV, hide_environment
from manager.cli import interrupts, services

if TYPE_CHECKING:
    from core.settings import Settings

EXIT_ERROR = 1
EXIT_USAGE = 2
AREAS = {  # command -> the module (of this package) that registers and runs it
    "run": "run",
    "resume": "run",
    "trials": "trials",
    "events": "event_log",
    "replay": "event_log",
    "export": "event_log",
    "import": "event_log",
    "timeline": "timeline",
    "experiments": "experiments",
    "worker": "services",
    "projector": "services",
    "manager": "manager",
    "redis-acl": "redis_acl",
}
"""Only the area of the command given is imported: a command loads what it uses, no more (`trialstream worker`,
which hands over to the worker runtime, loads next to nothing)."""


def main(argv: list[str] | None = None) -> int:
    hide_environment()
    arguments = sys.argv[1:] if argv is None else argv
    command, redis_url, rest = _command(arguments)
    if command == "worker":  # before anything else loads: the worker runtime has an entry point of its own
        services.hand_over_to_worker(redis_url, rest)
    import_redis()  # before the command's area imports it
    assembled = parser(command)
    args = assembled.parse_args(arguments)
    interrupts.install()
    try:
        settings = _settings(args)
        return int(args.handler(args, settings) or 0)
    except KeyboardInterrupt as stop:
        status = stop.exit_status if isinstance(stop, interrupts.Interrupted) else 130
        _fail(str(stop) or "interrupted", status)
    except BrokenPipeError:  # `trialstream events ... | head`: the reader has all it wants
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except Exception as error:
        if not isinstance(error, _reported_errors()):
            raise
        from schemas.config import ConfigError

        _fail(str(error), EXIT_USAGE if isinstance(error, ConfigError) else EXIT_ERROR)


def parser(command: str | None = None) -> argparse.ArgumentParser:
    """The command line, with `command`'s area; with every area when it is None (`--help`, or no command)."""
    assembled = argparse.ArgumentParser(prog="trialstream", description=__doc__)
    _global_options(assembled)
    commands = assembled.add_subparsers(dest="command", required=True)
    areas = [AREAS[command]] if command in AREAS else sorted(set(AREAS.values()), key=list(AREAS.values()).index)
    for area in areas:
        importlib.import_module(f"{__name__}.{area}").register(commands)
    return assembled


def _global_options(assembled: argparse.ArgumentParser) -> None:
    assembled.add_argument("--redis", help=f"Redis URL (default: ${REDIS_URL_ENV}, else a private redis-server)")
    assembled.add_argument(
        "--manager",
        metavar="URL",
        help=f"work through this `trialstream manager` (default: ${PREFIX}MANAGER_URL) instead of Redis: "
        f"run, resume, trials, events and experiments; its token is read from ${MANAGER_TOKEN_ENV}",
    )


def _command(arguments: list[str]) -> tuple[str | None, str | None, list[str]]:
    """The command named in `arguments`, read past the global options (None if there is none), --redis, and
    the command's own arguments."""
    first = argparse.ArgumentParser(add_help=False)
    _global_options(first)
    first.add_argument("command", nargs="?")
    known, rest = first.parse_known_args(arguments)
    return (known.command if known.command in AREAS else None), known.redis, rest


def _reported_errors() -> tuple[type[Exception], ...]:
    """What the command line says in one line (the user's to fix) rather than as a traceback. Imported here,
    when something failed, rather than at start: most of these modules belong to one command alone."""
    import redis

    from core.acl import AclError
    from core.connections import RedisUnavailable
    from core.event_store import ExperimentArchived, InvalidExperimentId
    from core.registry import UnknownPlatform
    from core.settings import SettingError
    from manager.api_client import ManagerError
    from manager.archive.moves import ArchiveError
    from manager.archive.segments import CorruptArchive
    from manager.archive.stores import ArchiveStoreError
    from manager.experiments import ExperimentNotFound, ExperimentRunning
    from manager.replay import InvalidPosition, UnknownEventType
    from manager.runner import RunnerError
    from manager.stack import StackError
    from manager.training_service import TrialNotFound
    from manager.transfer import ExperimentExists, InvalidLogFile
    from schemas.config import ConfigError

    return (
        SettingError,
        ConfigError,
        RedisUnavailable,
        TrialNotFound,
        ExperimentNotFound,
        ExperimentRunning,
        UnknownPlatform,
        RunnerError,
        StackError,
        InvalidPosition,
        UnknownEventType,
        InvalidLogFile,
        InvalidExperimentId,
        ExperimentExists,
        redis.RedisError,
        ManagerError,
        AclError,
        ArchiveError,
        ArchiveStoreError,
        CorruptArchive,
        ExperimentArchived,
    )


def _settings(args: argparse.Namespace) -> Settings:
    """Read once, here, and handed down: no other module reads trialstream's variables. The platforms they plug
    in are known from here on, to the control plane too (`run` and `manager` check a config's platform by name)."""
    from core.registry import add_platforms
    from core.settings import Settings

    settings = Settings.from_environment(redis_url=args.redis, manager_url=args.manager)
    add_platforms(settings.platforms)
    return settings


def _fail(message: str, code: int) -> NoReturn:
    from manager.cli import render

    render.print_error(message)
    sys.exit(code)
