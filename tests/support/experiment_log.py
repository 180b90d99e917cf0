"""A synthetic experiment log, entry by entry as the log stores them: for the timeline's scale benchmark and
tests that need a big log without running its trials. Each trial is submitted, started on one of `workers`
local workers, reports `metrics` intermediate results and a final one, and succeeds; every `lost_every`-th
trial's first attempt is lost mid-run and retried on the next worker."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

from core.event_store import encode_event
from schemas.events import (
    Event,
    ExperimentCreated,
    ExperimentFinished,
    TrialAttemptLost,
    TrialEnded,
    TrialLaunchSpec,
    TrialMetricReported,
    TrialStarted,
    TrialSubmitted,
)
from schemas.trial import HyperParameters, JobApplicationForm, MetricType, TrialJobStatus

START_MS = 1_790_000_000_000
CONFIG = {
    "trialCommand": "python3 trial.py",
    "trialCodeDirectory": ".",
    "trialConcurrency": 8,
    "searchSpace": {"lr": {"_type": "uniform", "_value": [0.0001, 0.1]}},
    "tuner": {"name": "Random", "classArgs": {"optimize_mode": "maximize"}},
    "trainingService": {"platform": "local"},
}


def synthetic_log(
    experiment_id: str, trials: int, metrics: int, workers: int = 8, lost_every: int = 50
) -> Iterator[tuple[str, dict[str, str]]]:
    """(entry id, fields) in log order: `workers` trials at a time, each `metrics` + 2 seconds of log time."""
    clock = _Clock()
    yield clock.entry(START_MS, ExperimentCreated(experiment_id=experiment_id, config=CONFIG, working_directory="/w"))
    for wave in range(0, trials, workers):
        begin = START_MS + 1000 + (wave // workers) * (metrics + 2) * 1000
        events: list[tuple[int, int, Event]] = []
        for index in range(wave, min(trials, wave + workers)):
            lost = bool(lost_every) and index % lost_every == lost_every - 1
            for offset, event in _trial(experiment_id, index, index % workers, workers, metrics, lost):
                events.append((begin + offset, len(events), event))
        events.sort(key=lambda item: item[:2])
        for ms, _, event in events:
            yield clock.entry(ms, event)
    yield clock.entry(clock.last + 1000, ExperimentFinished(experiment_id=experiment_id, status="DONE"))


def _trial(
    experiment_id: str, index: int, slot: int, workers: int, metrics: int, lost: bool
) -> Iterator[tuple[int, Event]]:
    """One trial's events, at milliseconds from its wave's start."""
    trial_id = f"t{index:05d}"
    parameters = json.dumps({"parameter_id": index, "parameter_source": "algorithm", "parameters": {"lr": 0.01}})
    form = JobApplicationForm(sequence_id=index, hyper_parameters=HyperParameters(value=parameters))
    launch = TrialLaunchSpec(command="python3 trial.py", code_directory="/w", platform_config={"platform": "local"})
    base: dict[str, Any] = {"experiment_id": experiment_id, "trial_id": trial_id}
    yield 0, TrialSubmitted(**base, platform="local", form=form, working_directory=f"/w/{trial_id}", launch=launch)
    attempt, worker = 1, slot
    if lost:  # its worker dies: lost mid-run, retried on the next worker
        yield 100, _started(base, 1, worker)
        yield 300, _metric(base, 1, 0, "PERIODICAL")
        reason = "worker lost"
        yield (
            500,
            TrialAttemptLost(**base, attempt=1, worker=f"w{worker}", reason=reason, status=TrialJobStatus.WAITING),
        )
        attempt, worker = 2, (slot + 1) % workers
    yield 600, _started(base, attempt, worker)
    for sequence in range(metrics):
        yield 700 + sequence * 1000, _metric(base, attempt, sequence, "PERIODICAL")
    yield 700 + metrics * 1000, _metric(base, attempt, metrics, "FINAL", index / 10_000)
    yield 800 + metrics * 1000, TrialEnded(**base, attempt=attempt, status=TrialJobStatus.SUCCEEDED, exit_code=0)


class _Clock:
    """Entry ids in increasing order: events of one millisecond told apart by their sequence."""

    def __init__(self) -> None:
        self.last = 0
        self._seq = 0

    def entry(self, ms: int, event: Event) -> tuple[str, dict[str, str]]:
        if ms <= self.last:
            self._seq += 1
        else:
            self.last, self._seq = ms, 0
        return f"{self.last}-{self._seq}", encode_event(event.model_copy(update={"time": self.last}))


def _started(base: dict[str, Any], attempt: int, worker: int) -> TrialStarted:
    return TrialStarted(**base, attempt=attempt, source=f"w{worker}", working_directory=f"/w/{base['trial_id']}")


def _metric(
    base: dict[str, Any], attempt: int, sequence: int, kind: MetricType, value: float = 0.5
) -> TrialMetricReported:
    return TrialMetricReported(
        **base, attempt=attempt, parameter_id="0", metric_type=kind, sequence=sequence, data=json.dumps(str(value))
    )
