"""`trialstream worker|projector`: the long-running services of a shared Redis."""

from __future__ import annotations

import argparse
import gc
import os
import signal
import sys
import threading
from typing import TYPE_CHECKING, NoReturn

from core.variables import REDIS_URL_ENV

if TYPE_CHECKING:
    from core.settings import Settings


def register(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Both for `--help`: `worker` never reaches its parser, see hand_over_to_worker."""
    commands.add_parser(
        "worker", help="an RQ worker serving one platform's queue (see `trialstream worker --help`)", add_help=False
    )
    projector = commands.add_parser("projector", help="fold events into views, for every experiment")
    projector.set_defaults(handler=_projector)


def hand_over_to_worker(redis_url: str | None, arguments: list[str]) -> NoReturn:
    """`trialstream worker ...` is the worker runtime's own entry point (`python -m workers`), which reads and
    checks the settings itself: the control plane never imports it, and the command line loads nothing of its
    own first (a worker start is the suite's most frequent process start). Settings travel in the environment,
    never in argv (a password shows in `ps`)."""
    environment = {**os.environ, **({REDIS_URL_ENV: redis_url} if redis_url else {})}
    os.execve(sys.executable, [sys.executable, "-m", "workers", *arguments], environment)


def _projector(args: argparse.Namespace, settings: Settings) -> int:
    from core.connections import connect  # here: `trialstream worker` loads none of it
    from core.redis_urls import redact_url
    from manager.archive.policy import start_policy
    from manager.cli import render
    from manager.cli.access import required_url
    from manager.projector import Projector

    url = required_url(settings)
    client = connect(url, options=settings.redis_options())
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    render.note(f"projector serving {redact_url(url)}")
    # Folding allocates tens of short-lived objects per event; collecting every 700 allocations, and
    # scanning what was loaded at start-up each time, cost ~20 % of a rebuild (bench/FINDINGS.md).
    gc.freeze()
    gc.set_threshold(50_000, 20, 100)
    start_policy(client, settings, stop)
    Projector(client).run(stop)
    return 0
