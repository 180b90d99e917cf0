"""`trialstream trials list|show|cancel|logs`: the trials of an experiment."""

from __future__ import annotations

import argparse
import json

from core.settings import Settings
from manager.algorithms import optimize_mode_of
from manager.cli import render, trial_output
from manager.cli.access import opened
from manager.replay import describe
from schemas.config import ExperimentConfig
from schemas.trial import TrialJobDetail, metric_score


def register(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    trials = commands.add_parser("trials", help="inspect or cancel trials").add_subparsers(dest="action", required=True)
    for name, handler, help_text in (
        ("list", _list, "list the trials of an experiment"),
        ("show", _show, "show one trial"),
        ("cancel", _cancel, "cancel one trial"),
    ):
        sub = trials.add_parser(name, help=help_text)
        if name != "list":
            sub.add_argument("trial_id")
        sub.add_argument("--experiment", "-e", help="experiment id (default: the newest)")
        if name != "cancel":
            sub.add_argument("--json", action="store_true")
        if name == "show":
            sub.add_argument("--history", action="store_true", help="also every event of the trial, in log order")
        if name == "list":
            sub.add_argument(
                "--sort",
                choices=("sequence", "metric"),
                default="sequence",
                help="metric: best first, in the tuner's optimize_mode (trials without a result last)",
            )
        sub.set_defaults(handler=handler)
    trial_output.register(trials)


def _list(args: argparse.Namespace, settings: Settings) -> int:
    with opened(settings, args.experiment) as experiment:
        trials = experiment.trials()
        if args.sort == "metric":
            config = ExperimentConfig.model_validate(experiment.config())
            trials = by_metric(trials, optimize_mode_of(config.tuner_section))
    if args.json:
        print(json.dumps([json.loads(trial.to_json()) for trial in trials]))
    else:
        render.print_trials(trials, title=f"experiment {experiment.experiment_id}")
    return 0


def by_metric(trials: list[TrialJobDetail], optimize_mode: str) -> list[TrialJobDetail]:
    """Best result first in `optimize_mode`'s direction; trials without a numeric result after them."""
    sign = -1.0 if optimize_mode == "maximize" else 1.0
    scored = [(metric_score(trial.final_metric), trial) for trial in trials]
    ranked = sorted((pair for pair in scored if pair[0] is not None), key=lambda pair: sign * (pair[0] or 0.0))
    return [trial for _, trial in ranked] + [trial for score, trial in scored if score is None]


def _show(args: argparse.Namespace, settings: Settings) -> int:
    with opened(settings, args.experiment) as experiment:
        trial = experiment.trial(args.trial_id)
        metrics = experiment.metrics(args.trial_id)
        history = None
        if args.history:
            history = [describe(entry) for entry in experiment.log(trial=args.trial_id)]
    if args.json:
        shown = {**json.loads(trial.to_json()), "metrics": [json.loads(m.to_json()) for m in metrics]}
        if history is not None:
            shown["history"] = [line.json for line in history]
        print(json.dumps(shown))
        return 0
    render.print_trial(trial, metrics)
    if history is not None:
        render.print_entries(history, title=f"history of trial {trial.id}", show_trial=False)
    return 0


def _cancel(args: argparse.Namespace, settings: Settings) -> int:
    with opened(settings, args.experiment) as experiment:
        print(f"cancel requested for trial {args.trial_id} ({experiment.cancel(args.trial_id).status})")
    return 0
