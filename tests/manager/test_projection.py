"""The pure fold (manager.projection): every transition, late, duplicate and out-of-order events. No Redis."""

from __future__ import annotations

from collections.abc import Iterable

import pytest

from manager.projection import apply_to_experiment, apply_to_trial
from schemas.events import (
    ClusterMetadataSet,
    Event,
    ExperimentCreated,
    ExperimentFinished,
    ExperimentImported,
    ExperimentResumed,
    TrialAttemptLost,
    TrialCancelRequested,
    TrialDeferred,
    TrialEnded,
    TrialFormUpdated,
    TrialLaunchSpec,
    TrialMetricRejected,
    TrialMetricReported,
    TrialReattached,
    TrialRequeued,
    TrialStarted,
    TrialSubmitted,
    TrialUnreachable,
    TunerNoMoreTrials,
)
from schemas.trial import ExperimentView, TrialJobDetail, TrialJobStatus
from tests.conftest import form

S = TrialJobStatus
EXP, TRIAL = "exp1", "t1"
TERMINAL = [S.SUCCEEDED, S.FAILED, S.USER_CANCELED, S.SYS_CANCELED, S.EARLY_STOPPED]


def submitted() -> TrialSubmitted:
    return TrialSubmitted(
        experiment_id=EXP,
        trial_id=TRIAL,
        time=100,
        platform="local",
        form=form(0),
        working_directory="/w/t1",
        launch=TrialLaunchSpec(command="true", code_directory="/c", platform_config={"platform": "local"}),
    )


def started(attempt: int = 1, time: int = 200) -> TrialStarted:
    return TrialStarted(
        experiment_id=EXP, trial_id=TRIAL, attempt=attempt, time=time, working_directory="/run", source="w1"
    )


def final(value: float, attempt: int = 1, sequence: int = 0) -> TrialMetricReported:
    return TrialMetricReported(
        experiment_id=EXP,
        trial_id=TRIAL,
        attempt=attempt,
        parameter_id="0",
        metric_type="FINAL",
        sequence=sequence,
        data=f'"{value}"',
    )


def periodical(sequence: int) -> TrialMetricReported:
    return final(0.1, sequence=sequence).model_copy(update={"metric_type": "PERIODICAL"})


def ended(status: TrialJobStatus, attempt: int = 1) -> TrialEnded:
    return TrialEnded(experiment_id=EXP, trial_id=TRIAL, attempt=attempt, status=status, exit_code=0, time=300)


def lost(status: TrialJobStatus, attempt: int = 1) -> TrialAttemptLost:
    return TrialAttemptLost(experiment_id=EXP, trial_id=TRIAL, attempt=attempt, reason="lease expired", status=status)


def cancel(status: TrialJobStatus = S.USER_CANCELED) -> TrialCancelRequested:
    return TrialCancelRequested(experiment_id=EXP, trial_id=TRIAL, status=status, time=250)  # type: ignore[arg-type]


def form_update() -> TrialFormUpdated:
    return TrialFormUpdated(experiment_id=EXP, trial_id=TRIAL, form=form(7))


def fold(events: Iterable[Event], view: TrialJobDetail | None = None) -> TrialJobDetail:
    for event in events:
        view = apply_to_trial(view, event)
    assert view is not None
    return view


def waiting() -> TrialJobDetail:
    return fold([submitted()])


def running() -> TrialJobDetail:
    return fold([submitted(), started()])


def in_status(status: TrialJobStatus) -> TrialJobDetail:
    if status is S.WAITING:
        return waiting()
    if status is S.RUNNING:
        return running()
    return fold([ended(status)], running())


# submitted, deferred, started


def test_a_submission_makes_a_waiting_view_and_a_repeat_changes_nothing() -> None:
    view = waiting()
    assert (view.status, view.submit_time, view.sequence_id, view.attempt) == (S.WAITING, 100, 0, 1)
    assert apply_to_trial(view, submitted()) is view


def test_events_before_the_submission_make_no_view() -> None:
    assert apply_to_trial(None, started()) is None
    assert apply_to_trial(None, final(1.0)) is None


def test_a_deferral_says_why_while_waiting_only() -> None:
    deferred = TrialDeferred(experiment_id=EXP, trial_id=TRIAL, reason="GPUs busy")
    assert apply_to_trial(waiting(), deferred).message == "GPUs busy"  # type: ignore[union-attr]
    assert apply_to_trial(running(), deferred) == running()


def test_a_start_runs_the_trial() -> None:
    view = running()
    assert (view.status, view.start_time, view.worker, view.working_directory) == (S.RUNNING, 200, "w1", "/run")


