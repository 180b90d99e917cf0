"""NNI's dispatcher, in process: the runner's inputs become the calls NNI's msg_dispatcher makes.

NNI's manager talks to its dispatcher in commands (RequestTrialJobs, ReportMetricData, TrialEnd)
and gets commands back (NewTrialJob, NoMoreTrialJobs, KillTrialJob). The runner does the same
through `Dispatcher`: a tuner (with an optional assessor) is driven as NNI's MsgDispatcher drives
it, and an advisor (Hyperband, BOHB) handles the commands itself. Outputs may come from any input:
PBT and the advisors hand out parameter sets later, when results arrive.
"""

from __future__ import annotations

import contextlib
import json
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from manager.algorithms import Algorithm, is_no_more_trials
from schemas.trial import metric_score


@dataclass(frozen=True)
class NewTrial:
    """A parameter set to run: NNI's NEW_TRIAL_JOB."""

    parameter_id: Any  # int from a tuner, a string such as '0_0_0' from Hyperband
    parameters: Any
    source: str = "algorithm"

    @property
    def hyper_parameters(self) -> str:
        """The JSON trials read (`parameter_id`, `parameter_source`, `parameters`, `parameter_index`)."""
        return json.dumps(
            {
                "parameter_id": self.parameter_id,
                "parameter_source": self.source,
                "parameters": self.parameters,
                "parameter_index": 0,
            },
            default=_plain,
        )


def _plain(value: Any) -> Any:
    """NumPy scalars and arrays, which NNI's tuners return and its own `nni.dump` writes as plain JSON."""
    if hasattr(value, "tolist"):
        return value.tolist()
    raise TypeError(f"parameter value {value!r} of type {type(value).__name__} is not JSON")


@dataclass(frozen=True)
class NoMoreTrials:
    """The tuner had nothing (for now) for the last request: NNI's NO_MORE_TRIAL_JOBS."""


@dataclass(frozen=True)
class EarlyStop:
    """The assessor judged the trial Bad: NNI's KILL_TRIAL_JOB, with why."""

    trial_id: str
    reason: str


Output = NewTrial | NoMoreTrials | EarlyStop


class Dispatcher(Protocol):
    def initialize(self, search_space: dict[str, Any]) -> list[Output]: ...

    def request_trials(self, count: int) -> list[Output]: ...

    def final_result(self, trial_id: str, parameter_id: Any, value: Any) -> list[Output]: ...

    def intermediate_result(
        self, trial_id: str, attempt: int, parameter_id: Any, sequence: int, value: Any
    ) -> list[Output]: ...

    def trial_end(self, trial_id: str, parameter_id: Any, status: str) -> list[Output]: ...

    def import_data(self, data: list[dict[str, Any]]) -> list[Output]:
        """NNI's IMPORT_DATA: results of trials run elsewhere, `{"parameter", "value"}` each."""
        ...

    def ran(self, parameter_id: Any, parameters: Any) -> None:
        """Replay: the parameters the log says the trial ran with, whatever the tuner proposes now."""


