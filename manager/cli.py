"""The `trialstream` command line. Errors are one clear line, never a traceback."""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import NoReturn

import redis
from rich.console import Console
from rich.live import Live
from rich.table import Table
from rich.text import Text

from core import keys
from core.connections import REDIS_URL_ENV, RedisUnavailable, connect, redact_url, redis_url
from core.registry import UnknownPlatform
from core.settings import Settings
from manager.config import ExperimentSpec, load_experiment_config, stored_experiment_spec
from manager.experiments import ExperimentNotFound, new_id, resolve_experiment
from manager.projector import Projector
from manager.replay import (
    EntryLine,
    InvalidPosition,
    UnknownEventType,
    describe,
    event_types,
    follow_log,
    parse_position,
    parse_types,
    read_log,
    replay_check,
    replayed,
)
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
from manager.transfer import ExperimentExists, InvalidLogFile, LogFile, export_log, import_log, read_log_file, renamed
from manager.views import ViewStore
from schemas.config import ConfigError
from schemas.trial import TrialJobDetail, metric_score

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
    InvalidPosition,
    UnknownEventType,
    InvalidLogFile,
    ExperimentExists,
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
    except BrokenPipeError:  # `trialstream events ... | head`: the reader has all it wants
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


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

    resume = commands.add_parser("resume", help="continue an experiment from its log after its runner stopped")
    resume.add_argument("experiment_id")
    resume.add_argument("--json", action="store_true", help="print the result as one JSON object at the end")
    resume.set_defaults(handler=_resume)

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
        if name == "show":
            sub.add_argument("--history", action="store_true", help="also every event of the trial, in log order")
        sub.set_defaults(handler=handler)

    time_help = "an event id (1795319625061-0), epoch milliseconds, or an ISO-8601 time (local unless it has an offset)"
    events = commands.add_parser("events", help="list an experiment's events", description=time_help)
    events.add_argument("experiment", nargs="?", help="experiment id (default: the newest)")
    events.add_argument("--trial", help="only this trial's events")
    events.add_argument(
        "--type", action="append", dest="types", metavar="TYPE", help="only these types (repeatable, or a,b)"
    )
    events.add_argument("--since", metavar="TIME", help="from this event or time on")
    events.add_argument("--until", metavar="TIME", help="up to this event or time")
    events.add_argument("--follow", "-f", action="store_true", help="then print new events as they come, until ^C")
    events.add_argument("--json", action="store_true", help='one {"id", "event"} object per line')
    events.set_defaults(handler=_events)

    replay = commands.add_parser("replay", help="rebuild the views from the log, at a point or to check the live ones")
    replay.add_argument("experiment", nargs="?", help="experiment id (default: the newest)")
    mode = replay.add_mutually_exclusive_group(required=True)
    mode.add_argument("--until", metavar="EVENT_ID|TIME", help=f"the views as they were there: {time_help}")
    mode.add_argument(
        "--check", action="store_true", help="compare the live views with a replay; exit 1 on a difference"
    )
    replay.add_argument("--json", action="store_true")
    replay.set_defaults(handler=_replay)

    export = commands.add_parser("export", help="write an experiment's log as JSON lines to stdout")
    export.add_argument("experiment", nargs="?", help="experiment id (default: the newest)")
    export.set_defaults(handler=_export)

    import_ = commands.add_parser("import", help="load a log written by `export` (its views are rebuilt)")
    import_.add_argument("file", help="the JSON lines file, or - for stdin")
    import_.add_argument("--experiment-id", metavar="NEW_ID", help="import under this id instead of the file's")
    import_.set_defaults(handler=_import)

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
        result = _with_progress(lambda show: ExperimentRunner.create(spec, client, rq_connection, on_progress=show))
    else:
        experiment_id = new_id(8)
        with _embedded_stack(experiments_root(spec) / experiment_id) as (client, rq_connection, services):
            services.serve(spec.platform.platform, spec.config.trial_concurrency)
            result = _with_progress(
                lambda show: ExperimentRunner.create(spec, client, rq_connection, experiment_id, on_progress=show)
            )
    _print_result(result, args.json)
    return 0