def test_a_start_of_another_attempt_changes_nothing() -> None:
    view = waiting()
    assert apply_to_trial(view, started(attempt=2)) is view


@pytest.mark.parametrize("status", TERMINAL)
def test_a_start_after_the_end_changes_nothing(status: TrialJobStatus) -> None:
    view = in_status(status)
    assert apply_to_trial(view, started(time=999)) is view


def test_a_duplicate_start_keeps_the_first_start() -> None:
    view = running()
    assert apply_to_trial(view, started(time=999)) is view


def test_a_reattachment_moves_the_worker_of_the_current_attempt_only() -> None:
    reattached = TrialReattached(experiment_id=EXP, trial_id=TRIAL, attempt=1, source="w2")
    assert apply_to_trial(running(), reattached).worker == "w2"  # type: ignore[union-attr]
    other = reattached.model_copy(update={"attempt": 2})
    assert apply_to_trial(running(), other) == running()
    done = in_status(S.SUCCEEDED)
    assert apply_to_trial(done, reattached) is done


# metrics


def unreachable(reason: str | None, attempt: int = 1) -> TrialUnreachable:
    return TrialUnreachable(experiment_id=EXP, trial_id=TRIAL, attempt=attempt, reason=reason)


@pytest.mark.parametrize("before", [S.RUNNING, S.WAITING])  # WAITING: a launch whose answer was lost
def test_an_unreachable_attempt_is_unknown_until_reached_again_or_started(before: TrialJobStatus) -> None:
    view = fold([unreachable("host down")], in_status(before))
    assert (view.status, view.message) == (S.UNKNOWN, "host down")
    if before is S.WAITING:
        view = fold([started()], view)  # launched again once reached: it ran, or runs now
        assert (view.status, view.start_time) == (S.RUNNING, 200)
    assert fold([unreachable(None)], view).status is S.RUNNING
    assert apply_to_trial(in_status(before), unreachable("host down", attempt=2)) == in_status(before)


@pytest.mark.parametrize("status", TERMINAL)
def test_an_ended_trial_is_never_unknown(status: TrialJobStatus) -> None:
    view = in_status(status)
    assert apply_to_trial(view, unreachable("host down")) is view


def test_a_final_metric_is_kept_once_however_often_delivered() -> None:
    view = fold([final(0.5), final(0.5)], running())
    assert [record.value for record in view.final_metric_data] == [0.5]
    assert view.final_metric == 0.5


def test_intermediate_metrics_and_rejections_leave_the_view_alone() -> None:
    view = running()
    assert apply_to_trial(view, periodical(1)) is view
    rejected = TrialMetricRejected(experiment_id=EXP, trial_id=TRIAL, reason="not JSON")
    assert apply_to_trial(view, rejected) is view


def test_a_final_metric_of_another_attempt_is_not_the_trials() -> None:
    view = running()
    assert apply_to_trial(view, final(0.5, attempt=2)) is view


@pytest.mark.parametrize("status", TERMINAL)
def test_a_late_final_metric_does_not_change_an_ended_trial(status: TrialJobStatus) -> None:
    view = in_status(status)
    assert apply_to_trial(view, final(0.9)) is view


def test_a_final_metric_before_the_end_stays_after_it() -> None:
    view = fold([final(0.5), ended(S.SUCCEEDED)], running())
    assert (view.status, view.final_metric) == (S.SUCCEEDED, 0.5)


# A13: once ended, nothing changes the view


def test_late_events_after_a_lost_attempt_change_nothing() -> None:
    """submitted -> started -> attempt lost (FAILED) -> FINAL 0.9 -> form update: still FAILED, no metric."""
    failed = fold([submitted(), started(), lost(S.FAILED)])
    after = fold([final(0.9), form_update()], failed)
    assert after == failed
    assert (after.status, after.final_metric, after.sequence_id, after.form) == (S.FAILED, None, 0, form(0))


@pytest.mark.parametrize("status", TERMINAL)
@pytest.mark.parametrize(
    "late",
    [
        final(0.9),
        form_update(),
        started(),
        ended(S.FAILED),
        lost(S.WAITING),
        lost(S.FAILED),
        cancel(),
        TrialDeferred(experiment_id=EXP, trial_id=TRIAL, reason="busy"),
        TrialReattached(experiment_id=EXP, trial_id=TRIAL, attempt=1),
        TrialRequeued(experiment_id=EXP, trial_id=TRIAL, attempt=1, reason="lost job"),
    ],
    ids=lambda event: getattr(event, "type", None),
)
def test_an_ended_trial_is_sticky(status: TrialJobStatus, late: Event) -> None:
    view = in_status(status)
    assert apply_to_trial(view, late) is view


