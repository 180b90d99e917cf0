"""Checks before an experiment runs: its platforms can run its trials, and something serves its queue. Each says
what is wrong, for its caller to refuse with; nothing is created when there is a problem."""

from __future__ import annotations

import redis
from rq import Queue, Worker

from core import keys
from core.queueing import queue_name
from core.registry import platform_class
from core.settings import Settings
from manager.config import ExperimentSpec
from schemas.config import ConfigError


def unserved(client: redis.Redis, rq_connection: redis.Redis, platform: str, url_hint: str) -> str | None:
    """Why nothing would ever run or project the trials, if so: to fail clearly rather than hang."""
    queue = Queue(queue_name(platform), connection=rq_connection)
    if not Worker.all(queue=queue):
        return (
            f"no worker serves queue {queue.name!r} on {url_hint}: start one with "
            f"`trialstream worker --platform {platform}`"
        )
    if not client.exists(keys.PROJECTOR_HEARTBEAT):
        return f"no projector serves {url_hint}: start one with `trialstream projector`"
    return None


def platform_problems(spec: ExperimentSpec, settings: Settings) -> str | None:
    """The platform's own check before anything runs (hosts reachable, credentials right): every
    problem at once, one line each; no experiment is created or trial submitted when there is one. A
    hybrid experiment checks every listed platform: one that fails stops it before any trial.

    A config asking for what its platform can never give where its trials would run (GPUs no machine has)
    is raised as the ConfigError it is, naming the key, before those checks."""
    _refuse_unservable(spec, settings)
    failures = []
    for index, platform in enumerate(spec.platforms):
        check = getattr(platform_class(platform.platform), "check", None)  # optional for third-party platforms
        problems = check(platform, spec.code_directory, settings) if check is not None else []
        if problems:
            where = f"trainingService.{index} ({platform.platform})" if spec.hybrid else "trainingService"
            failures.append(f"{where}: cannot run trials there:\n" + "\n".join(f"  {line}" for line in problems))
    return "\n".join(failures) or None


def _refuse_unservable(spec: ExperimentSpec, settings: Settings) -> None:
    """Each platform's `config_problems` (optional), as the config's own errors read: `source: key.path: why`."""
    lines = []
    for index, platform in enumerate(spec.platforms):
        check = getattr(platform_class(platform.platform), "config_problems", None)
        problems: dict[str, str] = check(platform, spec.config, settings) if check is not None else {}
        for key, what in problems.items():
            if spec.hybrid and key.startswith("trainingService."):
                key = key.replace("trainingService.", f"trainingService.{index}.", 1)
            lines.append(f"{spec.source}: {key}: {what}")
    if lines:
        raise ConfigError("\n".join(lines))