def _resume(args: argparse.Namespace) -> int:
    """Continue an experiment whose runner stopped, from its log (see ExperimentRunner.resume)."""
    url = redis_url(args.redis)
    if url is not None:
        client, rq_connection = connect(url), connect(url, decode=False)
        experiment_id = resolve_experiment(client, args.experiment_id)
        spec = _stored_spec(client, rq_connection, experiment_id)
        check_served(client, rq_connection, spec.platform.platform, redact_url(url))
        result = _with_progress(lambda show: ExperimentRunner.resume(client, rq_connection, experiment_id, show))
    else:
        experiment_dir = _embedded_data_dir(args.experiment_id).parent
        if (experiment_dir / "redis" / "redis.sock").exists():
            with suppress(RedisUnavailable):
                connect(f"unix://{experiment_dir / 'redis' / 'redis.sock'}")
                raise RunnerError(f"experiment {args.experiment_id} is still running (its Redis answers)")
        with _embedded_stack(experiment_dir) as (client, rq_connection, services):
            experiment_id = resolve_experiment(client, args.experiment_id)
            spec = _stored_spec(client, rq_connection, experiment_id)
            services.serve(spec.platform.platform, spec.config.trial_concurrency)
            result = _with_progress(lambda show: ExperimentRunner.resume(client, rq_connection, experiment_id, show))
    _print_result(result, args.json)
    return 0


def _stored_spec(client: redis.Redis, rq_connection: redis.Redis, experiment_id: str) -> ExperimentSpec:
    experiment = TrainingService(client, rq_connection, experiment_id).experiment_view()
    return stored_experiment_spec(experiment.config, experiment.working_directory)


def _print_result(result: ExperimentResult, as_json: bool) -> None:
    if as_json:
        print(result.to_json())
    else:
        _print_trials(result.trials, title=f"experiment {result.experiment_id}")


class _Services(ServiceProcesses):
    def serve(self, platform: str, concurrency: int) -> None:
        """The projector, and one worker per concurrent trial plus a spare: the worker whose trial just
        ended is still doing RQ's bookkeeping when the next trial is queued (~30 ms here), and the spare
        takes it at once."""
        self.start("projector", log_name="projector")
        for index in range(concurrency + 1):
            self.start("worker", "--platform", platform, log_name=f"worker-{index}")


@contextmanager
def _embedded_stack(experiment_dir: Path) -> Iterator[tuple[redis.Redis, redis.Redis, _Services]]:
    """A private Redis with its data under the experiment's directory; services are stopped on the way out."""
    server = EmbeddedRedis(experiment_dir / "redis")
    url = server.start()
    services = _Services(url, experiment_dir / "logs")
    try:
        yield connect(url), connect(url, decode=False), services
    finally:
        services.stop()
        server.stop()


def _with_progress(make_runner: Callable[[Callable[[Progress], None]], ExperimentRunner]) -> ExperimentResult:
    with Live(console=err, refresh_per_second=8, transient=False) as live:
        return make_runner(lambda progress: live.update(_progress_table(progress))).run()


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
    with _experiment(args) as (service, experiment_id):
        trial = service.get_trial_job(args.trial_id)
        metrics = service.views.metrics(args.trial_id)
        history = None
        if args.history:
            history = [describe(entry) for entry in read_log(service.store.client, experiment_id, trial=args.trial_id)]
    if args.json:
        shown = {**json.loads(trial.to_json()), "metrics": [json.loads(m.to_json()) for m in metrics]}
        if history is not None:
            shown["history"] = [line.json for line in history]
        print(json.dumps(shown))
        return 0
    console = Console()
    console.print_json(trial.to_json())
    for metric in metrics:
        console.print(f"{metric.type:<10} seq {metric.sequence:<4} {json.dumps(metric.value)}", highlight=False)
    if history is not None:
        _print_entries(history, title=f"history of trial {trial.id}", show_trial=False)
    return 0