# forms


@pytest.mark.parametrize("status", [S.WAITING, S.RUNNING])
def test_a_form_update_replaces_the_form_of_an_unfinished_trial(status: TrialJobStatus) -> None:
    view = apply_to_trial(in_status(status), form_update())
    assert view is not None and view.form == form(7) and view.status is status


# cancels


def test_a_cancel_before_the_start_ends_the_trial() -> None:
    view = fold([cancel()], waiting())
    assert (view.status, view.end_time, view.message) == (S.USER_CANCELED, 250, "canceled before it started")


def test_an_early_stop_before_the_start_is_marked_early_stopped() -> None:
    view = fold([cancel(S.EARLY_STOPPED)], waiting())
    assert view.status is S.EARLY_STOPPED and view.is_early_stopped


def test_a_cancel_of_a_running_trial_waits_for_its_end() -> None:
    view = fold([cancel(S.EARLY_STOPPED)], running())
    assert view.status is S.RUNNING and view.is_early_stopped
    view = fold([ended(S.EARLY_STOPPED)], view)
    assert view.status is S.EARLY_STOPPED and view.end_time == 300


def test_a_start_after_a_cancel_before_the_start_changes_nothing() -> None:
    """Out of order: the worker started the trial as the cancel landed; the cancel's end holds."""
    canceled = fold([cancel()], waiting())
    assert fold([started(), final(0.3), ended(S.SUCCEEDED)], canceled) == canceled


# lost attempts and retries


def test_a_lost_attempt_with_retries_left_waits_again_as_the_next_attempt() -> None:
    view = fold([final(0.5), lost(S.WAITING)], running())
    assert (view.status, view.attempt, view.start_time, view.worker) == (S.WAITING, 2, None, None)
    assert view.final_metric_data == [] and view.message == "attempt 1 lost (lease expired); retrying"


def test_reports_of_the_lost_attempt_never_move_the_retried_trial() -> None:
    retried = fold([lost(S.WAITING)], running())
    assert fold([started(attempt=1), final(0.9, attempt=1), ended(S.SUCCEEDED, attempt=1)], retried) == retried
    view = fold([started(attempt=2), final(0.7, attempt=2), ended(S.SUCCEEDED, attempt=2)], retried)
    assert (view.status, view.attempt, view.final_metric) == (S.SUCCEEDED, 2, 0.7)


def test_a_lost_attempt_without_retries_ends_the_trial() -> None:
    view = fold([lost(S.FAILED)], running())
    assert (view.status, view.message) == (S.FAILED, "lost: lease expired")


def test_a_lost_report_of_another_attempt_changes_nothing() -> None:
    view = running()
    assert apply_to_trial(view, lost(S.FAILED, attempt=2)) is view


# ends


@pytest.mark.parametrize("status", TERMINAL)
@pytest.mark.parametrize("start", [S.WAITING, S.RUNNING])
def test_an_end_ends_an_unfinished_trial(start: TrialJobStatus, status: TrialJobStatus) -> None:
    view = fold([ended(status)], in_status(start))
    assert (view.status, view.end_time, view.exit_code) == (status, 300, 0)
    assert view.is_early_stopped is (status is S.EARLY_STOPPED)


def test_an_end_of_another_attempt_changes_nothing() -> None:
    view = running()
    assert apply_to_trial(view, ended(S.SUCCEEDED, attempt=2)) is view


# requeues: bookkeeping of the dispatch path only


@pytest.mark.parametrize("status", [S.WAITING, S.RUNNING, *TERMINAL])
def test_a_requeue_changes_nothing_in_the_view(status: TrialJobStatus) -> None:
    view = in_status(status)
    requeued = TrialRequeued(experiment_id=EXP, trial_id=TRIAL, attempt=view.attempt, reason="delivery lost")
    assert apply_to_trial(view, requeued) is view


# the experiment


def created() -> ExperimentCreated:
    return ExperimentCreated(experiment_id=EXP, config={"a": 1}, working_directory="/w", time=10)


def folded(events: Iterable[Event], view: ExperimentView | None = None) -> ExperimentView:
    for event in events:
        view = apply_to_experiment(view, event)
    assert view is not None
    return view


