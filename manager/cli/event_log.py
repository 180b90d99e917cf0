"""`trialstream events|replay|export|import`: reading an experiment's log, moving it, and rebuilding its views."""

from __future__ import annotations

import argparse
import json
import shutil
import sys

import redis

from core import keys
from core.connections import connect
from core.settings import Settings
from manager.archive.moves import ArchiveError, archived
from manager.cli import render
from manager.cli.access import opened, opened_experiment, redis_required
from manager.cli.interrupts import ending_a_follow
from manager.projector import Projector
from manager.replay import (
    EntryLine,
    InvalidPosition,
    describe,
    parse_position,
    parse_types,
    replay_check,
    replayed,
)
from manager.stack import DATA_DIR, EmbeddedRedis, new_experiment_dir
from manager.transfer import ExperimentExists, InvalidLogFile, LogFile, export_log, import_log, read_log_file, renamed
from manager.views import ViewStore

EXIT_DIFFERENT = 1
TIME_HELP = "an event id (1795319625061-0), epoch milliseconds, or an ISO-8601 time (local unless it has an offset)"


def register(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    events = commands.add_parser("events", help="list an experiment's events", description=TIME_HELP)
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
    mode.add_argument("--until", metavar="EVENT_ID|TIME", help=f"the views as they were there: {TIME_HELP}")
    mode.add_argument(
        "--check", action="store_true", help="compare the live views with a replay; exit 1 on a difference"
    )
    mode.add_argument(
        "--rebuild",
        action="store_true",
        help="fold the whole log again and swap the result in for the live views (after an upgrade that changed "
        "the fold, or views damaged by hand); a running projector goes on from there",
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


def _events(args: argparse.Namespace, settings: Settings) -> int:
    types = parse_types(args.types)
    since = parse_position(args.since) if args.since else "-"
    until = parse_position(args.until, end=True) if args.until else "+"
    if args.follow and args.until:
        raise InvalidPosition("--follow prints events as they come, so it takes no --until")
    with ending_a_follow(args.follow), opened(settings, args.experiment, following=args.follow) as experiment:
        if args.trial is not None:
            experiment.trial(args.trial)  # an unknown trial is an error, not an empty list
        if args.follow:
            until = experiment.head()  # the history up to here, then everything after it
        history = experiment.log(since, until, args.trial, types)
        title = f"events of experiment {experiment.experiment_id}"
        _show_entries([describe(entry) for entry in history], title, args.trial is None, args.json)
        if args.follow:
            for entry in experiment.follow(until, args.trial, types):
                _show_entries([describe(entry)], None, args.trial is None, args.json)
    return 0


def _show_entries(lines: list[EntryLine], title: str | None, show_trial: bool, as_json: bool) -> None:
    if as_json:
        for line in lines:
            print(json.dumps(line.json), flush=True)
    else:
        render.print_entries(lines, title, show_trial)


def _replay(args: argparse.Namespace, settings: Settings) -> int:
    until = parse_position(args.until, end=True) if args.until else None
    with opened_experiment(settings, args.experiment) as (service, experiment_id):
        client = service.store.client
        if args.rebuild:
            return _rebuild(client, experiment_id, args.json)
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
    render.print_trials(trials, title=title)
    return 0


def _replay_check(client: redis.Redis, experiment_id: str, as_json: bool) -> int:
    result = replay_check(client, experiment_id)
    if as_json:
        print(json.dumps({"position": result.position, "events": result.applied, "differences": result.differences}))
    elif result.differences:
        for difference in result.differences:
            print(difference)
        render.note(
            f"the views of {experiment_id} differ from a replay of the log up to {result.position}: "
            f"`trialstream replay {experiment_id} --rebuild` replaces them"
        )
    else:
        print(f"views match the log ({result.applied} events)")
    behind = int(client.xlen(keys.events(experiment_id))) - result.applied
    if behind > 0 and not as_json:
        render.note(f"the views are {behind} events behind the log: checked up to their position {result.position}")
    return EXIT_DIFFERENT if result.differences else 0


def _rebuild(client: redis.Redis, experiment_id: str, as_json: bool) -> int:
    """Views are disposable: new ones from the log replace the live ones in one transaction (Projector.rebuild),
    so a reader sees the old views or the new ones, never a mix."""
    if archived(client, experiment_id) is not None:
        raise ArchiveError(
            f"experiment {experiment_id} is archived with its views: `trialstream experiments restore "
            f"{experiment_id}` brings it back into Redis first"
        )
    position = Projector(client).rebuild(experiment_id)
    if as_json:
        print(json.dumps({"position": position}))
    else:
        print(f"views of {experiment_id} rebuilt from its log, up to {position}")
    return 0


def _export(args: argparse.Namespace, settings: Settings) -> int:
    with opened_experiment(settings, args.experiment) as (service, experiment_id):
        count = export_log(service.store.client, experiment_id, sys.stdout)
    render.note(f"exported {count} entries of experiment {experiment_id}")
    return 0


def _import(args: argparse.Namespace, settings: Settings) -> int:
    redis_required(settings)
    log = read_log_path(args.file)
    if args.experiment_id:
        log = renamed(log, args.experiment_id)
    if settings.redis_url is not None:
        _import_into(connect(settings.redis_url, options=settings.redis_options()), log)
    else:
        _import_embedded(log, settings)
    print(f"imported experiment {log.experiment_id}: {len(log.entries)} entries")
    return 0


def read_log_path(path: str) -> LogFile:
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


def _import_embedded(log: LogFile, settings: Settings) -> None:
    """No Redis given: a new data directory under the experiments root, read later as an ended run's."""
    directory = new_experiment_dir(settings, log.experiment_id)
    data_dir = directory / DATA_DIR
    if data_dir.exists():
        raise ExperimentExists(
            f"experiment {log.experiment_id!r} already exists under {directory.parent}; "
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