def _trials_cancel(args: argparse.Namespace) -> int:
    with _experiment(args) as (service, _):
        service.cancel_trial_job(args.trial_id)
        print(f"cancel requested for trial {args.trial_id} ({service.get_trial_job(args.trial_id).status})")
    return 0


# the log


def _events(args: argparse.Namespace) -> int:
    types = parse_types(args.types)
    since = parse_position(args.since) if args.since else "-"
    until = parse_position(args.until, end=True) if args.until else "+"
    if args.follow and args.until:
        raise InvalidPosition("--follow prints events as they come, so it takes no --until")
    with _experiment(args) as (service, experiment_id):
        client = service.store.client
        if args.trial is not None:
            service.get_trial_job(args.trial)  # an unknown trial is an error, not an empty list
        if args.follow:
            until = service.store.head()  # the history up to here, then everything after it
        history = read_log(client, experiment_id, since=since, until=until, trial=args.trial, types=types)
        title = f"events of experiment {experiment_id}"
        _show_entries([describe(entry) for entry in history], title, args.trial is None, args.json)
        if args.follow:
            with suppress(KeyboardInterrupt):  # ^C or SIGTERM: the way to stop following
                for entry in follow_log(client, experiment_id, until, trial=args.trial, types=types):
                    _show_entries([describe(entry)], None, args.trial is None, args.json)
    return 0


def _show_entries(lines: list[EntryLine], title: str | None, show_trial: bool, as_json: bool) -> None:
    if as_json:
        for line in lines:
            print(json.dumps(line.json), flush=True)
    else:
        _print_entries(lines, title, show_trial)


def _print_entries(lines: list[EntryLine], title: str | None, show_trial: bool) -> None:
    """The one rendering of log entries (events, a trial's history); without a title, rows that follow a table."""
    table = Table(title=title, title_justify="left", box=None, pad_edge=False, show_header=title is not None)
    columns = [("id", 15), ("time", 29), ("type", max(map(len, event_types())))]
    columns += [("trial", 5)] if show_trial else []
    columns += [("source", 14), ("attempt", 7), ("summary", 0)]
    for column, width in columns:
        table.add_column(column, min_width=width or None, overflow="fold")
    for line in lines:
        cells = [line.id, line.time, line.type, *([line.trial] if show_trial else []), line.source]
        cells += ["" if line.attempt is None else str(line.attempt), line.summary]
        table.add_row(*(Text(cell) for cell in cells), style="red" if line.summary.startswith("unreadable") else None)
    console = Console()
    if console.is_terminal:
        console.print(table)
        return
    wide = Console(width=100_000)  # a pipe or a file: one line per row whatever its length, for grep
    with wide.capture() as captured:
        wide.print(table)
    print("\n".join(row.rstrip() for row in captured.get().splitlines()), flush=True)


def _replay(args: argparse.Namespace) -> int:
    until = parse_position(args.until, end=True) if args.until else None
    with _experiment(args) as (service, experiment_id):
        client = service.store.client
        if until is None:
            return _replay_check(client, experiment_id, args.json)
        with replayed(client, experiment_id, until) as replay:
            views = ViewStore(client, experiment_id, replay.namespace)
            experiment, trials = views.experiment(), views.trials()
    if args.json:
        shown = {
            "position": replay.position,
            "experiment": None if experiment is None else json.loads(experiment.to_json()),
            "trials": [json.loads(trial.to_json()) for trial in trials],
        }
        print(json.dumps(shown))
        return 0
    if replay.position == "0-0":
        title = f"experiment {experiment_id} before its first event"
    else:
        status = "" if experiment is None else f", {experiment.status}"
        title = f"experiment {experiment_id} at event {replay.position}{status}"
    _print_trials(trials, title=title)
    return 0


