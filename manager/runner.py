"""The experiment runner: NNI's manager loop, as a client of the TrainingService.

It asks the tuner for parameters, keeps `trialConcurrency` trials in flight, refills a slot the
moment the log says a trial ended, and stops at maxTrialNumber or maxExperimentDuration. It keeps
no state the log does not have: `resume` rebuilds it from the log after a crash.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
import time
import traceback
import uuid
from collections import Counter, deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis

from core.assignments import configured_platforms, experiment_secrets
from core.event_store import AppendFenced, LogEntry, StoredEvent, stream_position
from core.queueing import submission_key
from core.reaper import REAP_INTERVAL_S, reap_lost_attempts, unclaimed_attempts
from core.settings import Settings
from manager.archive.moves import archived, restore
from manager.config import ExperimentSpec, stored_experiment_spec
from manager.dispatcher import EarlyStop, NewTrial, NoMoreTrials, build_dispatcher, stop_nni_logging
from manager.experiments import create_experiment, finish_experiment, move_legacy_secrets
from manager.preflight import platform_problems
from manager.projection import apply_to_experiment, apply_to_trial, metric_record
from manager.runner_claim import RunnerClaim
from manager.training_service import TrainingService
from manager.transfer import end_imported_trials
from manager.tuner_thread import TunerThread
from schemas.events import (
    PLATFORM_CONFIG,
    TRIAL_CONFIG,
    CustomizedTrialNumbered,
    CustomizedTrialRefused,
    CustomizedTrialRequested,
    ExperimentChanges,
    ExperimentCreated,
    ExperimentFinished,
    ExperimentResumed,
    ExperimentStopRequested,
    ExperimentUpdated,
    TrialEvent,
    TrialMetricReported,
    TrialsRequested,
    TrialSubmitted,
    TunerDataImported,
    TunerNoMoreTrials,
)
from schemas.secrets import with_secrets
from schemas.trial import (
    ExperimentView,
    HyperParameters,
    JobApplicationForm,
    TrialConfig,
    TrialJobDetail,
    TrialJobStatus,
    metric_score,
)

_STOP_DEADLINE_S = 60.0
_WAIT_S = 0.5  # longest wait on the log: the runner re-checks its claim and deadline this often
_TUNER_POLL_S = 0.02  # while the tuner thinks, how soon what it says is picked up
_QUICK_TUNER_S = 0.05  # a request answered within this is submitted in the same round
_DRAIN_S = 10.0  # at the end, how long the tuner may take over the inputs still queued


class RunnerError(RuntimeError):
    pass


def _refuse_resume(experiment: ExperimentView, allow_imported: bool, changes: ExperimentChanges | None) -> None:
    if experiment.imported and not allow_imported:
        raise RunnerError(
            f"experiment {experiment.id} was imported and the run that wrote it is not here; "
            "resume it with --imported to cancel its unfinished trials and go on"
        )
    if experiment.status == "DONE" and changes is None:
        raise RunnerError(f"experiment {experiment.id} is done; there is nothing to resume")


class ClaimLost(RunnerError):
    """Another runner holds the experiment now: this one must touch nothing more (and can append nothing more:
    its appends are fenced by its claim's epoch)."""


class Detached(RunnerError):
    """The runner let go of a running experiment (its host is shutting down): the experiment stays
    RUNNING in the log and the next runner resumes it."""


@dataclass
class Progress:
    """What the terminal shows while an experiment runs."""

    experiment_id: str
    started_at: float
    counts: Counter[str] = field(default_factory=Counter)
    best: float | None = None
    best_trial: str | None = None  # the trial with `best`
    max_trials: int | None = None
    optimize_mode: str = "maximize"  # the tuner's: which way `best` is better

    @property
    def elapsed_s(self) -> float:
        return time.monotonic() - self.started_at


@dataclass
class _Customized:
    """A customized trial accepted and not yet submitted; its sequence id from the moment the runner read it."""

    request_id: str  # its CustomizedTrialRequested event
    parameters: dict[str, Any]
    sequence_id: int | None = None  # None only while a resume replays the log


@dataclass(frozen=True)
class ExperimentResult:
    experiment_id: str
    trials: list[TrialJobDetail]

    def to_json(self) -> str:
        return json.dumps(
            {
                "experimentId": self.experiment_id,
                "trials": [
                    {
                        "id": trial.id,
                        "status": str(trial.status),
                        "finalMetric": trial.final_metric,
                        "sequenceId": trial.sequence_id,
                        "hyperParameters": trial.form.hyper_parameters.parameters,
                    }
                    for trial in self.trials
                ],
            }
        )


def working_root(spec: ExperimentSpec, settings: Settings) -> Path:
    """experimentWorkingDirectory if the config gives one, else the experiments_dir setting."""
    return Path(spec.config.experiment_working_directory or settings.experiments_dir).expanduser().resolve()


def _refuse_if(problem: str | None) -> None:
    if problem:
        raise RunnerError(problem)


class ExperimentRunner:
    def __init__(
        self,
        spec: ExperimentSpec,
        client: redis.Redis,
        rq_connection: redis.Redis,
        experiment_dir: Path,
        experiment_id: str,
        on_progress: Callable[[Progress], None] = lambda progress: None,
        elapsed_s: float = 0.0,
        settings: Settings | None = None,
    ) -> None:
        self.settings = settings or Settings()
        self.spec = spec
        self.config = spec.config
        self.service = TrainingService(client, rq_connection, experiment_id)
        self.experiment_dir = experiment_dir
        self.on_progress = on_progress
        tuner, assessor = spec.algorithms(files_dir=experiment_dir)
        self.maximize = tuner.optimize_mode != "minimize"
        self.progress = Progress(
            experiment_id,
            time.monotonic() - elapsed_s,
            max_trials=self.config.max_trial_number,
            optimize_mode=tuner.optimize_mode,
        )
        self._client = client
        self._rq_connection = rq_connection
        self._tuner_algorithms = (tuner, assessor)
        self._tuner: TunerThread | None = None
        self._cursor = "0-0"  # every event up to here has been folded and given to the tuner
        # the experiment's view up to the cursor: what a submission needs of it, without reading it back from Redis
        self._experiment: ExperimentView | None = None
        self._unlogged_request: TrialsRequested | None = None  # asked of the tuner; logged with its first submission
        self._trials: dict[str, TrialJobDetail] = {}
        self._submissions: dict[str, TrialSubmitted] = {}  # of trials no worker has started yet: sent again if lost
        self._parameter_ids: dict[str, Any] = {}
        self._reported: set[str] = set()
        self._active: set[str] = set()
        self._ready: deque[NewTrial] = deque()  # parameter sets the tuner gave, not yet submitted
        self._no_more = False  # the tuner had nothing for the last request, and nothing ended since
        # what the log says of the tuner (TunerNoMoreTrials): nothing since an ExperimentResumed, so nothing at start
        self._logged_no_more = False
        self._asking = False  # a request is queued or running on the tuner's thread
        self._ends = 0  # trials seen ending: a "no more" from before the latest end is stale
        self._ends_at_request = 0
        self._next_sequence_id = 0  # the next number to give: trials submitted and customized ones numbered take theirs
        self._reaped_at = 0.0
        self._unclaimed: set[str] = set()
        self._name = f"runner:{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self._claim = RunnerClaim(client, experiment_id, self._name, self.settings.runner_lease_s)
        self._replaying = False
        self._stop_requested: str | None = None  # why, once a stop was asked for after this runner started
        self._customized: dict[str, _Customized] = {}  # by request id, in the order asked
        self._pending_stop: str | None = None  # a replayed stop request no ExperimentFinished answered
        self._detach = threading.Event()

    @classmethod
    def create(
        cls,
        spec: ExperimentSpec,
        client: redis.Redis,
        rq_connection: redis.Redis,
        experiment_id: str | None = None,
        on_progress: Callable[[Progress], None] = lambda progress: None,
        settings: Settings | None = None,
    ) -> ExperimentRunner:
        """A new experiment in the log, with its trial and platform config as cluster metadata."""
        settings = settings or Settings()
        _refuse_if(platform_problems(spec, settings))
        root = working_root(spec, settings)
        experiment_id = create_experiment(client, spec.as_event_config, root, experiment_id, spec.secrets)
        runner = cls(spec, client, rq_connection, root / experiment_id, experiment_id, on_progress, settings=settings)
        runner._take_claim(wait_s=0)
        with runner._setting_up():
            trial_config = TrialConfig(
                command=spec.config.trial_command,
                code_directory=str(spec.code_directory),
                gpu_number=spec.config.trial_gpu_number,
                max_trial_duration=spec.config.max_trial_duration,
                max_retries=spec.config.max_trial_retries,
            )
            runner.service.set_cluster_metadata(TRIAL_CONFIG, trial_config.to_json())
            platform_config = (
                json.dumps([platform.model_dump(mode="json", by_alias=True) for platform in spec.platforms])
                if spec.hybrid
                else spec.platform.model_dump_json(by_alias=True)
            )  # a hybrid experiment's is the list: each trial is placed on one of them when submitted
            runner.service.set_cluster_metadata(PLATFORM_CONFIG, platform_config)
            runner._start_tuner(replay=[])
        return runner

    @classmethod
    def resume(
        cls,
        client: redis.Redis,
        rq_connection: redis.Redis,
        experiment_id: str,
        on_progress: Callable[[Progress], None] = lambda progress: None,
        settings: Settings | None = None,
        allow_imported: bool = False,
        changes: ExperimentChanges | None = None,
    ) -> ExperimentRunner:
        """Take an experiment up again from its log: ended trials are not rerun, running ones are
        followed to their end, maxTrialNumber and maxExperimentDuration count what came before, and
        the tuner is rebuilt by replaying its inputs (see `_start_tuner`).

        An imported log's run is not here: only with `allow_imported` is it taken up, its unfinished
        trials first ended as SYS_CANCELED. A DONE experiment is taken up only with `changes` (NNI's
        update of a finished experiment: a larger budget, say), logged once the claim is taken and
        before the replay, so the runner starts under them. An archived experiment is restored first, unless the
        experiment view it keeps in Redis already says it would be refused."""
        if archived(client, experiment_id) is not None:
            with contextlib.suppress(LookupError):  # an archive made without views: restored, then checked
                kept = TrainingService(client, rq_connection, experiment_id).experiment_view()
                _refuse_resume(kept, allow_imported, changes)
        restore(client, experiment_id)
        service = TrainingService(client, rq_connection, experiment_id)
        experiment = service.experiment_view()
        _refuse_resume(experiment, allow_imported, changes)
        config = dict(experiment.config)
        service_config = config["trainingService"]
        move_legacy_secrets(client, experiment_id, service_config)
        secrets = experiment_secrets(client, experiment_id, configured_platforms(service_config))
        config["trainingService"] = with_secrets(service_config, secrets)
        spec = stored_experiment_spec(config, experiment.working_directory)
        _refuse_if(platform_problems(spec, settings or Settings()))
        elapsed_s = experiment.run_seconds(int(time.time() * 1000))  # what it ran before, as NNI counts it
        runner = cls(
            spec,
            client,
            rq_connection,
            Path(experiment.working_directory),
            experiment_id,
            on_progress,
            elapsed_s,
            settings,
        )
        runner._take_claim(wait_s=runner._claim.lease_s + 1)  # a crashed runner's claim lapses within its lease
        with runner._setting_up():
            if changes is not None:
                runner.service.store.append(ExperimentUpdated(experiment_id=experiment_id, changes=changes))
            if experiment.imported:
                end_imported_trials(runner.service)
            runner._start_tuner(replay=runner.service.store.read())
            runner.service.store.append(ExperimentResumed(experiment_id=experiment_id))
        return runner

    @property
    def experiment_id(self) -> str:
        return self.service.experiment_id

    def detach(self) -> None:
        """Let go of the experiment from another thread: `run` raises Detached within a round, and
        the trials go on; a later `resume` takes the experiment up again."""
        self._detach.set()

    def run(self) -> ExperimentResult:
        with self._stopping_when_fenced(self._stalled):
            return self._run()

    def _run(self) -> ExperimentResult:
        deadline = self.config.max_experiment_duration
        started = self.progress.started_at
        tuner = self._tuner
        assert tuner is not None, "create() or resume() starts the tuner"
        try:
            self._follow(self.service.store.read(self._cursor))  # the experiment's view, for the first submissions
            while True:
                if self._stop_requested is not None:  # before a detach: a stop asked for is never dropped
                    self._stop_all(self._stop_requested)
                    return self._finish("STOPPED", self._stop_requested)
                if self._detach.is_set():
                    raise Detached(f"the runner of experiment {self.experiment_id} let go of it")
                self._keep_claim()
                self._take_outputs()
                if tuner.error is not None:
                    return self._tuner_failed(tuner.error)
                deadline = self.config.max_experiment_duration  # an ExperimentUpdated may change it
                # Out of time, as NNI: no more trials of the tuner's; those running end as they would, then the
                # experiment is DONE. A customized trial numbered before then was promised: it still runs.
                out_of_time = self._out_of_time()
                if out_of_time:
                    self._submit_ready(tuner_trials=False)
                else:
                    self._refill()
                if not self._active and not self._customized and (out_of_time or self._search_over()):
                    if tuner.error is not None:  # it failed on the last trial's end
                        return self._tuner_failed(tuner.error)
                    if (result := self._finish_done()) is not None:
                        return result
                self.on_progress(self.progress)
                wait = _WAIT_S if tuner.idle else _TUNER_POLL_S
                if deadline is not None and not out_of_time:
                    wait = max(0.0, min(wait, deadline - (time.monotonic() - started)))
                self._follow(self.service.store.wait(self._cursor, block_ms=max(1, int(wait * 1000))))  # 0: forever
                self._reap([self._trials[trial_id] for trial_id in self._active])
        except (ClaimLost, Detached, AppendFenced):
            raise  # the trials and the experiment are the new runner's now, or the next one's
        except (redis.ConnectionError, redis.TimeoutError):
            raise  # Redis is away past the retries, or gone: nothing can be written; `resume` takes up the log
        except BaseException as error:
            self._stop_all("the experiment runner stopped")
            interrupted = isinstance(error, KeyboardInterrupt | SystemExit)
            self._finish_experiment("STOPPED", "runner interrupted" if interrupted else f"runner stopped: {error}")
            raise
        finally:
            tuner.close()
            stop_nni_logging(self.experiment_dir / "log" / "dispatcher.log")
            self._claim.release()

    def _out_of_time(self) -> bool:
        """Past maxExperimentDuration (which an ExperimentUpdated may change), counting what earlier runs ran."""
        deadline = self.config.max_experiment_duration
        return deadline is not None and self.progress.elapsed_s >= deadline

    def _take_claim(self, wait_s: float) -> None:
        """Become the experiment's only runner, or say who runs it. From then on every append of the runner (its
        service's, its experiment's end) is fenced by the claim's epoch."""
        if not self._claim.take(wait_s):
            holder = self._claim.holder()
            raise RunnerError(f"experiment {self.experiment_id} is being run by {holder}; stop that runner first")
        self.service.store.fence = self._claim.fence

    def _keep_claim(self) -> None:
        if not self._claim.keep():
            raise self._claim_lost(self._stalled)

    @property
    def _stalled(self) -> str:
        return f"it stalled past its {self._claim.lease_s:g} s lease"

    @contextmanager
    def _setting_up(self) -> Iterator[None]:
        """What `create` and `resume` do once the claim is taken, fenced as `run` is; if it fails, the tuner it
        started is closed and its dispatcher.log let go here, as no `run` will (a manager lives on after it)."""
        try:
            with self._stopping_when_fenced("another runner took it while this one was starting"):
                yield
        except BaseException:
            if self._tuner is not None:
                self._tuner.close()
            stop_nni_logging(self.experiment_dir / "log" / "dispatcher.log")
            raise

    @contextmanager
    def _stopping_when_fenced(self, how: str) -> Iterator[None]:
        """An append refused by its fence stops the runner as a lost claim does: another runner took the claim
        while this one stalled between keep() (which answers from memory between renewals) and the append, or
        while it was starting (`how` says which)."""
        try:
            yield
        except AppendFenced as refused:
            raise self._claim_lost(how) from refused

    def _claim_lost(self, how: str) -> ClaimLost:
        holder = self._claim.holder()
        now = f"{holder} runs it now" if holder else f"run `trialstream resume {self.experiment_id}` to go on"
        return ClaimLost(
            f"this runner of experiment {self.experiment_id} lost its claim ({how}) and stopped, submitting nothing"
            f" more; {now}"
        )

    def _start_tuner(self, replay: list[LogEntry]) -> None:
        """Build the tuner and give it the search space; on resume, replay its inputs from the log.

        Every event is given to the tuner in log order, and each logged request is made again at the
        position it was first made (after the events it had `seen`), so a deterministic tuner ends in
        the state the crashed runner's had. A parameter set it gives again is not run again; one the
        log has no trial for (the runner died before submitting it) is submitted now.
        """
        tuner, assessor = self._tuner_algorithms
        try:
            dispatcher = build_dispatcher(tuner, assessor, self.experiment_dir / "log" / "dispatcher.log")
        except Exception as error:  # a constructor that refuses its classArgs: the experiment ends here
            self._finish_experiment("ERROR", f"the tuner failed:\n{traceback.format_exc()}")
            self._claim.release()
            raise RunnerError(f"{tuner.label} could not be built: {error}") from None
        self._tuner = TunerThread(dispatcher)
        created = next(
            (
                entry.event
                for entry in replay
                if isinstance(entry, StoredEvent) and isinstance(entry.event, ExperimentCreated)
            ),
            None,
        )  # on resume: the space it was created with; a replayed ExperimentUpdated changes it where it did
        original = created.config.get("searchSpace") if created is not None else None
        self._tuner.call("initialize", original if original is not None else self.spec.search_space)
        requests = deque(
            entry.event
            for entry in replay
            if isinstance(entry, StoredEvent) and isinstance(entry.event, TrialsRequested)
        )
        self._replaying = True
        for entry in replay:
            while requests and stream_position(requests[0].seen) < stream_position(entry.id):
                self._tuner.call("request_trials", requests.popleft().count)
            self._follow([entry])
        self._replaying = False
        self._stop_requested = self._pending_stop
        self._number_customized()  # asked for while no runner read the log
        for request in requests:
            self._tuner.call("request_trials", request.count)
        if replay:
            while not self._tuner.wait(self._claim.renew_s):  # a long replay must not lose the claim
                self._keep_claim()
            ran = set(self._parameter_ids.values())
            for output in self._tuner.outputs():
                if isinstance(output, NewTrial) and output.parameter_id not in ran:
                    self._ready.append(output)  # asked for, never submitted: the runner died in between
                elif isinstance(output, EarlyStop) and output.trial_id in self._active:
                    self._early_stop(output)  # decided, never logged: the runner died in between

    def _follow(self, entries: list[LogEntry]) -> None:
        """Fold the log into the runner's trials and give the tuner what NNI's manager gives its
        dispatcher: each trial's final result when it arrives, intermediate results for the
        assessor, and each trial's end."""
        for entry in entries:
            self._cursor = entry.id
            if not isinstance(entry, StoredEvent):
                continue
            if not isinstance(entry.event, TrialEvent):
                self._experiment = apply_to_experiment(self._experiment, entry.event)
                self._experiment_command(entry.id, entry.event)
                continue
            event = entry.event
            trial_id = event.trial_id
            before = self._trials.get(trial_id)
            if isinstance(event, TrialMetricReported) and event.metric_type == "PERIODICAL":
                if before is not None and not before.status.is_terminal and event.attempt == before.attempt:
                    value = metric_record(event).value
                    parameter_id = self._parameter_ids[trial_id]
                    self._tuner_call(
                        "intermediate_result", trial_id, event.attempt, parameter_id, event.sequence, value
                    )
                continue
            after = apply_to_trial(before, event)
            if after is None or after is before:
                continue
            self._trials[trial_id] = after
            if after.status is not TrialJobStatus.WAITING:  # a worker read its submission: the log holds it
                self._submissions.pop(trial_id, None)
            if before is None:
                self._submitted(after)
                if isinstance(event, TrialSubmitted) and event.requested_by is not None:
                    self._customized.pop(event.requested_by, None)  # submitted by an earlier runner: not again
            if after.final_metric_data and trial_id not in self._reported:
                self._reported.add(trial_id)
                self._tuner_call("final_result", trial_id, self._parameter_ids[trial_id], after.final_metric)
            if before is not None and after.status is not before.status:
                self.progress.counts[str(before.status)] -= 1
                self.progress.counts[str(after.status)] += 1
                if after.status.is_terminal:
                    self._ended(after)

    def _experiment_command(self, entry_id: str, event: object) -> None:
        """What the user asked of the running experiment (through the API): new limits or search space,
        a customized trial, results for the tuner, a stop. A replayed stop counts only if no
        ExperimentFinished answered it (its runner died, or let go, first): then it is carried out as soon
        as the replay ends."""
        match event:
            case ExperimentUpdated(changes=changes):
                updates = changes.model_dump(exclude_none=True, exclude={"search_space"})
                self.config = self.config.model_copy(update=updates)
                self.progress.max_trials = self.config.max_trial_number
                if changes.search_space is not None:
                    self._tuner_call("initialize", changes.search_space)
                self._no_more = False  # a new space or budget may have more to offer
            case CustomizedTrialRequested(parameters=parameters):
                self._customized[entry_id] = _Customized(entry_id, parameters)
                if not self._replaying:
                    self._number_customized()
            case CustomizedTrialNumbered(request_id=request_id, sequence_id=sequence_id):
                if (waiting := self._customized.get(request_id)) is not None:
                    waiting.sequence_id = sequence_id
                self._next_sequence_id = max(self._next_sequence_id, sequence_id + 1)
            case CustomizedTrialRefused(request_id=request_id):
                self._customized.pop(request_id, None)
            case TunerDataImported(data=data):  # replayed to a resumed runner's new tuner: it has seen none of it
                self._tuner_call("import_data", [record.model_dump() for record in data])
            case ExperimentStopRequested(reason=reason) if self._replaying:
                self._pending_stop = reason or "stopped by the user"
            case ExperimentStopRequested(reason=reason):
                self._stop_requested = reason or "stopped by the user"
            case ExperimentFinished():
                self._pending_stop = None  # that stop was carried out

    def _number_customized(self) -> None:
        """Give each customized trial not numbered yet its sequence id now, as NNI's manager does when it accepts
        one (the API answers with it), or refuse it when maxTrialNumber is spoken for: the runner alone gives
        numbers, in log order, so two requests never take the same one, nor both the last place. Past
        maxExperimentDuration it refuses too: no trial starts then but those numbered before."""
        budget = self.config.max_trial_number
        for waiting in [waiting for waiting in self._customized.values() if waiting.sequence_id is None]:
            self._keep_claim()
            if self._stop_requested is not None:
                reason = f"experiment {self.experiment_id} is stopping"
            elif budget is not None and self._next_sequence_id >= budget:
                reason = f"experiment {self.experiment_id} has used its maxTrialNumber ({budget})"
            elif self._out_of_time():
                duration = self.config.max_experiment_duration
                reason = f"experiment {self.experiment_id} has run its maxExperimentDuration ({duration:g} s)"
            else:
                reason = None
            if reason is not None:
                del self._customized[waiting.request_id]
                refused = CustomizedTrialRefused(
                    experiment_id=self.experiment_id, request_id=waiting.request_id, reason=reason
                )
                self.service.store.append(refused)
                continue
            waiting.sequence_id = self._next_sequence_id
            self._next_sequence_id += 1
            numbered = CustomizedTrialNumbered(
                experiment_id=self.experiment_id, request_id=waiting.request_id, sequence_id=waiting.sequence_id
            )
            self.service.store.append(numbered)

    def _submitted(self, trial: TrialJobDetail) -> None:
        packed = json.loads(trial.form.hyper_parameters.value)  # parsed once: this runs for every trial
        packed = packed if isinstance(packed, dict) else {}
        self._parameter_ids[trial.id] = packed.get("parameter_id")
        if self._parameter_ids[trial.id] is not None:
            self._tuner_call("ran", self._parameter_ids[trial.id], packed.get("parameters", {}))
        self._next_sequence_id = max(self._next_sequence_id, trial.sequence_id + 1)
        self._active.add(trial.id)
        self.progress.counts[str(trial.status)] += 1

    def _ended(self, trial: TrialJobDetail) -> None:
        self._active.discard(trial.id)
        self._ends += 1
        self._no_more = False  # NNI asks again when a trial ends: PBT and Hyperband may have more now
        # a customized trial's end reaches the assessor; the dispatcher keeps it from the tuner
        self._tuner_call("trial_end", trial.id, self._parameter_ids[trial.id], str(trial.status))
        score = metric_score(trial.final_metric)
        if score is not None and (self.progress.best is None or (score > self.progress.best) == self.maximize):
            self.progress.best = score
            self.progress.best_trial = trial.id

    def _tuner_call(self, method: str, *args: Any) -> None:
        assert self._tuner is not None
        self._tuner.call(method, *args)

    def _take_outputs(self) -> None:
        """What the tuner said since: parameter sets to run, no more for now, trials to early-stop."""
        assert self._tuner is not None
        for output in self._tuner.outputs():
            match output:
                case NewTrial():
                    self._ready.append(output)
                    self._log_no_more(False)
                case NoMoreTrials():  # for the last request; stale if a trial ended since it was made
                    self._no_more = self._ends == self._ends_at_request
                    if self._no_more:
                        self._log_no_more(True)
                case EarlyStop() if output.trial_id in self._active:
                    self._early_stop(output)

    def _log_no_more(self, no_more: bool) -> None:
        """Log NNI's TUNER_NO_MORE_TRIAL as it changes, as NNI's manager sets it on NO_MORE_TRIAL_JOBS and
        sets RUNNING again on the next NEW_TRIAL_JOB; never again while it stands."""
        if no_more == self._logged_no_more:
            return
        self._keep_claim()
        self.service.store.append(TunerNoMoreTrials(experiment_id=self.experiment_id, no_more=no_more))
        self._logged_no_more = no_more

    def _early_stop(self, verdict: EarlyStop) -> None:
        self.service.request_stop(verdict.trial_id, TrialJobStatus.EARLY_STOPPED, verdict.reason)

    def _refill(self) -> None:
        """Submit ready parameter sets into free slots, and ask the tuner for one per slot still free,
        as NNI's manager does; never past maxTrialNumber. The request is logged with the position
        the tuner has seen, then asked on the tuner's thread: a slow tuner holds nothing up."""
        assert self._tuner is not None
        if self._asking and self._tuner.idle:  # the last request is answered: count its answer first
            self._asking = False
            self._take_outputs()
        self._submit_ready()
        budget = self.config.max_trial_number
        free = self.config.trial_concurrency - len(self._active) - len(self._ready) - len(self._customized)
        if budget is not None:  # the customized trials waiting have their numbers already
            free = min(free, budget - self._next_sequence_id - len(self._ready))
        if free <= 0 or self._no_more or self._asking:
            return
        self._keep_claim()
        self._unlogged_request = TrialsRequested(experiment_id=self.experiment_id, count=free, seen=self._cursor)
        self._tuner.call("request_trials", free)  # after the inputs up to `seen`, still queued or not
        self._asking = True
        self._ends_at_request = self._ends
        if self._tuner.wait(_QUICK_TUNER_S):  # most tuners answer at once: submit in this round
            self._asking = False
            self._take_outputs()
            self._submit_ready()
        self._log_request()

    def _submit_ready(self, tuner_trials: bool = True) -> None:
        """Customized trials first (the user is waiting for them; each has its number, within maxTrialNumber),
        then the tuner's (unless told not to: out of time), each numbered as it is submitted while maxTrialNumber
        allows."""
        budget = self.config.max_trial_number
        while len(self._active) < self.config.trial_concurrency:
            if self._customized:
                waiting = self._customized.pop(next(iter(self._customized)))
                assert waiting.sequence_id is not None, "numbered as it was read"
                new = NewTrial(None, waiting.parameters, source="customized")
                self._submit(new, waiting.sequence_id, requested_by=waiting.request_id)
            elif tuner_trials and self._ready and (budget is None or self._next_sequence_id < budget):
                self._submit(self._ready.popleft(), self._next_sequence_id)
            else:
                return

    def _search_over(self) -> bool:
        """No customized trial waits, and the budget is spent or the tuner, idle, has no more and nothing it
        gave is left to run."""
        assert self._tuner is not None
        if self._customized:
            return False
        budget = self.config.max_trial_number
        if budget is not None and self._next_sequence_id >= budget:
            return True
        if not (self._no_more and self._tuner.idle):
            return False
        self._take_outputs()  # what it said before it went idle
        return self._no_more and not self._ready

    def _log_request(self) -> None:
        """Log the tuner's request, unless a submission took it into its own transaction."""
        if self._unlogged_request is not None:
            self.service.store.append(self._unlogged_request)
            self._unlogged_request = None

    def _submit(self, new: NewTrial, sequence_id: int, requested_by: str | None = None) -> None:
        """Submit a trial, with the tuner's request not logged yet in the same transaction: a write less on the way
        from a freed slot to the next start. Replay places a request by the position it had `seen`, not by its own."""
        self._keep_claim()
        form = JobApplicationForm(sequence_id=sequence_id, hyper_parameters=HyperParameters(value=new.hyper_parameters))
        submission = self.service.submission(form, requested_by, self._experiment)
        request, self._unlogged_request = self._unlogged_request, None
        trial = self.service.submit(submission, preceded_by=request)
        self._submissions[trial.id] = submission
        self._trials[trial.id] = trial
        self._submitted(trial)

    def _reap(self, in_flight: list[TrialJobDetail]) -> None:
        """Declare trials of dead workers lost, even when no worker is left to do it, and queue
        again the jobs a worker took with it when it died before claiming them."""
        if time.monotonic() - self._reaped_at < REAP_INTERVAL_S:
            return
        self._reaped_at = time.monotonic()
        reap_lost_attempts(self._client, self._rq_connection, self._name, self.settings.trial_lease_s)
        unclaimed = unclaimed_attempts(self._client, in_flight)
        for trial in unclaimed:
            if trial.id not in self._unclaimed:
                continue
            # seen a second before too: its job is gone, or its whole submission (the write a deposed master
            # acknowledged, then lost: docs/reliability.md), which no requeue brings back
            submission = self._submissions.get(trial.id)
            if submission is not None and not self.service.store.has_key(submission_key(trial.id)):
                self.service.submit(submission)
            else:
                self.service.requeue(trial, "its job was lost with a worker that died before claiming it")
        self._unclaimed = {trial.id for trial in unclaimed}

    def _stop_all(self, reason: str) -> None:
        """SYS_CANCELED for every trial in flight, then wait (bounded) until they have ended."""
        for trial_id in self._active:
            self.service.request_stop(trial_id, TrialJobStatus.SYS_CANCELED, reason)
        give_up = time.monotonic() + _STOP_DEADLINE_S
        while self._active and time.monotonic() < give_up:
            self._follow(self.service.store.wait(self._cursor, block_ms=int(_WAIT_S * 1000)))
            self._reap(
                [self._trials[trial_id] for trial_id in self._active]
            )  # a dead worker's trial must not hold the stop up

    def _tuner_failed(self, error: str) -> ExperimentResult:
        """A tuner's exception ends the experiment cleanly: trials stopped, the traceback in the log."""
        self._stop_all("the tuner failed")
        return self._finish("ERROR", f"the tuner failed:\n{error}")

    def _finish_experiment(self, status: str, message: str | None = None, read_up_to: str | None = None) -> bool:
        """`finish_experiment`, fenced by the claim like every append of the runner."""
        return finish_experiment(
            self._client,
            self._rq_connection,
            self.experiment_id,
            self.spec.platform_names,
            status,
            message,
            read_up_to=read_up_to,
            fence=self.service.store.fence,
        )

    def _finish(self, status: str, message: str | None = None) -> ExperimentResult:
        self._drain()
        self._finish_experiment(status, message)
        return self._cleaned_up()

    def _finish_done(self) -> ExperimentResult | None:
        """DONE, unless the log grew past what this runner has read: an update or a customized trial the API
        accepted meanwhile may give it more to do, and must not be dropped. None then: the round reads it
        and decides again."""
        self._drain()
        if not self._finish_experiment("DONE", read_up_to=self._cursor):
            return None
        return self._cleaned_up()

    def _drain(self) -> None:
        if self._tuner is not None:
            self._tuner.wait(_DRAIN_S)  # the last trials' ends reach the tuner (and a custom tuner's log)
        self.on_progress(self.progress)

    def _cleaned_up(self) -> ExperimentResult:
        self.service.clean_up()
        return ExperimentResult(self.experiment_id, self.service.list_trial_jobs())
