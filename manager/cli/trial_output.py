"""`trialstream trials logs TRIAL_ID`: what a trial wrote, read through its platform wherever it ran (by the
manager, with `--manager`).

The bytes are the trial's: written to stdout as they are, never decoded or rendered.
"""

from __future__ import annotations

import argparse
import sys
import time

from core.platform import OutputStream, OutputUnavailable
from core.settings import Settings
from manager.cli import render
from manager.cli.access import ExperimentAccess, opened
from manager.cli.interrupts import ending_a_follow
from manager.trial_files import has_started, started_attempt
from schemas.trial import TrialJobDetail

FOLLOW_INTERVAL_S = 0.2


def register(trials: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    sub = trials.add_parser("logs", help="print a trial's stdout (or stderr), wherever it ran")
    sub.add_argument("trial_id")
    sub.add_argument("--experiment", "-e", help="experiment id (default: the newest)")
    sub.add_argument("--stderr", action="store_true", help="its stderr instead of its stdout")
    sub.add_argument("--follow", "-f", action="store_true", help="keep printing what it writes until it ends")
    sub.set_defaults(handler=_logs)


def _logs(args: argparse.Namespace, settings: Settings) -> int:
    stream: OutputStream = "stderr" if args.stderr else "stdout"
    with ending_a_follow(args.follow), opened(settings, args.experiment, following=args.follow) as experiment:
        trial = experiment.trial(args.trial_id)
        if not has_started(trial):
            never = "never started" if trial.status.is_terminal else "has not started yet"
            render.print_error(f"trial {trial.id} {never}: no output")
            return 1
        try:
            return _copy_output(experiment, trial, stream, args.follow)
        except OutputUnavailable as unavailable:
            render.print_error(str(unavailable))
            return 1
    return 0  # the follow was stopped


def _copy_output(experiment: ExperimentAccess, trial: TrialJobDetail, stream: OutputStream, follow: bool) -> int:
    """Copy the output of the trial's latest attempt that started; following, until the trial has ended
    and nothing more comes (a retry that starts meanwhile is followed from its first byte)."""
    attempt = started_attempt(trial)
    offset = 0
    while True:
        done = not follow or trial.status.is_terminal  # read before the last reads: nothing written is missed
        offset = _copy_all(experiment, trial, attempt, stream, offset)
        if done:
            return 0
        time.sleep(FOLLOW_INTERVAL_S)
        trial = experiment.trial(trial.id)
        if trial.start_time is not None and trial.attempt != attempt:
            attempt = trial.attempt
            offset = 0
            render.note(f"trial {trial.id}: attempt {attempt} started")


def _copy_all(
    experiment: ExperimentAccess, trial: TrialJobDetail, attempt: int, stream: OutputStream, offset: int
) -> int:
    """Write everything from `offset` on, as it is; returns the offset reached."""
    out = sys.stdout.buffer
    while chunk := experiment.output(trial, attempt, stream, offset):
        out.write(chunk)
        out.flush()
        offset += len(chunk)
    return offset
