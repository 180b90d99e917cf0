"""The experiment runner: NNI's manager loop, as a client of the TrainingService.

It asks the tuner for parameters, keeps `trialConcurrency` trials in flight, refills a slot the
moment the log says a trial ended, and stops at maxTrialNumber or maxExperimentDuration. It keeps
no state the log does not have: `resume` rebuilds it from the log after a crash.
"""

from __future__ import annotations

import json
import os
import socket
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis
from rq import Queue, Worker

from core import keys
from core.dispatch import queue_name
from core.event_store import EventStore
from core.reaper import REAP_INTERVAL_S, reap_lost_attempts, unclaimed_attempts
from core.settings import Settings
from manager.config import ExperimentSpec, stored_experiment_spec
from manager.experiments import create_experiment, finish_experiment
from manager.training_service import PLATFORM_CONFIG, TRIAL_CONFIG, TrainingService
from manager.transfer import end_imported_trials
from manager.tuners import create_tuner
from schemas.events import ExperimentResumed
from schemas.trial import (
    HyperParameters,
    JobApplicationForm,
    TrialConfig,
    TrialJobDetail,
    TrialJobStatus,
    metric_score,
)

_STOP_DEADLINE_S = 60.0
RUNNER_LEASE_S = 5.0
RUNNER_RENEW_S = 1.0


class RunnerError(RuntimeError):
    pass


class ClaimLost(RunnerError):
    """Another runner holds the experiment now: this one must touch nothing more."""


# The claim is fenced by an epoch counted up by every runner that takes it. KEYS: claim, epoch.
_CLAIM = """
if not redis.call('set', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then return 0 end
return redis.call('incr', KEYS[2])
"""
# Compare-and-set renewal: a runner that stalled past its lease must not renew the claim a `resume`
# took meanwhile. A claim that merely lapsed (Redis was paused or restarted, nobody took it since:
# the epoch is still this runner's) is taken back. KEYS: claim, epoch. ARGV: name, lease ms, epoch.
_RENEW_IF_MINE = """
local holder = redis.call('get', KEYS[1])
if holder == ARGV[1] then return redis.call('pexpire', KEYS[1], ARGV[2]) end
if not holder and redis.call('get', KEYS[2]) == ARGV[3] then
  redis.call('set', KEYS[1], ARGV[1], 'PX', ARGV[2])
  return 1
end
return 0
"""
_RELEASE_IF_MINE = """
if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) end
return 0
"""


@dataclass
class Progress:
    """What the terminal shows while an experiment runs."""

    experiment_id: str
    started_at: float
    counts: Counter[str] = field(default_factory=Counter)
    best: float | None = None
    max_trials: int | None = None

    @property
    def elapsed_s(self) -> float:
        return time.monotonic() - self.started_at


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


def experiments_root(spec: ExperimentSpec, settings: Settings) -> Path:
    """experimentWorkingDirectory if the config gives one, else the experiments_dir setting."""
    return Path(spec.config.experiment_working_directory or settings.experiments_dir).expanduser().resolve()


