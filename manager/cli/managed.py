"""`trialstream --manager URL run|resume`: the manager runs the experiment, this command follows it.

The config is checked here first (the errors a local run gives), the code directory goes up as the
archive the remote platform ships (`.nniignore`, NNI's limits), and progress and the result are shown
as a local run shows them; an interrupt asks the manager to stop the experiment and waits for its end.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from contextlib import suppress
from typing import Any

import yaml

from core.code_archive import CodeDirectoryError, archive
from manager.algorithms import optimize_mode_of
from manager.api_client import ManagerClient, ManagerError
from manager.cli.patience import Patience
from manager.config import ExperimentSpec
from manager.runner import ExperimentResult, Progress, RunnerError
from schemas.api import ExperimentState
from schemas.config import ConfigError, ExperimentConfig
from schemas.trial import metric_score

POLL_S = 0.5
ENDED = frozenset({"DONE", "STOPPED", "ERROR"})
_REPLACED_KEYS = frozenset({"searchspace", "searchspacefile", "trialcodedirectory"})  # normalised spellings

OnProgress = Callable[[Progress], None]


def create(spec: ExperimentSpec, client: ManagerClient, on_progress: OnProgress, wait_s: float) -> ManagedRun:
    """Upload the code, create the experiment on the manager (it runs it), and follow it from here."""
    try:
        code = archive(spec.code_directory)
    except CodeDirectoryError as error:
        raise ConfigError(f"{spec.source}: trialCodeDirectory: {error}") from None
    experiment_id = client.create(request_config(spec), client.upload_code(code))
    return ManagedRun(client, experiment_id, on_progress, wait_s)


def resume(
    client: ManagerClient, experiment_id: str, imported: bool, on_progress: OnProgress, wait_s: float
) -> ManagedRun:
    if imported:
        raise RunnerError("--imported: the manager's API does not resume imported experiments; use --redis URL")
    experiment_id = client.resolve(experiment_id)
    client.resume(experiment_id)
    return ManagedRun(client, experiment_id, on_progress, wait_s)


def request_config(spec: ExperimentSpec) -> dict[str, Any]:
    """The YAML's own mapping (secrets as written: the manager keeps them out of its log), with the search
    space inlined; the code directory is the upload's, on the manager's side."""
    written = yaml.safe_load(spec.source.read_text())
    config = {key: value for key, value in written.items() if _normalised(key) not in _REPLACED_KEYS}
    return {**config, "searchSpace": spec.search_space}


def _normalised(key: str) -> str:
    """Keys match case- and underscore-insensitively, as the config model reads them."""
    return key.replace("_", "").lower()


class ManagedRun:
    """An experiment a manager runs, followed as ExperimentRunner.run drives one: the same progress and
    result; an interrupt stops it (its trials SYS_CANCELED), waits for its end, and goes on up.

    The experiment runs on whether or not this command hears from the manager: one that does not answer
    (paused, restarting, a dropped connection) is asked again for up to `wait_s` seconds before the command
    fails, with requests that are safe to repeat alone (reads, and the stop)."""

    def __init__(self, client: ManagerClient, experiment_id: str, on_progress: OnProgress, wait_s: float) -> None:
        """No request here: the experiment runs on the manager already, and an interrupt is only turned into
        its stop inside `run`; a request made before would be a window where Ctrl-C leaves it running."""
        self.client = client
        self.experiment_id = experiment_id
        self.on_progress = on_progress
        self.progress: Progress | None = None
        self._patiently = Patience(client.url, wait_s, f"experiment {experiment_id} goes on there", self._lost)

    def run(self) -> ExperimentResult:
        try:
            self._until_ended()
        except KeyboardInterrupt:
            with suppress(ManagerError):  # it ended meanwhile (409); a manager that never answers fails just below
                self._patiently(lambda: self.client.stop(self.experiment_id))  # a repeat: one more stop request
            self._until_ended()
            raise
        return ExperimentResult(self.experiment_id, self._patiently(lambda: self.client.trials(self.experiment_id)))

    def _lost(self) -> str:
        """The experiment may not have ended with this command: how to find it again."""
        follow = f"trialstream --manager {self.client.url}"
        return (
            f"experiment {self.experiment_id} may still be running there: `{follow} events {self.experiment_id}"
            f" --follow` follows it once the manager answers, `{follow} trials list -e {self.experiment_id}` shows"
            " its trials"
        )

    def _progress(self, state: ExperimentState) -> Progress:
        config = ExperimentConfig.model_validate(state.config)
        elapsed_s = max(0.0, time.time() - (state.start_time or 0) / 1000)
        return Progress(
            self.experiment_id,
            time.monotonic() - elapsed_s,
            max_trials=config.max_trial_number,
            optimize_mode=optimize_mode_of(config.tuner_section),
        )

    def _until_ended(self) -> None:
        while True:
            state = self._patiently(lambda: self.client.experiment(self.experiment_id))
            self._show(state)
            if state.status in ENDED:
                return
            time.sleep(POLL_S)

    def _show(self, state: ExperimentState) -> None:
        if self.progress is None:
            self.progress = self._progress(state)
        self.progress.counts = Counter(state.trial_counts)
        best = self._patiently(lambda: self.client.trial_page(self.experiment_id, limit=1, sort="metric"))
        score = metric_score(best[0].final_metric) if best else None
        if score is not None:
            self.progress.best, self.progress.best_trial = score, best[0].id
        self.on_progress(self.progress)
