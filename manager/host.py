"""The manager process's control plane: the projector, and the runners of the experiments it starts.

The API calls it; it never holds state the log lacks. The experiments it runs are listed in Redis
(`keys.MANAGER_HOSTED`), so a manager that restarts, after a crash or a `detach`, resumes those still
RUNNING from their logs. Stopping an experiment is an event (ExperimentStopRequested), which
whichever runner drives it acts on, in this process or in a `trialstream run` elsewhere.

Every command answers once the projected views show it (`_shown`), so any read of this manager after it,
the projected lists included, sees it. Each experiment it keeps open has a process of its own
(manager/experiment_process.py), whose pid NNI's tools stop it by.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Literal

import redis

from core import keys
from core.connections import same_server
from core.event_store import EventStore, StoredEvent
from core.settings import Settings
from manager.archive.moves import restore
from manager.archive.policy import start_policy
from manager.config import ExperimentSpec
from manager.experiment_process import ExperimentProcess
from manager.experiments import ExperimentNotFound, delete_experiment, finish_experiment, resolve_experiment
from manager.projector import Projector
from manager.runner import ClaimLost, Detached, ExperimentRunner, RunnerError
from manager.search_space import check_depth, check_parameter_names
from manager.training_service import TrainingService
from schemas.api import CustomizedTrialAnswer
from schemas.config import platform_names
from schemas.events import (
    CustomizedTrialNumbered,
    CustomizedTrialRefused,
    CustomizedTrialRequested,
    ExperimentChanges,
    ExperimentStopRequested,
    ExperimentUpdated,
    ImportedTrial,
    TunerDataImported,
)
from schemas.trial import TrialJobStatus

log = logging.getLogger(__name__)

SERVICES_KEPT = 256  # TrainingService objects cached (each memoizes parsed views)
CUSTOMIZED_WAIT_S = 5.0  # how long POST /trial-jobs waits for the runner to number the customized trial
RUNNER_END_WAIT_S = 30.0  # how long an update of a DONE experiment waits for the runner that finished it to end
OnExit = Literal["detach", "stop"]


class ExperimentNotRunning(RuntimeError):
    pass


@dataclass
class _Hosted:
    runner: ExperimentRunner
    thread: threading.Thread
    outcome: list[str] = field(default_factory=list)  # how run() ended, once it has


class ManagerHost:
    def __init__(self, client: redis.Redis, settings: Settings, project: bool = True) -> None:
        self.client = client
        self.rq_connection = same_server(client, decode=False)
        self.settings = settings
        self._project = project
        self._stop = threading.Event()
        self._projector = Projector(client)  # its thread projects; commands bring their own events in (`_shown`)
        self._projector_thread: threading.Thread | None = None
        self._hosted: dict[str, _Hosted] = {}
        self._processes: dict[str, ExperimentProcess] = {}  # the experiments kept open: hosted, or ended DONE/ERROR
        self._services: dict[str, TrainingService] = {}
        self._lock = threading.Lock()
        self._update_lock = threading.Lock()  # of two updates of a DONE experiment, the first takes it up again
        self.on_change: list[Any] = []  # callables(experiment_id) told when a hosted experiment starts or ends

    # life cycle

    def start(self) -> None:
        """Start projecting, then take up the experiments this manager ran before it stopped."""
        if self._project:
            self._projector_thread = threading.Thread(
                target=self._projector.run, args=(self._stop,), name="projector", daemon=True
            )
            self._projector_thread.start()
            start_policy(self.client, self.settings, self._stop)
        hosted: Any = self.client.smembers(keys.MANAGER_HOSTED)
        for experiment_id in sorted(str(member) for member in hosted):
            try:
                if self.service(experiment_id).experiment_view().status == "RUNNING":
                    self.resume(experiment_id)
                else:
                    self.client.srem(keys.MANAGER_HOSTED, experiment_id)
            except (RunnerError, LookupError) as error:
                log.warning("experiment %s not resumed: %s", experiment_id, error, extra={"experiment": experiment_id})

    def shutdown(self, on_exit: OnExit, wait_s: float = 60.0) -> None:
        """`detach`: let go of every experiment (they stay RUNNING and resume at the next start);
        `stop`: stop each as a user would, its trials SYS_CANCELED. Then end the experiments' processes
        and stop projecting."""
        with self._lock:
            hosted = dict(self._hosted)
        for experiment_id, entry in hosted.items():
            try:  # one experiment's error leaves every other one stopped or detached all the same
                if on_exit == "stop":
                    self.stop(experiment_id, "the manager was stopped")
                else:
                    entry.runner.detach()
            except (ExperimentNotRunning, LookupError) as error:  # it ended meanwhile: nothing left to stop
                log.info("experiment %s not stopped: %s", experiment_id, error, extra={"experiment": experiment_id})
            except Exception:
                log.exception(
                    "experiment %s: not %s",
                    experiment_id,
                    "stopped" if on_exit == "stop" else "detached",
                    extra={"experiment": experiment_id},
                )
        give_up = time.monotonic() + wait_s
        for entry in hosted.values():
            entry.thread.join(max(0.0, give_up - time.monotonic()))
        with self._lock:
            kept_open = list(self._processes)
        for experiment_id in kept_open:
            self._close_process(experiment_id)
        self._stop.set()
        if self._projector_thread is not None:
            self._projector_thread.join(5)

    # experiments

    def service(self, experiment_id: str) -> TrainingService:
        with self._lock:
            service = self._services.get(experiment_id)
            if service is None:
                if len(self._services) >= SERVICES_KEPT:
                    self._services.pop(next(iter(self._services)))
                service = self._services[experiment_id] = TrainingService(
                    self.client, self.rq_connection, experiment_id
                )
            return service

    def experiment_ids(self) -> list[str]:
        return [str(experiment_id) for experiment_id in self.client.zrange(keys.EXPERIMENTS, 0, -1)]

    def hosted(self) -> list[str]:
        with self._lock:
            return list(self._hosted)

    def process_id(self, experiment_id: str) -> int | None:
        """The pid NNI's tools know the experiment by (nnictl's registry, `/experiments-info`), while this
        manager keeps it open; None otherwise (not run here, or stopped)."""
        with self._lock:
            process = self._processes.get(experiment_id)
        return process.pid if process is not None else None

    def create(self, spec: ExperimentSpec) -> str:
        """Create the experiment (every check first: nothing is written when one fails) and run it."""
        runner = ExperimentRunner.create(spec, self.client, self.rq_connection, settings=self.settings)
        self._host(runner)
        return runner.experiment_id

    def resume(self, experiment_id: str, changes: ExperimentChanges | None = None) -> None:
        """Take the experiment up again from its log; `changes` (which a DONE one needs) are logged first."""
        experiment_id = resolve_experiment(self.client, experiment_id)
        with self._lock:
            if experiment_id in self._hosted:
                raise RunnerError(f"experiment {experiment_id} is already running in this manager")
        runner = ExperimentRunner.resume(
            self.client, self.rq_connection, experiment_id, settings=self.settings, changes=changes
        )
        self._host(runner)

    def stop(self, experiment_id: str, reason: str = "stopped by the user") -> None:
        """Ask the experiment's runner to stop it. With no runner (it crashed, or was detached and never
        resumed), the experiment is stopped here: its trials SYS_CANCELED, the experiment STOPPED."""
        view = self._running(experiment_id)
        EventStore(self.client, experiment_id).append(
            ExperimentStopRequested(experiment_id=experiment_id, reason=reason)
        )
        if self.client.exists(keys.runner(experiment_id)):
            self._shown(experiment_id)
            return
        service = self.service(experiment_id)
        for trial in service.list_trial_jobs():
            if not trial.status.is_terminal:
                service.request_stop(trial.id, TrialJobStatus.SYS_CANCELED, reason)
        platforms = platform_names(view.config.get("trainingService", {}))
        finish_experiment(self.client, self.rq_connection, experiment_id, platforms, "STOPPED", reason)
        self._shown(experiment_id)

    def end(self, experiment_id: str, reason: str = "stopped by the user") -> None:
        """NNI's `DELETE /experiment`, after which NNI's client waits for the experiment's pid to end: a
        running experiment is stopped, its process ending once it is STOPPED; one that has ended already
        (DONE, ERROR) is closed, its process ended now. Other experiments are not touched."""
        try:
            self.stop(experiment_id, reason)
        except ExperimentNotRunning:
            if self._close_process(experiment_id):
                self._changed(experiment_id)

    def update(self, experiment_id: str, changes: ExperimentChanges) -> None:
        """Change a running experiment. A DONE one is taken up again under the changes, as NNI's manager
        goes on when a finished experiment's limits are raised (and finishes again if they allow no more
        trials); a STOPPED or ERROR one is refused: resuming it is the user's call.

        An empty change set changes nothing and writes nothing, as an empty PATCH (RFC 7396, Kubernetes, so
        Katib) is a no-op: taking a DONE experiment up again for it would only move its endTime."""
        resolve_experiment(self.client, experiment_id)
        if changes.empty:
            return
        with self._update_lock:
            status = self.service(experiment_id).experiment_view().status
            if status == "DONE":
                self._runner_ended(experiment_id)
                self.resume(experiment_id, changes)
            elif status == "RUNNING":
                store = EventStore(self.client, experiment_id)
                store.append(ExperimentUpdated(experiment_id=experiment_id, changes=changes))
            else:
                raise ExperimentNotRunning(
                    f"experiment {experiment_id} is {status}, not running: resume it before changing it"
                )
        self._shown(experiment_id)

    def delete(self, experiment_id: str) -> int:
        """Delete a stopped or finished experiment from Redis (refused while a runner holds it), and end its
        process if this manager kept it open; how many keys went."""
        deleted = delete_experiment(self.client, experiment_id)
        self._close_process(experiment_id)
        return deleted

    def cancel_trial(self, experiment_id: str, trial_id: str, early_stopped: bool = False) -> None:
        """A user's cancel: USER_CANCELED (EARLY_STOPPED if `early_stopped`); a waiting trial has ended when
        this returns, a running one ends once its worker has stopped it."""
        self.service(experiment_id).cancel_trial_job(trial_id, is_early_stopped=early_stopped)
        self._shown(experiment_id)

    def add_customized_trial(self, experiment_id: str, parameters: dict[str, Any]) -> CustomizedTrialAnswer:
        """Queue a trial with these parameters; its sequence id, which the experiment's runner gives it as soon
        as it reads the request (CustomizedTrialNumbered), as NNI's manager answers at once, whether a slot is
        free or not, and the request's id in the log. Refused (ExperimentNotRunning) when the runner refuses it:
        maxTrialNumber spoken for, maxExperimentDuration passed, or the experiment stopping. The sequence id is
        None only if no runner read the request within CUSTOMIZED_WAIT_S (its runner died, say): the next runner
        (`resume`) numbers or refuses it, and the log has that answer after the request, under its id.
        Parameters nested past MAX_DEPTH are refused (NestedTooDeep): the event that holds them must read back."""
        check_depth(parameters, "parameters", "a trial's parameters")
        self._running(experiment_id)
        if not self.client.exists(keys.runner(experiment_id)):
            raise ExperimentNotRunning(f"experiment {experiment_id} has no runner: resume it first")
        store = EventStore(self.client, experiment_id)
        request = store.append(CustomizedTrialRequested(experiment_id=experiment_id, parameters=parameters))
        cursor, give_up = request, time.monotonic() + CUSTOMIZED_WAIT_S
        try:
            while (left := give_up - time.monotonic()) > 0:
                for entry in store.wait(cursor, block_ms=max(1, int(left * 1000))):
                    cursor = entry.id
                    match entry.event if isinstance(entry, StoredEvent) else None:
                        case CustomizedTrialNumbered(request_id=answered, sequence_id=sequence_id) if (
                            answered == request
                        ):
                            return CustomizedTrialAnswer(sequence_id=sequence_id, request_id=request)
                        case CustomizedTrialRefused(request_id=answered, reason=reason) if answered == request:
                            raise ExperimentNotRunning(reason)
            return CustomizedTrialAnswer(sequence_id=None, request_id=request)
        finally:
            self._shown(experiment_id)

    def import_data(self, experiment_id: str, data: list[ImportedTrial]) -> None:
        """NNI's import-data: results of trials run elsewhere, logged (TunerDataImported) for the experiment's
        runner to give its tuner, as NNI's manager sends IMPORT_DATA to its dispatcher. A DONE experiment takes
        them too, as NNI's does (its dispatcher outlives the end): the tuner of its next run (an update's) gets
        them in its replay; an archived one is brought back first. Each parameter set must name the search space's
        parameters (a ValueError saying where, else a tuner's exception on them would end the experiment ERROR),
        nested at most MAX_DEPTH levels (NestedTooDeep)."""
        resolve_experiment(self.client, experiment_id)
        view = self.service(experiment_id).experiment_view()
        if view.status not in ("RUNNING", "DONE"):
            raise ExperimentNotRunning(f"experiment {experiment_id} is {view.status}, not running")
        if view.status == "RUNNING" and not self.client.exists(keys.runner(experiment_id)):
            raise ExperimentNotRunning(f"experiment {experiment_id} has no runner: resume it first")
        for index, record in enumerate(data):
            check_depth(record.parameter, f"[{index}].parameter", "a trial's parameters")
            check_parameter_names(record.parameter, view.config.get("searchSpace"), f"[{index}].parameter")
        restore(self.client, experiment_id)
        EventStore(self.client, experiment_id).append(TunerDataImported(experiment_id=experiment_id, data=data))
        self._shown(experiment_id)

    def _running(self, experiment_id: str) -> Any:
        resolve_experiment(self.client, experiment_id)
        view = self.service(experiment_id).experiment_view()
        if view.status != "RUNNING":
            raise ExperimentNotRunning(f"experiment {experiment_id} is {view.status}, not running")
        return view

    def _shown(self, experiment_id: str) -> None:
        """Project the experiment's log up to its end before a command answers, so every read of this manager
        after it sees it: NNI's API serves the projected views (a read folding the log could show the experiment
        DONE while its lists still show trials running). Safe beside the projector thread: a batch commits
        under a WATCH of the position, so two never apply the same event."""
        self._projector.catch_up(experiment_id)

    def _runner_ended(self, experiment_id: str) -> None:
        """Wait for the runner thread of an experiment it has just finished to end (it lets go of its claim)."""
        with self._lock:
            hosted = self._hosted.get(experiment_id)
        if hosted is not None:
            hosted.thread.join(RUNNER_END_WAIT_S)

    def _host(self, runner: ExperimentRunner) -> None:
        experiment_id = runner.experiment_id
        self.client.sadd(keys.MANAGER_HOSTED, experiment_id)
        thread = threading.Thread(target=self._run, args=(runner,), name=f"runner-{experiment_id}", daemon=True)
        with self._lock:
            self._hosted[experiment_id] = _Hosted(runner, thread)
            process = self._processes.get(experiment_id)
        if process is None:  # one kept open (DONE, now taken up again) goes on with the same pid
            self._open_process(experiment_id)
        thread.start()
        self._changed(experiment_id)

    def _open_process(self, experiment_id: str) -> None:
        try:
            process = ExperimentProcess(experiment_id, self._process_ended)
        except OSError:  # it runs all the same; NNI's tools cannot find it by a pid
            log.exception("experiment %s: no process of its own", experiment_id, extra={"experiment": experiment_id})
            return
        with self._lock:
            self._processes[experiment_id] = process

    def _close_process(self, experiment_id: str) -> bool:
        """End the experiment's process (it stopped, or the manager lets go of it); whether there was one."""
        with self._lock:
            process = self._processes.pop(experiment_id, None)
        if process is None:
            return False
        process.release()
        return True

    def _process_ended(self, process: ExperimentProcess) -> None:
        """Someone ended the experiment's process (`nnictl stop`, NNI's client killing what it takes for the
        experiment's manager): that experiment stops, and only it."""
        experiment_id = process.experiment_id
        with self._lock:
            if self._processes.get(experiment_id) is not process:
                return
            del self._processes[experiment_id]
        log.info(
            "experiment %s: its process %d was ended; stopping it",
            experiment_id,
            process.pid,
            extra={"experiment": experiment_id},
        )
        try:
            self.stop(experiment_id, f"its process ({process.pid}) was ended, as nnictl stop does")
        except (ExperimentNotRunning, ExperimentNotFound):
            pass  # it had ended (or was deleted): closing it was all there was to do
        except Exception:
            log.exception("experiment %s: not stopped", experiment_id, extra={"experiment": experiment_id})
        self._changed(experiment_id)

    def _changed(self, experiment_id: str) -> None:
        for listener in self.on_change:  # side matters (nnictl's registry): theirs are not the experiment's errors
            try:
                listener(experiment_id)
            except Exception:
                log.exception("experiment %s: on_change failed", experiment_id, extra={"experiment": experiment_id})

    def _run(self, runner: ExperimentRunner) -> None:
        experiment_id = runner.experiment_id
        try:
            runner.run()
            self.client.srem(keys.MANAGER_HOSTED, experiment_id)  # ended: nothing to resume
        except Detached:
            log.info(
                "experiment %s detached; the next manager resumes it",
                experiment_id,
                extra={"experiment": experiment_id},
            )
        except ClaimLost as lost:
            log.warning("%s", lost, extra={"experiment": experiment_id})
            self.client.srem(keys.MANAGER_HOSTED, experiment_id)
        except Exception:
            log.exception("the runner of experiment %s failed", experiment_id, extra={"experiment": experiment_id})
        finally:
            with self._lock:
                self._hosted.pop(experiment_id, None)
            if not self._stays_open(experiment_id):
                self._close_process(experiment_id)
            self._changed(experiment_id)

    def _stays_open(self, experiment_id: str) -> bool:
        """Whether an experiment whose runner here has ended keeps its process: one that ended DONE or ERROR
        does, as NNI's manager stays up for it (its UI, nnictl's reads, an update taking it up again); one
        STOPPED, let go of (detach) or taken over by another runner does not."""
        try:
            return self.service(experiment_id).experiment_view().status in ("DONE", "ERROR")
        except Exception:
            log.exception("experiment %s: its status unread", experiment_id, extra={"experiment": experiment_id})
            return False


__all__ = ["ExperimentNotFound", "ExperimentNotRunning", "ManagerHost", "OnExit"]