class TunerDispatcher:
    """NNI's MsgDispatcher semantics for a Tuner and an optional Assessor, with ids of our own."""

    def __init__(self, tuner: Any, assessor: Any = None, assessor_name: str = "") -> None:
        self.tuner = tuner
        self.assessor = assessor
        self.assessor_name = assessor_name
        self._next_parameter_id = 0
        self._parameters: dict[Any, Any] = {}  # what each parameter id ran with
        self._generated: set[Any] = set()  # the ids this tuner proposed (not so a log's older trials)
        self._histories: dict[str, dict[int, Any]] = {}  # trial -> sequence -> intermediate value
        self._attempts: dict[str, int] = {}  # trial -> the attempt its history is of
        self._ended: set[str] = set()
        self._outputs: list[Output] = []

    def initialize(self, search_space: dict[str, Any]) -> list[Output]:
        self.tuner.update_search_space(search_space)
        return []

    def request_trials(self, count: int) -> list[Output]:
        ids = list(range(self._next_parameter_id, self._next_parameter_id + count))
        self._next_parameter_id += count
        with self._collecting() as outputs:
            try:
                generated = self.tuner.generate_multiple_parameters(ids, st_callback=self._new_trial)
            except Exception as error:
                if not is_no_more_trials(error):
                    raise
                generated = []
            for parameter_id, parameters in zip(ids, generated, strict=False):
                self._new_trial(parameter_id, parameters)
            if len(generated) < count:
                outputs.append(NoMoreTrials())
        return outputs

    def final_result(self, trial_id: str, parameter_id: Any, value: Any) -> list[Output]:
        """NNI's tuners take the reported value as it is (a dict's `default` is theirs to read); one
        without a number there is not given to them, since every built-in would fail on it."""
        if parameter_id not in self._parameters or metric_score(value) is None:
            return []
        parameters = self._parameters[parameter_id]
        with self._collecting() as outputs:
            if parameter_id in self._generated:
                self.tuner.receive_trial_result(
                    parameter_id, parameters, value, customized=False, trial_job_id=trial_id
                )
            else:  # a trial from before requests were logged: NNI's own resume path
                self.tuner.import_data([{"parameter": parameters, "value": value}])
        return outputs

    def intermediate_result(
        self, trial_id: str, attempt: int, parameter_id: Any, sequence: int, value: Any
    ) -> list[Output]:
        """As NNI: the assessor sees the trial's results in sequence order, once none is missing; a
        retried trial's history starts again with its new attempt."""
        if self.assessor is None or trial_id in self._ended:
            return []
        if self._attempts.setdefault(trial_id, attempt) != attempt:
            self._attempts[trial_id] = attempt
            self._histories.pop(trial_id, None)
        history = self._histories.setdefault(trial_id, {})
        history[sequence] = value
        ordered: list[Any] = []
        while len(ordered) in history:
            ordered.append(history[len(ordered)])
        if len(ordered) < sequence:
            return []
        verdict = self.assessor.assess_trial(trial_id, ordered)
        if not isinstance(verdict, bool) and getattr(verdict, "name", None) not in ("Good", "Bad"):
            raise RuntimeError(f"Assessor.assess_trial must return an AssessResult, not {type(verdict).__name__}")
        if verdict is False or getattr(verdict, "name", None) == "Bad":
            self._ended.add(trial_id)  # one kill is enough; further results are the dying trial's
            reason = (
                f"early-stopped by the {self.assessor_name} assessor after intermediate result "
                f"#{len(ordered)} ({json.dumps(ordered[-1])})"
            )
            return [EarlyStop(trial_id, reason)]
        return []

    def trial_end(self, trial_id: str, parameter_id: Any, status: str) -> list[Output]:
        success = status == "SUCCEEDED"
        self._ended.add(trial_id)
        if self._histories.pop(trial_id, None) is not None and self.assessor is not None:
            self.assessor.trial_end(trial_id, success)
        if parameter_id not in self._generated:
            return []
        with self._collecting() as outputs:
            self.tuner.trial_end(parameter_id, success)
        return outputs

    def import_data(self, data: list[dict[str, Any]]) -> list[Output]:
        """A tuner with no `import_data` (a custom one not built on NNI's Tuner) takes none, as NNI's base Tuner."""
        importer = getattr(self.tuner, "import_data", None)
        if importer is None:
            return []
        with self._collecting() as outputs:
            importer(data)
        return outputs

    def ran(self, parameter_id: Any, parameters: Any) -> None:
        self._parameters[parameter_id] = parameters
        if isinstance(parameter_id, int):  # new ids never reuse a logged one
            self._next_parameter_id = max(self._next_parameter_id, parameter_id + 1)

    def _new_trial(self, parameter_id: Any, parameters: Any) -> None:
        self._parameters[parameter_id] = parameters
        self._generated.add(parameter_id)
        self._outputs.append(NewTrial(parameter_id, parameters))

    @contextlib.contextmanager
    def _collecting(self) -> Iterator[list[Output]]:
        """Gather the NewTrials a call makes, directly or through st_callback (PBT sends later ones so)."""
        outputs: list[Output] = []
        self._outputs = outputs
        yield outputs


