"""The `trialstream` command line. Errors are one clear line, never a traceback."""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import NoReturn

import redis
from rich.console import Console
from rich.live import Live
from rich.table import Table

from manager.config import ExperimentSpec, load_experiment_config
from manager.connections import REDIS_URL_ENV, RedisUnavailable, connect, redact_url, redis_url
from manager.experiments import ExperimentNotFound, new_id, resolve_experiment
from manager.projector import Projector
from manager.runner import (
    ExperimentResult,
    ExperimentRunner,
    Progress,
    RunnerError,
    check_served,
    default_experiments_root,
    experiments_root,
)
from manager.stack import EmbeddedRedis, ServiceProcesses, StackError
from manager.training_service import TrainingService, TrialNotFound
from schemas.config import ConfigError
from schemas.trial import TrialJobDetail, metric_score
from workers.registry import UnknownPlatform

EXIT_ERROR = 1
EXIT_USAGE = 2
_KNOWN_ERRORS = (
    ConfigError,
    RedisUnavailable,
    TrialNotFound,
    ExperimentNotFound,
    UnknownPlatform,
    RunnerError,
    StackError,
    redis.RedisError,
)

err = Console(stderr=True)


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, _raise_keyboard_interrupt)
    try:
        return int(args.handler(args) or 0)
    except _KNOWN_ERRORS as error:
        _fail(str(error), EXIT_USAGE if isinstance(error, ConfigError) else EXIT_ERROR)
    except KeyboardInterrupt:
        _fail("interrupted", 130)


def _fail(message: str, code: int) -> NoReturn:
    err.print(f"[bold red]trialstream: error:[/] {message}", highlight=False, soft_wrap=True)
    sys.exit(code)


def _raise_keyboard_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="trialstream", description=__doc__)
    parser.add_argument("--redis", help=f"Redis URL (default: ${REDIS_URL_ENV}, else a private redis-server)")
    commands = parser.add_subparsers(dest="command", required=True)

    run = commands.add_parser("run", help="run an NNI v2 experiment YAML to completion")
    run.add_argument("config", type=Path)
    run.add_argument("--json", action="store_true", help="print the result as one JSON object at the end")
    run.set_defaults(handler=_run)

    trials = commands.add_parser("trials", help="inspect or cancel trials").add_subparsers(dest="action", required=True)
    for name, handler, help_text in (
        ("list", _trials_list, "list the trials of an experiment"),
        ("show", _trials_show, "show one trial"),
        ("cancel", _trials_cancel, "cancel one trial"),
    ):
        sub = trials.add_parser(name, help=help_text)
        if name != "list":
            sub.add_argument("trial_id")
        sub.add_argument("--experiment", "-e", help="experiment id (default: the newest)")
        if name != "cancel":
            sub.add_argument("--json", action="store_true")
        sub.set_defaults(handler=handler)

    worker = commands.add_parser("worker", help="an RQ worker serving one platform's queue")
    worker.add_argument("--platform", required=True)
    worker.add_argument("--burst", action="store_true", help="quit when the queue is empty")
    worker.add_argument("--name")
    worker.set_defaults(handler=_worker)

    projector = commands.add_parser("projector", help="fold events into views, for every experiment")
    projector.set_defaults(handler=_projector)
    return parser


def _required_url(args: argparse.Namespace) -> str:
    url = redis_url(args.redis)
    if url is None:
        raise RunnerError(f"no Redis given: set {REDIS_URL_ENV} or pass --redis URL")
    return url


# run


def _run(args: argparse.Namespace) -> int:
    spec = load_experiment_config(args.config)
    url = redis_url(args.redis)
    if url is not None:
        client, rq_connection = connect(url), connect(url, decode=False)
        check_served(client, rq_connection, spec.platform.platform, redact_url(url))
        result = _run_with_progress(spec, client, rq_connection)
    else:
        result = _run_embedded(spec)
    if args.json:
        print(result.to_json())
    else:
        _print_trials(result.trials, title=f"experiment {result.experiment_id}")
    return 0


def _run_embedded(spec: ExperimentSpec) -> ExperimentResult:
    """A private Redis under the experiment's directory, then the projector and one worker per concurrent trial."""
    experiment_id = new_id(8)
    experiment_dir = experiments_root(spec) / experiment_id
    server = EmbeddedRedis(experiment_dir / "redis")
    url = server.start()
    services = ServiceProcesses(url, experiment_dir / "logs")
    try:
        services.start("projector", log_name="projector")
        for index in range(spec.config.trial_concurrency):
            services.start("worker", "--platform", spec.platform.platform, log_name=f"worker-{index}")
        return _run_with_progress(spec, connect(url), connect(url, decode=False), experiment_id)
    finally:
        services.stop()
        server.stop()


def _run_with_progress(
    spec: ExperimentSpec, client: redis.Redis, rq_connection: redis.Redis, experiment_id: str | None = None
) -> ExperimentResult:
    with Live(console=err, refresh_per_second=8, transient=False) as live:
        runner = ExperimentRunner.create(
            spec,
            client,
            rq_connection,
            experiment_id=experiment_id,
            on_progress=lambda progress: live.update(_progress_table(progress)),
        )
        return runner.run()