def check_served(client: redis.Redis, rq_connection: redis.Redis, platform: str, url_hint: str) -> None:
    """Fail clearly, rather than hang, when nothing would ever run or project the trials."""
    queue = Queue(queue_name(platform), connection=rq_connection)
    if not Worker.all(queue=queue):
        raise RunnerError(
            f"no worker serves queue {queue.name!r} on {url_hint}: start one with "
            f"`trialstream worker --platform {platform}`"
        )
    if not client.exists(keys.PROJECTOR_HEARTBEAT):
        raise RunnerError(f"no projector serves {url_hint}: start one with `trialstream projector`")


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
        self.tuner = create_tuner(self.config.tuner.name or "", self.config.tuner.class_args, spec.search_space)
        self.maximize = (self.config.tuner.class_args or {}).get("optimize_mode", "maximize") != "minimize"
        self.progress = Progress(experiment_id, time.monotonic() - elapsed_s, max_trials=self.config.max_trial_number)
        self._client = client
        self._rq_connection = rq_connection
        self._next_sequence_id = 0
        self._active: dict[str, TrialJobStatus] = {}
        self._parameters: dict[str, tuple[int, dict[str, Any]]] = {}
        self._reaped_at = 0.0
        self._claimed_at = 0.0
        self._unclaimed: set[str] = set()
        self._name = f"runner:{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self._renew_if_mine = client.register_script(_RENEW_IF_MINE)
        self._release_if_mine = client.register_script(_RELEASE_IF_MINE)
        self._take_claim = client.register_script(_CLAIM)
        self._epoch = 0

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
        root = experiments_root(spec, settings)
        experiment_id = create_experiment(client, spec.as_event_config, root, experiment_id)
        runner = cls(spec, client, rq_connection, root / experiment_id, experiment_id, on_progress, settings=settings)
        runner._claim(wait_s=0)
        trial_config = TrialConfig(
            command=spec.config.trial_command,
            code_directory=str(spec.code_directory),
            gpu_number=spec.config.trial_gpu_number,
            max_trial_duration=spec.config.max_trial_duration,
            max_retries=spec.config.max_trial_retries,
        )
        runner.service.set_cluster_metadata(TRIAL_CONFIG, trial_config.to_json())
        runner.service.set_cluster_metadata(PLATFORM_CONFIG, spec.platform.model_dump_json(by_alias=True))
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
    ) -> ExperimentRunner:
        """Take an experiment up again from its log: ended trials are not rerun, running ones are
        followed to their end, and maxTrialNumber and maxExperimentDuration count what came before.

        An imported log's run is not here: only with `allow_imported` is it taken up, its unfinished
        trials first ended as SYS_CANCELED."""
        service = TrainingService(client, rq_connection, experiment_id)
        experiment = service.experiment_view()
        if experiment.imported and not allow_imported:
            raise RunnerError(
                f"experiment {experiment_id} was imported and the run that wrote it is not here; "
                "resume it with --imported to cancel its unfinished trials and go on"
            )
        if experiment.status == "DONE":
            raise RunnerError(f"experiment {experiment_id} is done; there is nothing to resume")
        spec = stored_experiment_spec(experiment.config, experiment.working_directory)
        elapsed_s = max(0.0, time.time() - (experiment.start_time or 0) / 1000)
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
        runner._claim(wait_s=RUNNER_LEASE_S + 1)  # a crashed runner's claim lapses within its lease
        if experiment.imported:
            end_imported_trials(service)
        runner._replay_history(service.list_trial_jobs())
        EventStore(client, experiment_id).append(ExperimentResumed(experiment_id=experiment_id))
        return runner

    @property
    def experiment_id(self) -> str:
        return self.service.experiment_id

    def run(self) -> ExperimentResult:
        deadline = self.config.max_experiment_duration
        started = self.progress.started_at
        exhausted = False
        try:
            while True:
                self._keep_claim()
                out_of_time = deadline is not None and time.monotonic() - started >= deadline
                while not (out_of_time or exhausted) and len(self._active) < self.config.trial_concurrency:
                    budget = self.config.max_trial_number
                    if (budget is not None and self._next_sequence_id >= budget) or not self._submit():
                        exhausted = True
                        break
                if out_of_time and self._active:
                    self._stop_all("experiment reached maxExperimentDuration")
                    return self._finish("DONE")
                if not self._active and (exhausted or out_of_time):
                    return self._finish("DONE")
                self.on_progress(self.progress)
                wait = 0.5 if deadline is None else max(0.0, min(0.5, deadline - (time.monotonic() - started)))
                self.service.wait_for_change(wait)
                self._reap(self._refresh())
        except ClaimLost:
            raise  # the trials and the experiment are the new runner's now
        except BaseException:
            self._stop_all("the experiment runner stopped")
            finish_experiment(self.service.store.client, self.experiment_id, "STOPPED", "runner interrupted")
            raise
        finally:
            self._release_if_mine(keys=[keys.runner(self.experiment_id)], args=[self._name])

    def _claim(self, wait_s: float) -> None:
        """Become the experiment's only runner: two would both submit trials and overspend the budget."""
        key, epoch = keys.runner(self.experiment_id), keys.runner_epoch(self.experiment_id)
        give_up = time.monotonic() + wait_s
        lease_ms = int(RUNNER_LEASE_S * 1000)
        while not (taken := int(self._take_claim(keys=[key, epoch], args=[self._name, lease_ms]))):
            if time.monotonic() >= give_up:
                holder: Any = self._client.get(key)
                raise RunnerError(f"experiment {self.experiment_id} is being run by {holder}; stop that runner first")
            time.sleep(0.1)
        self._epoch = taken
        self._claimed_at = time.monotonic()

    def _keep_claim(self) -> None:
        """Renew the runner claim, once a second (not once per wake-up: a write is an fsync away),
        and only while it is still ours: a runner that lost it stops before it submits again."""
        if time.monotonic() - self._claimed_at < RUNNER_RENEW_S:
            return
        key, epoch = keys.runner(self.experiment_id), keys.runner_epoch(self.experiment_id)
        if not self._renew_if_mine(keys=[key, epoch], args=[self._name, int(RUNNER_LEASE_S * 1000), self._epoch]):
            holder: Any = self._client.get(key)
            now = f"{holder} runs it now" if holder else f"run `trialstream resume {self.experiment_id}` to go on"
            raise ClaimLost(
                f"this runner of experiment {self.experiment_id} lost its claim (it stalled past its "
                f"{RUNNER_LEASE_S:g} s lease) and stopped, submitting nothing more; {now}"
            )
        self._claimed_at = time.monotonic()

    def _replay_history(self, trials: list[TrialJobDetail]) -> None:
        """Bring the tuner, the budget and the trials in flight to where the log says they were.

        The tuner is asked again for every past sequence id, in order, so a seeded tuner continues
        exactly as an uninterrupted run would; ended trials' results are handed to it again.
        """
        for trial in sorted(trials, key=lambda trial: trial.sequence_id):
            while self._next_sequence_id <= trial.sequence_id:
                self.tuner.generate_parameters(self._next_sequence_id)
                self._next_sequence_id += 1
            self._parameters[trial.id] = (trial.sequence_id, trial.form.hyper_parameters.parameters)
            self.progress.counts[str(trial.status)] += 1
            if trial.status.is_terminal:
                self._record_result(trial)
            else:
                self._active[trial.id] = trial.status

    def _submit(self) -> bool:
        self._keep_claim()
        sequence_id = self._next_sequence_id
        parameters = self.tuner.generate_parameters(sequence_id)
        if parameters is None:
            return False
        self._next_sequence_id += 1
        value = json.dumps(
            {
                "parameter_id": sequence_id,
                "parameter_source": "algorithm",
                "parameters": parameters,
                "parameter_index": 0,
            }
        )
        form = JobApplicationForm(sequence_id=sequence_id, hyper_parameters=HyperParameters(value=value))
        trial = self.service.submit_trial_job(form)
        self._active[trial.id] = trial.status
        self._parameters[trial.id] = (sequence_id, parameters)
        self.progress.counts[str(trial.status)] += 1
        return True

    def _refresh(self) -> list[TrialJobDetail]:
        """Re-read the trials in flight; hand finished ones to the tuner. Returns those still in flight."""
        in_flight = []
        for trial in self.service.get_trial_jobs(list(self._active)):
            trial_id, before = trial.id, self._active[trial.id]
            if not trial.status.is_terminal:
                in_flight.append(trial)
            if trial.status is before:
                continue
            self.progress.counts[str(before)] -= 1
            self.progress.counts[str(trial.status)] += 1
            if not trial.status.is_terminal:
                self._active[trial_id] = trial.status
                continue
            del self._active[trial_id]
            self._record_result(trial)
        return in_flight

    def _record_result(self, trial: TrialJobDetail) -> None:
        score = metric_score(trial.final_metric)
        if score is None:
            return
        parameter_id, parameters = self._parameters[trial.id]
        self.tuner.receive_trial_result(parameter_id, parameters, score)
        if self.progress.best is None or (score > self.progress.best) == self.maximize:
            self.progress.best = score

    def _reap(self, in_flight: list[TrialJobDetail]) -> None:
        """Declare trials of dead workers lost, even when no worker is left to do it, and queue
        again the jobs a worker took with it when it died before claiming them."""
        if time.monotonic() - self._reaped_at < REAP_INTERVAL_S:
            return
        self._reaped_at = time.monotonic()
        reap_lost_attempts(self._client, self._rq_connection, self._name, self.settings.trial_lease_s)
        unclaimed = unclaimed_attempts(self._client, self._rq_connection, in_flight)
        for trial in unclaimed:
            if trial.id in self._unclaimed:  # seen a second before too: its job is gone
                self.service.requeue(trial, "its job was lost with a worker that died before claiming it")
        self._unclaimed = {trial.id for trial in unclaimed}

    def _stop_all(self, reason: str) -> None:
        """SYS_CANCELED for every trial in flight, then wait (bounded) until they have ended."""
        for trial_id in self._active:
            self.service.request_stop(trial_id, TrialJobStatus.SYS_CANCELED, reason)
        give_up = time.monotonic() + _STOP_DEADLINE_S
        while self._active and time.monotonic() < give_up:
            self.service.wait_for_change(0.5)
            self._reap(self._refresh())  # a dead worker's trial must not hold the stop up

    def _finish(self, status: str) -> ExperimentResult:
        self.on_progress(self.progress)
        finish_experiment(self.service.store.client, self.experiment_id, status)
        self.service.clean_up()
        return ExperimentResult(self.experiment_id, self.service.list_trial_jobs())