def test_a_created_experiment_runs() -> None:
    view = folded([created()])
    assert (view.status, view.config, view.working_directory, view.start_time) == ("RUNNING", {"a": 1}, "/w", 10)
    assert not view.imported


@pytest.mark.parametrize("status", ["DONE", "ERROR", "STOPPED"])
def test_a_finished_experiment_then_resumed_runs_again(status: str) -> None:
    finished = ExperimentFinished(experiment_id=EXP, status=status, message="why", time=20)  # type: ignore[arg-type]
    view = folded([created(), finished])
    assert (view.status, view.end_time, view.message) == (status, 20, "why")
    view = folded([ExperimentResumed(experiment_id=EXP)], view)
    assert (view.status, view.end_time, view.message) == ("RUNNING", None, None)


def test_the_last_finish_holds() -> None:
    done = ExperimentFinished(experiment_id=EXP, status="DONE", time=20)
    stopped = ExperimentFinished(experiment_id=EXP, status="STOPPED", time=30)
    assert folded([created(), done, ExperimentResumed(experiment_id=EXP), stopped]).status == "STOPPED"


def test_the_time_run_leaves_out_the_rests_between_runs_as_nni_s_exec_duration() -> None:
    """An update or a resume takes a DONE or STOPPED experiment up again: the time it rested is not run time
    (it would count against maxExperimentDuration at once); a runner that crashed while RUNNING is, as before."""
    done = ExperimentFinished(experiment_id=EXP, status="DONE", time=5_010)  # ran 5 s from its creation at 10
    view = folded([created(), done])
    assert view.run_seconds(now_ms=999_000) == 5
    view = folded([ExperimentResumed(experiment_id=EXP, time=100_000)], view)  # taken up after 95 s at rest
    assert view.run_seconds(now_ms=102_000) == 7
    crashed_and_resumed = folded([ExperimentResumed(experiment_id=EXP, time=110_000)], view)
    assert crashed_and_resumed.run_seconds(now_ms=111_000) == 16  # the runner's downtime while RUNNING counts
    stopped = folded([ExperimentFinished(experiment_id=EXP, status="STOPPED", time=112_000)], crashed_and_resumed)
    assert stopped.run_seconds(now_ms=500_000) == 17


def test_a_view_from_before_the_time_run_was_kept_counts_from_its_start() -> None:
    old = ExperimentView(id=EXP, status="DONE", start_time=10, end_time=5_010)
    assert old.run_seconds(now_ms=999_000) == 5
    resumed = folded([ExperimentResumed(experiment_id=EXP, time=100_000)], old)
    assert resumed.run_seconds(now_ms=101_010) == 101  # as it was counted: since the start


def test_an_import_marks_the_experiment_until_a_runner_takes_it_up() -> None:
    view = folded([created(), ExperimentImported(experiment_id=EXP)])
    assert view.imported
    assert not folded([ExperimentResumed(experiment_id=EXP)], view).imported


def test_the_tuner_s_no_more_stands_until_it_gives_trials_again_or_a_new_run_starts() -> None:
    view = folded([created(), TunerNoMoreTrials(experiment_id=EXP, no_more=True)])
    assert view.tuner_no_more_trials
    again = folded([TunerNoMoreTrials(experiment_id=EXP, no_more=False)], view)
    assert again.tuner_no_more_trials is None
    assert again.to_json() == folded([created()]).to_json()  # stored as a view folded before the event existed
    assert folded([ExperimentResumed(experiment_id=EXP)], view).tuner_no_more_trials is None


def test_events_before_the_creation_make_no_view_except_metadata() -> None:
    assert apply_to_experiment(None, ExperimentFinished(experiment_id=EXP, status="DONE")) is None
    assert apply_to_experiment(None, ExperimentResumed(experiment_id=EXP)) is None
    assert apply_to_experiment(None, ExperimentImported(experiment_id=EXP)) is None
    early = apply_to_experiment(None, ClusterMetadataSet(experiment_id=EXP, key="k", value="v"))
    assert early is not None and early.metadata == {"k": "v"}


def test_metadata_accumulates_and_the_last_value_holds() -> None:
    view = folded(
        [
            created(),
            ClusterMetadataSet(experiment_id=EXP, key="a", value="1"),
            ClusterMetadataSet(experiment_id=EXP, key="b", value="2"),
            ClusterMetadataSet(experiment_id=EXP, key="a", value="3"),
        ]
    )
    assert view.metadata == {"a": "3", "b": "2"}


def test_trial_events_leave_the_experiment_alone() -> None:
    view = folded([created()])
    assert apply_to_experiment(view, submitted()) is view
