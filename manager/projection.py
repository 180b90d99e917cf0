"""Pure fold of events into views. No I/O: the projector and read-your-writes both use it.

The state machine lives here: an event that arrives out of order never moves a trial out of a
terminal status, and a metric is counted once however often it is delivered.
"""

from __future__ import annotations

from schemas.events import (
    ClusterMetadataSet,
    Event,
    ExperimentCreated,
    ExperimentFinished,
    ExperimentImported,
    ExperimentResumed,
    ExperimentUpdated,
    TrialAttemptLost,
    TrialCancelRequested,
    TrialDeferred,
    TrialEnded,
    TrialFormUpdated,
    TrialMetricReported,
    TrialReattached,
    TrialStarted,
    TrialSubmitted,
    TrialUnreachable,
    TunerNoMoreTrials,
)
from schemas.trial import ExperimentView, MetricRecord, TrialJobDetail, TrialJobStatus, can_transition


def metric_record(event: TrialMetricReported) -> MetricRecord:
    return MetricRecord(
        timestamp=event.time,
        trial_job_id=event.trial_id,
        parameter_id=event.parameter_id,
        type=event.metric_type,
        sequence=event.sequence,
        data=event.data,
        attempt=event.attempt,
    )


def apply_to_experiment(view: ExperimentView | None, event: Event) -> ExperimentView | None:
    match event:
        case ExperimentCreated():
            return ExperimentView(
                id=event.experiment_id,
                config=event.config,
                working_directory=event.working_directory,
                start_time=event.time,
                run_ms=0,
                running_since=event.time,
            )
        case ExperimentFinished() if view is not None:
            ran = _run_ms(view, event.time)
            changes = {"status": event.status, "end_time": event.time, "message": event.message}
            return view.model_copy(update={**changes, "run_ms": ran, "running_since": None})
        case ExperimentResumed() if view is not None:
            since = view.running_since if view.status == "RUNNING" else event.time  # a crashed runner's time counts
            changes = {
                "status": "RUNNING",
                "end_time": None,
                "message": None,
                "imported": False,
                "tuner_no_more_trials": None,
            }
            return view.model_copy(update={**changes, "running_since": since if view.run_ms is not None else None})
        case ExperimentImported() if view is not None:
            return view.model_copy(update={"imported": True})
        case ExperimentUpdated() if view is not None:
            changes = event.changes.model_dump(mode="json", by_alias=True, exclude_none=True)
            return view.model_copy(update={"config": {**view.config, **changes}})
        case TunerNoMoreTrials() if view is not None:
            return view.model_copy(update={"tuner_no_more_trials": event.no_more or None})
        case ClusterMetadataSet():
            base = view or ExperimentView(id=event.experiment_id)
            return base.model_copy(update={"metadata": {**base.metadata, event.key: event.value}})
    return view


def _run_ms(view: ExperimentView, now_ms: int) -> int | None:
    """The view's time RUNNING up to `now_ms`, its current run included; None for a view from before it was kept."""
    if view.run_ms is None:
        return None
    if view.status != "RUNNING" or view.running_since is None:
        return view.run_ms
    return view.run_ms + max(0, now_ms - view.running_since)


def apply_to_trial(view: TrialJobDetail | None, event: Event) -> TrialJobDetail | None:
    """The trial view after `event`; events for other trials must not be passed.

    Reports of an attempt other than the current one (a lost attempt whose worker was only
    stalled) never move the trial; their metrics are still listed, tagged with their attempt.
    Once a trial has ended its view never changes: a late final metric, form or attempt report
    arriving after the end (out of order, or from a worker that outlived its lease) is not the
    result the trial ended with; the metrics view lists it, marked late.
    """
    if isinstance(event, TrialMetricReported) and event.metric_type != "FINAL":
        return view  # intermediate metrics live in their own view: most events of a log, so checked first
    if isinstance(event, TrialSubmitted):
        if view is not None:
            return view
        return TrialJobDetail(
            id=event.trial_id,
            status=TrialJobStatus.WAITING,
            submit_time=event.time,
            working_directory=event.working_directory,
            form=event.form,
            sequence_id=event.form.sequence_id,
            experiment_id=event.experiment_id,
            platform=event.platform,
        )
    if view is None or view.status.is_terminal:
        return view
    if isinstance(event, TrialDeferred | TrialFormUpdated | TrialCancelRequested):
        return _trial_command(view, event)
    return _attempt_report(view, event)