class AdvisorDispatcher:
    """An advisor (a subclass of NNI's MsgDispatcherBase) handling NNI's commands itself; what it
    `send`s is taken as output instead of going to a websocket."""

    def __init__(self, advisor: Any) -> None:
        self.advisor = advisor
        self._outputs: list[Output] = []
        self._generated: set[Any] = set()  # results of other ids (a log's older trials) would break it
        advisor.send = self._receive
        # trialstream resumes by replay, never by NNI's recovered-parameter path, whose check
        # compares Hyperband's string ids with an int and fails (TypeError) in NNI 3.0.
        advisor.is_created_in_previous_exp = lambda parameter_id: False

    def initialize(self, search_space: dict[str, Any]) -> list[Output]:
        return self._call("handle_initialize", search_space)

    def request_trials(self, count: int) -> list[Output]:
        return self._call("handle_request_trial_jobs", count)

    def final_result(self, trial_id: str, parameter_id: Any, value: Any) -> list[Output]:
        if metric_score(value) is None or parameter_id not in self._generated:
            return []
        return self._metric(trial_id, parameter_id, "FINAL", 0, value)

    def intermediate_result(
        self, trial_id: str, attempt: int, parameter_id: Any, sequence: int, value: Any
    ) -> list[Output]:
        if metric_score(value) is None or parameter_id not in self._generated:
            return []
        return self._metric(trial_id, parameter_id, "PERIODICAL", sequence, value)

    def trial_end(self, trial_id: str, parameter_id: Any, status: str) -> list[Output]:
        if parameter_id not in self._generated:
            return []
        hyper_params = json.dumps({"parameter_id": parameter_id, "parameter_source": "algorithm", "parameters": {}})
        return self._call("handle_trial_end", {"trial_job_id": trial_id, "event": status, "hyper_params": hyper_params})

    def import_data(self, data: list[dict[str, Any]]) -> list[Output]:
        return self._call("handle_import_data", data)

    def ran(self, parameter_id: Any, parameters: Any) -> None:
        """An advisor keeps its configurations to itself: a replay's differences stay with it."""

    def _metric(self, trial_id: str, parameter_id: Any, type_: str, sequence: int, value: Any) -> list[Output]:
        data = {
            "parameter_id": parameter_id,
            "trial_job_id": trial_id,
            "type": type_,
            "sequence": sequence,
            "value": json.dumps(value),
        }
        return self._call("handle_report_metric_data", data)

    def _call(self, handler: str, data: Any) -> list[Output]:
        outputs: list[Output] = []
        self._outputs = outputs
        getattr(self.advisor, handler)(data)
        return outputs

    def _receive(self, command: Any, data: str) -> None:
        name = getattr(command, "name", str(command))
        if name == "NewTrialJob":
            packed = json.loads(data)
            self._generated.add(packed["parameter_id"])
            self._outputs.append(NewTrial(packed["parameter_id"], packed["parameters"]))
        elif name == "NoMoreTrialJobs":
            self._outputs.append(NoMoreTrials())
        elif name == "KillTrialJob":
            self._outputs.append(EarlyStop(json.loads(data), "stopped by the advisor"))


def build_dispatcher(tuner: Algorithm, assessor: Algorithm | None, log_file: Path | None = None) -> Dispatcher:
    """The dispatcher for a checked config: built here, in the runner, not while checking the config.

    NNI's classes log to stdout, which is the runner's (`--json` prints the result there): their
    logs go to `log_file` instead, as NNI's own dispatcher.log."""
    if log_file is not None and "nni" in sys.modules:
        from nni.runtime import log

        log.silence_stdout()
        log_file.parent.mkdir(parents=True, exist_ok=True)
        log.start_experiment_logging(str(log_file), log_file, "info")
    if tuner.kind == "advisor":
        with _offline_channel():
            return AdvisorDispatcher(tuner.build())
    return TunerDispatcher(tuner.build(), assessor.build() if assessor else None, assessor.label if assessor else "")


def stop_nni_logging(log_file: Path) -> None:
    """Close the experiment's dispatcher.log: a process that runs several experiments (tests, the
    benchmarks) must not write one's NNI logs into the others'."""
    if "nni" in sys.modules:
        from nni.runtime import log

        log.stop_experiment_logging(str(log_file))


@contextlib.contextmanager
def _offline_channel() -> Iterator[None]:
    """NNI's MsgDispatcherBase connects to a websocket when built, unless its URL is a unit-test one.
    Advisors are driven in process here, so they are built with such a URL and never connect."""
    from nni.runtime import msg_dispatcher_base  # an advisor is NNI's class: nni is installed

    original = msg_dispatcher_base.dispatcher_env_vars
    msg_dispatcher_base.dispatcher_env_vars = original._replace(NNI_TUNER_COMMAND_CHANNEL="ws://_unittest_trialstream")
    try:
        yield
    finally:
        msg_dispatcher_base.dispatcher_env_vars = original