def _progress_table(progress: Progress) -> Table:
    table = Table(title=f"experiment {progress.experiment_id}", title_justify="left", show_edge=False)
    for column in ("waiting", "running", "succeeded", "failed", "stopped", "best", "elapsed"):
        table.add_column(column, justify="right")
    counts = progress.counts
    stopped = counts["USER_CANCELED"] + counts["SYS_CANCELED"] + counts["EARLY_STOPPED"]
    best = "-" if progress.best is None else f"{progress.best:.6g}"
    table.add_row(
        str(counts["WAITING"]),
        str(counts["RUNNING"] + counts["UNKNOWN"]),
        str(counts["SUCCEEDED"]),
        str(counts["FAILED"]),
        str(stopped),
        best,
        f"{progress.elapsed_s:.1f}s",
    )
    return table


def _print_trials(trials: list[TrialJobDetail], title: str) -> None:
    table = Table(title=title, title_justify="left")
    for column in ("id", "seq", "status", "final metric", "parameters", "message"):
        table.add_column(column)
    for trial in trials:
        score = metric_score(trial.final_metric)
        table.add_row(
            trial.id,
            str(trial.sequence_id),
            str(trial.status),
            "" if score is None else f"{score:.6g}",
            json.dumps(trial.form.hyper_parameters.parameters),
            trial.message or "",
        )
    Console().print(table)


# trials


@contextmanager
def _experiment(args: argparse.Namespace) -> Iterator[tuple[TrainingService, str]]:
    """The experiment's TrainingService: on the given Redis, or on the data an embedded run left behind."""
    url = redis_url(args.redis)
    if url is not None:
        shared = connect(url)
        experiment_id = resolve_experiment(shared, args.experiment)
        yield TrainingService(shared, connect(url, decode=False), experiment_id), experiment_id
        return
    data_dir = _embedded_data_dir(args.experiment)
    server = None
    socket_path = data_dir / "redis.sock"
    live_url = f"unix://{socket_path}"
    client: redis.Redis | None = None
    if socket_path.exists():  # the run is still going: talk to its server
        with suppress(RedisUnavailable):
            client = connect(live_url)
    if client is None:  # the run is over: serve its data from a temporary server
        server = EmbeddedRedis(data_dir)
        live_url = server.start()
        client = connect(live_url)
    try:
        experiment_id = resolve_experiment(client, args.experiment)
        yield TrainingService(client, connect(live_url, decode=False), experiment_id), experiment_id
    finally:
        if server is not None:
            server.stop()


def _embedded_data_dir(experiment_id: str | None) -> Path:
    root = default_experiments_root()
    if experiment_id is not None:
        data_dir = root / experiment_id / "redis"
        if not data_dir.is_dir():
            raise ExperimentNotFound(
                f"experiment {experiment_id!r} not found under {root} (set {REDIS_URL_ENV} for a shared Redis)"
            )
        return data_dir
    candidates = sorted(root.glob("*/redis"), key=lambda path: path.stat().st_mtime)
    if not candidates:
        raise ExperimentNotFound(f"no experiment found under {root}; set {REDIS_URL_ENV} for a shared Redis")
    return candidates[-1]


def _trials_list(args: argparse.Namespace) -> int:
    with _experiment(args) as (service, experiment_id):
        trials = service.list_trial_jobs()
    if args.json:
        print(json.dumps([json.loads(trial.to_json()) for trial in trials]))
    else:
        _print_trials(trials, title=f"experiment {experiment_id}")
    return 0


def _trials_show(args: argparse.Namespace) -> int:
    with _experiment(args) as (service, _):
        trial = service.get_trial_job(args.trial_id)
        metrics = service.views.metrics(args.trial_id)
    if args.json:
        print(json.dumps({**json.loads(trial.to_json()), "metrics": [json.loads(m.to_json()) for m in metrics]}))
        return 0
    console = Console()
    console.print_json(trial.to_json())
    for metric in metrics:
        console.print(f"{metric.type:<10} seq {metric.sequence:<4} {json.dumps(metric.value)}", highlight=False)
    return 0


def _trials_cancel(args: argparse.Namespace) -> int:
    with _experiment(args) as (service, _):
        service.cancel_trial_job(args.trial_id)
        print(f"cancel requested for trial {args.trial_id} ({service.get_trial_job(args.trial_id).status})")
    return 0


# long-running services


def _worker(args: argparse.Namespace) -> int:
    from workers.worker import serve

    url = _required_url(args)
    serve(connect(url, decode=False), args.platform, burst=args.burst, name=args.name)
    return 0


def _projector(args: argparse.Namespace) -> int:
    url = _required_url(args)
    client = connect(url)
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    err.print(f"projector serving {redact_url(url)}", highlight=False)
    Projector(client).run(stop)
    return 0


if __name__ == "__main__":
    sys.exit(main())