def _trial_command(
    view: TrialJobDetail, event: TrialDeferred | TrialFormUpdated | TrialCancelRequested
) -> TrialJobDetail:
    """What is asked of the trial, whichever attempt runs."""
    status = view.status
    match event:
        case TrialDeferred() if status is TrialJobStatus.WAITING:
            return view.model_copy(update={"message": event.reason})
        case TrialFormUpdated():
            return view.model_copy(update={"form": event.form})
        case TrialCancelRequested() if status is TrialJobStatus.WAITING:
            return view.model_copy(
                update={
                    "status": event.status,
                    "end_time": event.time,
                    "is_early_stopped": event.status is TrialJobStatus.EARLY_STOPPED,
                    "message": event.reason or "canceled before it started",
                }
            )
        case TrialCancelRequested():
            return view.model_copy(update={"is_early_stopped": event.status is TrialJobStatus.EARLY_STOPPED})
    return view


def _attempt_report(view: TrialJobDetail, event: Event) -> TrialJobDetail:
    """What a worker reports of an attempt: only the current attempt's reports move the trial."""
    status = view.status
    match event:
        case TrialStarted() if event.attempt == view.attempt and can_transition(status, TrialJobStatus.RUNNING):
            return view.model_copy(
                update={
                    "status": TrialJobStatus.RUNNING,
                    "start_time": event.time,
                    "working_directory": event.working_directory,
                    "url": event.url,
                    "worker": event.source,
                    "message": None,
                }
            )
        case TrialReattached() if event.attempt == view.attempt:
            return view.model_copy(update={"worker": event.source})
        case TrialUnreachable(reason=None) if event.attempt == view.attempt and status is TrialJobStatus.UNKNOWN:
            return view.model_copy(update={"status": TrialJobStatus.RUNNING, "message": None})
        case TrialUnreachable() if (
            event.attempt == view.attempt and event.reason and can_transition(status, TrialJobStatus.UNKNOWN)
        ):  # WAITING too: a launch whose answer was lost with the host may have started the trial there
            return view.model_copy(update={"status": TrialJobStatus.UNKNOWN, "message": event.reason})
        case TrialMetricReported(metric_type="FINAL") if event.attempt == view.attempt:
            record = metric_record(event)
            if any(known.dedup_key == record.dedup_key for known in view.final_metric_data):
                return view
            return view.model_copy(update={"final_metric_data": [*view.final_metric_data, record]})
        case TrialAttemptLost() if event.attempt == view.attempt:
            return _attempt_lost(view, event)
        case TrialEnded() if event.attempt == view.attempt and can_transition(status, event.status):
            return view.model_copy(
                update={
                    "status": event.status,
                    "end_time": event.time,
                    "exit_code": event.exit_code,
                    "message": event.message,
                    "is_early_stopped": event.status is TrialJobStatus.EARLY_STOPPED,
                }
            )
    return view


def _attempt_lost(view: TrialJobDetail, event: TrialAttemptLost) -> TrialJobDetail:
    """Retried (WAITING, the next attempt) or ended, as the reaper decided."""
    if event.status is TrialJobStatus.WAITING:
        return view.model_copy(
            update={
                "status": TrialJobStatus.WAITING,
                "attempt": event.attempt + 1,
                "platform": event.retry_platform or view.platform,  # a hybrid retry may move
                "start_time": None,
                "worker": None,
                "final_metric_data": [],
                "message": f"attempt {event.attempt} lost ({event.reason}); retrying",
            }
        )
    return view.model_copy(
        update={
            "status": event.status,
            "end_time": event.time,
            "is_early_stopped": event.status is TrialJobStatus.EARLY_STOPPED,
            "message": f"lost: {event.reason}",
        }
    )
