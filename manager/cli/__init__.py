"""The `trialstream` command line. Errors are one clear line, never a traceback."""

from __future__ import annotations

import argparse
import os
import sys
from typing import NoReturn

import redis
from pydantic import ValidationError

from core.connections import RedisUnavailable
from core.event_store import InvalidExperimentId
from core.registry import UnknownPlatform
from core.settings import PREFIX, REDIS_URL_ENV, Settings
from manager.api_client import TOKEN_ENV, ManagerError
from manager.cli import experiments, interrupts, log, manager, render, run, services, trials
from manager.experiments import ExperimentNotFound, ExperimentRunning
from manager.replay import InvalidPosition, UnknownEventType
from manager.runner import RunnerError
from manager.stack import StackError
from manager.training_service import TrialNotFound
from manager.transfer import ExperimentExists, InvalidLogFile
from schemas.config import ConfigError

EXIT_ERROR = 1
EXIT_USAGE = 2
_KNOWN_ERRORS = (
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
)
_AREAS = (run, trials, log, experiments, services, manager)


def main(argv: list[str] | None = None) -> int:
    assembled = parser()
    args, passed_on = assembled.parse_known_args(argv)  # `worker` hands its options to the worker runtime
    if args.command != "worker" and passed_on:
        assembled.error(f"unrecognized arguments: {' '.join(passed_on)}")
    args.passed_on = passed_on
    interrupts.install()
    try:
        settings = _settings(args)
        return int(args.handler(args, settings) or 0)
    except _KNOWN_ERRORS as error:
        _fail(str(error), EXIT_USAGE if isinstance(error, ConfigError) else EXIT_ERROR)
    except KeyboardInterrupt as stop:
        status = stop.exit_status if isinstance(stop, interrupts.Interrupted) else 130
        _fail(str(stop) or "interrupted", status)
    except BrokenPipeError:  # `trialstream events ... | head`: the reader has all it wants
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


def parser() -> argparse.ArgumentParser:
    """The whole command line, assembled from its areas."""
    assembled = argparse.ArgumentParser(prog="trialstream", description=__doc__)
    assembled.add_argument("--redis", help=f"Redis URL (default: ${REDIS_URL_ENV}, else a private redis-server)")
    assembled.add_argument(
        "--manager",
        metavar="URL",
        help=f"work through this `trialstream manager` (default: ${PREFIX}MANAGER_URL) instead of Redis: "
        f"run, resume, trials, events and experiments; its token is read from ${TOKEN_ENV}",
    )
    commands = assembled.add_subparsers(dest="command", required=True)
    for area in _AREAS:
        area.register(commands)
    return assembled


def _settings(args: argparse.Namespace) -> Settings:
    """Read once, here, and handed down: no other module reads trialstream's variables."""
    try:
        return Settings.from_environment(redis_url=args.redis, manager_url=args.manager)
    except ValidationError as invalid:
        first = invalid.errors()[0]
        name = PREFIX + "_".join(str(part) for part in first["loc"][:1]).upper()
        raise RunnerError(f"{name}: {first['msg']}") from None


def _fail(message: str, code: int) -> NoReturn:
    render.print_error(message)
    sys.exit(code)
