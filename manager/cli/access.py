"""Opening an experiment's data: on the shared Redis the settings name, else where an embedded run keeps it."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from core.connections import connect
from core.settings import REDIS_URL_ENV, Settings
from manager.experiments import resolve_experiment
from manager.runner import RunnerError
from manager.stack import experiment_dir, experiments_root, served_data
from manager.training_service import TrainingService


@contextmanager
def opened_experiment(settings: Settings, experiment_id: str | None) -> Iterator[tuple[TrainingService, str]]:
    """The experiment's TrainingService (the newest experiment without an id), and its id."""
    url = settings.redis_url
    if url is not None:
        client = connect(url)
        experiment_id = resolve_experiment(client, experiment_id)
        yield TrainingService(client, connect(url, decode=False), experiment_id), experiment_id
        return
    with served_data(experiment_dir(experiments_root(settings), experiment_id)) as served_url:
        client = connect(served_url)
        experiment_id = resolve_experiment(client, experiment_id)
        yield TrainingService(client, connect(served_url, decode=False), experiment_id), experiment_id


def required_url(settings: Settings) -> str:
    """The shared Redis of a service process: they never start an embedded one."""
    if settings.redis_url is None:
        raise RunnerError(f"no Redis given: set {REDIS_URL_ENV} or pass --redis URL")
    return settings.redis_url
