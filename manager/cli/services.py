"""`trialstream worker|projector`: the long-running services of a shared Redis."""

from __future__ import annotations

import argparse
import gc
import signal
import threading

from core.connections import connect, redact_url
from core.settings import Settings
from manager.cli import render
from manager.cli.access import required_url
from manager.projector import Projector
from manager.runner import RunnerError


def register(commands: argparse._SubParsersAction) -> None:
    worker = commands.add_parser("worker", help="an RQ worker serving one platform's queue")
    worker.add_argument("--platform", required=True)
    worker.add_argument("--burst", action="store_true", help="quit when the queue is empty")
    worker.add_argument("--name")
    worker.add_argument(
        "--lease",
        type=float,
        metavar="SECONDS",
        help="how long this worker may be silent before its trials are declared lost "
        "(default: $TRIALSTREAM_TRIAL_LEASE_S, else 10)",
    )
    worker.add_argument(
        "--concurrency",
        type=int,
        default=1,
        metavar="N",
        help="trials this worker supervises at once (default 1; platforms whose trials run elsewhere allow many)",
    )
    worker.set_defaults(handler=_worker)

    projector = commands.add_parser("projector", help="fold events into views, for every experiment")
    projector.set_defaults(handler=_projector)


def _worker(args: argparse.Namespace, settings: Settings) -> int:
    from workers.worker import serve  # the worker runtime only where a worker runs (manager never imports it)

    required_url(settings)
    if args.lease is not None and args.lease <= 0:
        raise RunnerError(f"--lease must be a positive number of seconds, not {args.lease:g}")
    if args.lease is not None:
        settings = settings.model_copy(update={"trial_lease_s": args.lease})
    try:
        serve(settings, args.platform, concurrency=args.concurrency, burst=args.burst, name=args.name)
    except ValueError as error:
        raise RunnerError(str(error)) from None
    return 0


def _projector(args: argparse.Namespace, settings: Settings) -> int:
    url = required_url(settings)
    client = connect(url)
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    render.note(f"projector serving {redact_url(url)}")
    # Folding allocates tens of short-lived objects per event; collecting every 700 allocations, and
    # scanning what was loaded at start-up each time, cost ~20 % of a rebuild (bench/FINDINGS.md).
    gc.freeze()
    gc.set_threshold(50_000, 20, 100)
    Projector(client).run(stop)
    return 0
