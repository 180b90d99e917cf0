"""`trialstream timeline`: an experiment's timeline as one HTML file that opens in any browser, offline."""

from __future__ import annotations

import argparse
import io
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from core.settings import Settings
from manager.cli import render
from manager.cli.access import RedisExperiment, opened_experiment, redis_required
from manager.cli.event_log import read_log_path
from manager.timeline_page import file_data, file_page
from manager.transfer import LogFile, export_log, read_log_file
from manager.trial_files import output_tail
from schemas.trial import TrialJobDetail


def register(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    timeline = commands.add_parser(
        "timeline", help="write an experiment's timeline as one HTML file (it opens offline, the log inside)"
    )
    timeline.add_argument("experiment", nargs="?", help="experiment id (default: the newest)")
    timeline.add_argument("-o", "--output", required=True, metavar="FILE", help="the HTML file to write")
    timeline.add_argument("--log", metavar="FILE", help="from a log `trialstream export` wrote, with no Redis")
    timeline.add_argument(
        "--no-output", action="store_true", help="leave the trials' output out (it is read where each one ran)"
    )
    timeline.set_defaults(handler=_timeline)


def _timeline(args: argparse.Namespace, settings: Settings) -> int:
    if args.log is not None:
        log = read_log_path(args.log)
        if args.experiment not in (None, log.experiment_id):
            raise ValueError(f"{args.log} holds experiment {log.experiment_id}, not {args.experiment}")
        data = file_data(log.experiment_id, log.entries, Path(args.log).read_text(encoding="utf-8"), {})
    else:
        redis_required(settings)
        with opened_experiment(settings, args.experiment) as (service, experiment_id):
            text = io.StringIO()
            export_log(service.store.client, experiment_id, text)
            log = read_log_file(text.getvalue().splitlines(), name=f"experiment {experiment_id}")
            outputs = {} if args.no_output else _outputs(RedisExperiment(service, settings))
            data = file_data(experiment_id, log.entries, text.getvalue(), outputs)
    _write(args.output, log, data)
    return 0


def _outputs(experiment: RedisExperiment) -> dict[str, dict[str, Any]]:
    """The end of each started attempt's stdout, read where it ran."""
    found = {}
    try:
        for trial in experiment.trials():
            for attempt in range(1, trial.attempt + 1):
                found[f"{trial.id}/{attempt}"] = _tail(experiment, trial, attempt)
    finally:
        experiment.close()
    return found


def _tail(experiment: RedisExperiment, trial: TrialJobDetail, attempt: int) -> dict[str, Any]:
    def chunks() -> Iterator[bytes]:
        offset = 0
        while chunk := experiment.output(trial, attempt, "stdout", offset):
            offset += len(chunk)
            yield chunk

    try:
        return output_tail(chunks())
    except Exception as error:  # a host away, a pod gone: that attempt's output is missing, the file is still written
        return {"error": str(error) or type(error).__name__}


def _write(path: str, log: LogFile, data: dict[str, Any]) -> None:
    config = {"mode": "file", "experimentId": log.experiment_id, "api": None, "webui": None, "index": None}
    page = file_page(config, data)
    if path == "-":
        sys.stdout.write(page)
    else:
        Path(path).write_text(page, encoding="utf-8")
    attempts = len(data["timeline"]["attempts"])
    render.note(f"wrote the timeline of experiment {log.experiment_id} ({attempts} attempts) to {path}")
