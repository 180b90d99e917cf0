"""Creating experiments and finding them again."""

from __future__ import annotations

import secrets
import string
from pathlib import Path
from typing import Any

import redis

from core import keys
from core.event_store import EventStore
from schemas.events import ExperimentCreated, ExperimentFinished

_ID_ALPHABET = string.ascii_lowercase + string.digits


class ExperimentNotFound(LookupError):
    pass


def new_id(length: int) -> str:
    return "".join(secrets.choice(_ID_ALPHABET) for _ in range(length))


def create_experiment(client: redis.Redis, config: dict[str, Any], root: Path, experiment_id: str | None = None) -> str:
    """Append ExperimentCreated and register the experiment, atomically; returns its id (8 chars, as NNI)."""
    while experiment_id is None:
        candidate = new_id(8)
        if client.zscore(keys.EXPERIMENTS, candidate) is None:
            experiment_id = candidate
    if client.zscore(keys.EXPERIMENTS, experiment_id) is not None:
        raise ValueError(f"experiment {experiment_id} already exists")
    working_directory = str(root / experiment_id)
    event = ExperimentCreated(experiment_id=experiment_id, config=config, working_directory=working_directory)
    with client.pipeline(transaction=True) as pipe:
        pipe.multi()
        EventStore(client, experiment_id).append(event, idempotency_key="created", pipeline=pipe)
        pipe.zadd(keys.EXPERIMENTS, {experiment_id: event.time})
        pipe.execute()
    return experiment_id


def finish_experiment(client: redis.Redis, experiment_id: str, status: str, message: str | None = None) -> None:
    """A resumed experiment finishes again: the last ExperimentFinished holds."""
    event = ExperimentFinished(experiment_id=experiment_id, status=status, message=message)  # type: ignore[arg-type]
    EventStore(client, experiment_id).append(event)


def resolve_experiment(client: redis.Redis, experiment_id: str | None) -> str:
    """The given experiment if it exists, else the newest one."""
    if experiment_id is None:
        newest = client.zrange(keys.EXPERIMENTS, -1, -1)
        if not newest:
            raise ExperimentNotFound("no experiment has been run against this Redis yet")
        return str(newest[0])
    if client.zscore(keys.EXPERIMENTS, experiment_id) is None:
        raise ExperimentNotFound(f"experiment {experiment_id!r} not found")
    return experiment_id
