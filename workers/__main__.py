"""`python -m workers`: a worker process, serving one platform's queue (what `trialstream worker` runs).

The worker runtime has its own entry point so that the control plane never imports it: `trialstream
worker` hands over to this one with `exec`, its settings in the environment.
"""

from __future__ import annotations

import argparse
import sys

from core.variables import hide_environment

hide_environment()  # first: the environment holds the Redis URL and its password

from core.lean_imports import import_redis  # noqa: E402

import_redis()  # then: what follows imports redis-py

from pydantic import ValidationError  # noqa: E402

from core.connections import RedisUnavailable  # noqa: E402
from core.registry import UnknownPlatform  # noqa: E402
from core.settings import Settings  # noqa: E402
from workers.runtime.worker import alive_here, serve  # noqa: E402


def parser() -> argparse.ArgumentParser:
    parsed = argparse.ArgumentParser(prog="trialstream worker", description="an RQ worker serving one platform's queue")
    parsed.add_argument("--platform")
    parsed.add_argument(
        "--healthcheck", action="store_true", help="exit 0 if a worker of this host (container) is registered in Redis"
    )
    parsed.add_argument("--burst", action="store_true", help="quit when the queue is empty")
    parsed.add_argument("--name")
    parsed.add_argument(
        "--lease",
        type=float,
        metavar="SECONDS",
        help="how long this worker may be silent before its trials are declared lost "
        "(default: $TRIALSTREAM_TRIAL_LEASE_S, else 10)",
    )
    parsed.add_argument(
        "--concurrency",
        type=int,
        default=1,
        metavar="N",
        help="trials this worker supervises at once (default 1; platforms whose trials run elsewhere allow many)",
    )
    parsed.add_argument("--log-format", choices=("text", "json"), default="text", help="json: one object per line")
    return parsed


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        if args.lease is not None and args.lease <= 0:
            raise ValueError(f"--lease must be a positive number of seconds, not {args.lease:g}")
        settings = Settings.from_environment(trial_lease_s=args.lease)
        if settings.redis_url is None:
            raise ValueError("no Redis given: set TRIALSTREAM_REDIS_URL or pass --redis URL")
        if args.healthcheck:
            return 0 if alive_here(settings) else 1
        if args.platform is None:
            raise ValueError("--platform is required: the platform whose queue to serve (local, remote, ...)")
        serve(
            settings,
            args.platform,
            concurrency=args.concurrency,
            burst=args.burst,
            name=args.name,
            log_format=args.log_format,
        )
    except (ValueError, ValidationError, UnknownPlatform, RedisUnavailable) as error:
        print(f"trialstream: error: {str(error).splitlines()[0]}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
