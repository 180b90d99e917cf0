"""The one place that turns things into terminal output.

Text that comes from trials or users (messages, parameters, metric values, stderr tails, event
summaries, errors quoting them) is data: it is always a `rich.text.Text`, never parsed as markup, and its
control characters are shown escaped (`\x1b`), never sent to the terminal to act on.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from datetime import datetime
from typing import TYPE_CHECKING

from rich.console import Console
from rich.table import Table
from rich.text import Text

from manager.replay import EntryLine, event_types
from schemas.trial import MetricRecord, TrialJobDetail, metric_score

if TYPE_CHECKING:  # a listing loads neither the runner nor the experiments' summaries
    from manager.experiments import ExperimentSummary
    from manager.runner import Progress

err = Console(stderr=True, highlight=False)

# C0 and C1 control characters but newline and tab: escape sequences (colours, a window title, a cleared screen),
# a carriage return that overwrites a line
_CONTROLS = {code: f"\\x{code:02x}" for code in (*range(0x20), 0x7F, *range(0x80, 0xA0)) if chr(code) not in "\n\t"}


def print_error(message: str) -> None:
    err.print(Text.assemble(("trialstream: error: ", "bold red"), _data(message)), soft_wrap=True)


def note(message: str) -> None:
    """A line for the user on stderr, outside the results on stdout."""
    err.print(_data(message), soft_wrap=True)


def progress_table(progress: Progress) -> Table:
    table = Table(title=Text(f"experiment {progress.experiment_id}"), title_justify="left", show_edge=False)
    for column in (
        "waiting",
        "running",
        "succeeded",
        "failed",
        "stopped",
        f"best ({progress.optimize_mode})",
        "elapsed",
    ):
        table.add_column(column, justify="right")
    counts = progress.counts
    stopped = counts["USER_CANCELED"] + counts["SYS_CANCELED"] + counts["EARLY_STOPPED"]
    best = "-" if progress.best is None else f"{progress.best:.6g} ({progress.best_trial})"
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


def print_trials(trials: list[TrialJobDetail], title: str) -> None:
    table = Table(title=Text(title), title_justify="left")
    for column in ("id", "seq", "status", "platform", "final metric", "parameters", "message"):
        table.add_column(column)
    for trial in trials:
        score = metric_score(trial.final_metric)
        table.add_row(
            *_cells(
                trial.id,
                str(trial.sequence_id),
                str(trial.status),
                trial.platform,  # where its current attempt runs: in a hybrid experiment, one of the listed
                "" if score is None else f"{score:.6g}",
                json.dumps(trial.form.hyper_parameters.parameters),
                trial.message or "",
            )
        )
    Console().print(table)


def print_trial(trial: TrialJobDetail, metrics: list[MetricRecord]) -> None:
    console = Console()
    console.print_json(trial.to_json())  # highlighted JSON, never markup
    for metric in metrics:
        console.print(_data(f"{metric.type:<10} seq {metric.sequence:<4} {json.dumps(metric.value)}"))


def print_entries(lines: list[EntryLine], title: str | None, show_trial: bool) -> None:
    """The one rendering of log entries (events, a trial's history); without a title, rows that follow a table."""
    table = Table(
        title=None if title is None else Text(title),
        title_justify="left",
        box=None,
        pad_edge=False,
        show_header=title is not None,
    )
    columns = [("id", 15), ("time", 29), ("type", max(map(len, event_types())))]
    columns += [("trial", 5)] if show_trial else []
    columns += [("source", 14), ("attempt", 7), ("summary", 0)]
    for column, width in columns:
        table.add_column(column, min_width=width or None, overflow="fold")
    for line in lines:
        cells = [line.id, line.time, line.type, *([line.trial] if show_trial else []), line.source]
        cells += ["" if line.attempt is None else str(line.attempt), line.summary]
        table.add_row(*_cells(*cells), style="red" if line.summary.startswith("unreadable") else None)
    _print_rows(table)


def print_experiments(summaries: Sequence[ExperimentSummary]) -> None:
    table = Table(title=Text("experiments"), title_justify="left", box=None, pad_edge=False)
    for column in ("id", "status", "created", "ended", "trials", "directory"):
        table.add_column(column, overflow="fold")
    for summary in summaries:
        counts = ", ".join(f"{count} {status}" for status, count in sorted(summary.trial_counts.items()))
        table.add_row(
            *_cells(
                summary.id,
                f"{summary.status}, archived" if summary.archived else summary.status,
                _time(summary.created),
                _time(summary.ended),
                counts or "none",
                summary.directory,
            )
        )
    _print_rows(table)


def _print_rows(table: Table) -> None:
    console = Console()
    if console.is_terminal:
        console.print(table)
        return
    wide = Console(width=100_000)  # a pipe or a file: one line per row whatever its length, for grep
    with wide.capture() as captured:
        wide.print(table)
    print("\n".join(row.rstrip() for row in captured.get().splitlines()), flush=True)


def _cells(*values: str) -> Iterable[Text]:
    return (_data(value) for value in values)


def _data(value: str) -> Text:
    return Text(value.translate(_CONTROLS))


def _time(epoch_ms: int | None) -> str:
    if epoch_ms is None:
        return "-"
    return datetime.fromtimestamp(epoch_ms / 1000).astimezone().isoformat(timespec="seconds")
