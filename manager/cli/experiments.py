"""`trialstream experiments list|delete|archive|restore`: every experiment of a manager, a shared Redis or the
experiments root."""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from collections.abc import Iterator
from contextlib import contextmanager

import redis

from core.connections import connect
from core.settings import Settings
from manager.archive.moves import archive, restore
from manager.archive.policy import store_of
from manager.cli import render
from manager.cli.access import manager_client
from manager.experiments import (
    ExperimentRunning,
    ExperimentSummary,
    delete_experiment,
    list_experiments,
    resolve_known,
)
from manager.runner import RunnerError
from manager.stack import embedded_experiments, experiment_dir, experiments_root, live_url, served_data
from schemas.api import ExperimentState


def register(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    experiments = commands.add_parser("experiments", help="list or delete experiments").add_subparsers(
        dest="action", required=True
    )
    listing = experiments.add_parser("list", help="every experiment: status, times, trial counts, where its data is")
    listing.add_argument("--json", action="store_true", help="one JSON array")
    listing.set_defaults(handler=_list)
    delete = experiments.add_parser(
        "delete", help="delete an experiment that is not running: its log, views, jobs and (embedded) directory"
    )
    delete.add_argument("experiment_id")
    delete.add_argument("--yes", "-y", action="store_true", help="do not ask for confirmation")
    delete.set_defaults(handler=_delete)
    archive = experiments.add_parser(
        "archive", help="move an ended experiment's log and views out of Redis into the archive; reads go on"
    )
    archive.add_argument("experiment_id")
    archive.set_defaults(handler=_archive)
    restore = experiments.add_parser("restore", help="bring an archived experiment back into Redis for good")
    restore.add_argument("experiment_id")
    restore.set_defaults(handler=_restore)


def _list(args: argparse.Namespace, settings: Settings) -> int:
    summaries = _summaries(settings)
    if args.json:
        print(json.dumps([summary.model_dump(by_alias=True) for summary in summaries]))
    else:
        render.print_experiments(summaries)
    return 0


def _summaries(settings: Settings) -> list[ExperimentSummary]:
    if settings.manager_url is not None:
        return [_summary(state) for state in manager_client(settings).experiments()]
    if settings.redis_url is not None:
        return list_experiments(connect(settings.redis_url, options=settings.redis_options()))
    summaries = []
    for directory in embedded_experiments(experiments_root(settings)):
        with served_data(directory) as url:
            summaries += list_experiments(connect(url))
    return summaries


def _summary(state: ExperimentState) -> ExperimentSummary:
    """A manager's experiment as `list_experiments` shows one; the API does not say where its directory is."""
    return ExperimentSummary(
        id=state.id,
        status=state.status,
        created=state.start_time,
        ended=None if state.status == "RUNNING" else state.end_time,
        trial_counts=state.trial_counts,
        directory="",
        archived=state.archived,
    )


def _delete(args: argparse.Namespace, settings: Settings) -> int:
    experiment_id = args.experiment_id
    if not args.yes:
        _confirm(f"delete experiment {experiment_id} and everything it recorded?")
    if settings.manager_url is not None:
        deleted = manager_client(settings).delete(experiment_id)
        print(f"deleted experiment {experiment_id} ({deleted} keys)")
        return 0
    if settings.redis_url is not None:
        deleted = delete_experiment(connect(settings.redis_url, options=settings.redis_options()), experiment_id)
        print(f"deleted experiment {experiment_id} ({deleted} keys)")
        return 0
    directory = experiment_dir(experiments_root(settings), experiment_id)
    if live_url(directory) is not None:
        raise ExperimentRunning(f"experiment {experiment_id} is running (its Redis answers): stop it first")
    with served_data(directory) as url:
        delete_experiment(connect(url), experiment_id)
    shutil.rmtree(directory)
    print(f"deleted experiment {experiment_id} and its directory {directory}")
    return 0


def _archive(args: argparse.Namespace, settings: Settings) -> int:
    store = store_of(settings)
    with _experiment_redis(settings, args.experiment_id) as client:
        record = archive(
            client,
            args.experiment_id,
            store,
            thaw_s=settings.archive_thaw_s,
        )
    print(f"archived experiment {args.experiment_id} to {store.location} ({record.keys} keys, {record.size:,} bytes)")
    return 0


def _restore(args: argparse.Namespace, settings: Settings) -> int:
    with _experiment_redis(settings, args.experiment_id) as client:
        restored = restore(client, args.experiment_id)
    print(
        f"restored experiment {args.experiment_id} ({restored} keys)"
        if restored
        else f"{args.experiment_id} is in Redis"
    )
    return 0


@contextmanager
def _experiment_redis(settings: Settings, experiment_id: str) -> Iterator[redis.Redis]:
    """The Redis holding the experiment: the shared one, or the embedded experiment's (served for the command)."""
    if settings.manager_url is not None and settings.redis_url is None:
        raise RunnerError("archive and restore work on Redis itself: set TRIALSTREAM_REDIS_URL (the manager's Redis)")
    if settings.redis_url is not None:
        client = connect(settings.redis_url, options=settings.redis_options())
        resolve_known(client, experiment_id)
        yield client
        return
    with served_data(experiment_dir(experiments_root(settings), experiment_id)) as url:
        yield connect(url)


def _confirm(question: str) -> None:
    if not sys.stdin.isatty():
        raise RunnerError(f"{question} pass --yes to delete without asking")
    if input(f"{question} [y/N] ").strip().lower() not in ("y", "yes"):
        raise RunnerError("not deleted")