def _replay_check(client: redis.Redis, experiment_id: str, as_json: bool) -> int:
    result = replay_check(client, experiment_id)
    if as_json:
        print(json.dumps({"position": result.position, "events": result.applied, "differences": result.differences}))
    elif result.differences:
        for difference in result.differences:
            print(difference)
        err.print(f"the views of {experiment_id} differ from a replay of the log up to {result.position}")
    else:
        print(f"views match the log ({result.applied} events)")
    behind = int(client.xlen(keys.events(experiment_id))) - result.applied
    if behind > 0 and not as_json:
        err.print(f"the views are {behind} events behind the log: checked up to their position {result.position}")
    return EXIT_ERROR if result.differences else 0


def _export(args: argparse.Namespace) -> int:
    with _experiment(args) as (service, experiment_id):
        count = export_log(service.store.client, experiment_id, sys.stdout)
    err.print(f"exported {count} entries of experiment {experiment_id}", highlight=False)
    return 0


def _import(args: argparse.Namespace) -> int:
    log = _read_log_file(args.file)
    if args.experiment_id:
        log = renamed(log, args.experiment_id)
    url = redis_url(args.redis)
    if url is not None:
        _import_into(connect(url), log)
    else:
        _import_embedded(log)
    print(f"imported experiment {log.experiment_id}: {len(log.entries)} entries")
    return 0


def _read_log_file(path: str) -> LogFile:
    try:
        if path == "-":
            return read_log_file(sys.stdin)
        with open(path, encoding="utf-8") as source:
            return read_log_file(source, name=path)
    except OSError as error:
        raise InvalidLogFile(f"cannot read {path}: {error.strerror or error}") from None
    except UnicodeDecodeError:
        raise InvalidLogFile(f"{path}: not UTF-8 text, not a trialstream log") from None


def _import_into(client: redis.Redis, log: LogFile) -> None:
    """Import, then project at once, so the views are there even where no projector serves."""
    import_log(client, log)
    Projector(client).catch_up(log.experiment_id)


def _import_embedded(log: LogFile) -> None:
    """No Redis given: a new data directory under the experiments root, read later as an ended run's."""
    root = default_experiments_root()
    data_dir = root / log.experiment_id / "redis"
    if data_dir.exists():
        raise ExperimentExists(
            f"experiment {log.experiment_id!r} already exists under {root}; "
            "import it under another id with --experiment-id NEW_ID"
        )
    server = EmbeddedRedis(data_dir)
    imported = False
    try:
        _import_into(connect(server.start()), log)
        imported = True
    finally:
        server.stop()
        if not imported:
            shutil.rmtree(data_dir, ignore_errors=True)


# long-running services


def _worker(args: argparse.Namespace) -> int:
    from workers.worker import serve

    url = _required_url(args)
    if args.lease is not None and args.lease <= 0:
        raise RunnerError(f"--lease must be a positive number of seconds, not {args.lease:g}")
    settings = Settings.from_environment(redis_url=url, trial_lease_s=args.lease)
    try:
        serve(settings, args.platform, concurrency=args.concurrency, burst=args.burst, name=args.name)
    except ValueError as error:
        raise RunnerError(str(error)) from None
    return 0


def _projector(args: argparse.Namespace) -> int:
    url = _required_url(args)
    client = connect(url)
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    err.print(f"projector serving {redact_url(url)}", highlight=False)
    # Folding allocates tens of short-lived objects per event; collecting every 700 allocations, and
    # scanning what was loaded at start-up each time, cost ~20 % of a rebuild (bench/FINDINGS.md).
    gc.freeze()
    gc.set_threshold(50_000, 20, 100)
    Projector(client).run(stop)
    return 0


if __name__ == "__main__":
    sys.exit(main())
