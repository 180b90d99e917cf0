"""Tuners: what NNI's TPE costs per trial, driven by trialstream's dispatcher and by NNI's own, and what it
does to the slot refill of a real run next to the native Random tuner.

The first part needs no Redis: a seeded TPE, already fed HISTORY results, is asked for one trial at a time
and told its result and its end, the cycle NNI's manager puts a tuner through. The same cycle is run through
trialstream's `TunerDispatcher` and through NNI's `MsgDispatcher`, built without its websocket; both must
propose the very same parameters, or they do not drive the tuner alike. The second part runs experiments of
instant trials in a private stack, as `python -m bench --only overhead` does.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.harness import BenchStack, Figure, Section, median_of, percentile, repeat, stream_ms
from bench.overhead import WORKERS, slot_refills_ms
from core.event_store import StoredEvent
from manager.algorithms import resolve
from manager.dispatcher import NewTrial, TunerDispatcher
from manager.training_service import TrainingService
from schemas.config import AlgorithmConfig
from schemas.events import TrialEnded, TrialSubmitted

SPACE: dict[str, Any] = {
    "x": {"_type": "uniform", "_value": [0, 1]},
    "lr": {"_type": "loguniform", "_value": [1e-5, 1e-1]},
    "y": {"_type": "choice", "_value": [1, 2, 3, 4]},
}
SEED = 1
TPE_ARGS = {"optimize_mode": "minimize", "seed": SEED}
HISTORY = 200  # results fed before the clock starts
TIMED = 100  # trials generated (and reported, and ended) on the clock, per run
MIN_TUNER_RUNS = 5  # the tuner runs take well under a second each: more of them than --runs
CONCURRENCY = 4
TRIALS = 40
NNI_URL = "ws://_unittest_trialstream_bench"  # MsgDispatcherBase skips connect() for such a URL

# One trial of the cycle: its index -> the parameters the tuner proposed, as the trial would read them.
Cycle = Callable[[int], Any]


def loss(parameters: dict[str, Any]) -> float:
    """A smooth, deterministic result for a parameter set, with its optimum inside the space."""
    return (parameters["x"] - 0.3) ** 2 + (math.log10(parameters["lr"]) + 3) ** 2 / 10 + parameters["y"] / 10


def build_tuner(name: str, class_args: dict[str, Any] | None) -> Any:
    """As the runner builds it: resolved by NNI's name, not yet given the search space."""
    return resolve(AlgorithmConfig(name=name, class_args=class_args), "tuner").build()


def trialstream_cycle(tuner: Any) -> Cycle:
    """request_trials(1) -> final_result -> trial_end, through trialstream's TunerDispatcher."""
    dispatcher = TunerDispatcher(tuner)
    dispatcher.initialize(SPACE)

    def one(index: int) -> Any:
        (new,) = dispatcher.request_trials(1)
        assert isinstance(new, NewTrial), f"the tuner proposed nothing: {new!r}"
        trial_id = f"trial{index}"
        dispatcher.final_result(trial_id, new.parameter_id, loss(new.parameters))
        dispatcher.trial_end(trial_id, new.parameter_id, "SUCCEEDED")
        return json.loads(new.hyper_parameters)["parameters"]

    return one


def nni_cycle(tuner: Any) -> Cycle:
    """The same cycle through NNI 3.0's MsgDispatcher, given the commands' data as NNI's manager sends it
    (after `MsgDispatcherBase.run` has decoded the command), its outgoing commands recorded instead of sent."""
    from nni.runtime import msg_dispatcher
    from nni.runtime.tuner_command_channel import CommandType

    # Module globals: parameter ids count up across dispatchers, and every parameter set is kept.
    msg_dispatcher._next_parameter_id = 0
    msg_dispatcher._trial_params.clear()
    dispatcher = msg_dispatcher.MsgDispatcher(NNI_URL, tuner)
    sent: list[tuple[Any, str]] = []
    dispatcher.send = lambda command, data: sent.append((command, data))
    dispatcher.handle_initialize(SPACE)
    sent.clear()

    def one(index: int) -> Any:
        dispatcher.handle_request_trial_jobs(1)
        ((command, hyper_parameters),) = sent
        sent.clear()
        assert command is CommandType.NewTrialJob, f"the tuner proposed nothing: {command}"
        packed = json.loads(hyper_parameters)  # NNI's manager (TypeScript) parses it: not the dispatcher's time
        trial_id = f"trial{index}"
        metric = {
            "parameter_id": packed["parameter_id"],
            "trial_job_id": trial_id,
            "type": "FINAL",
            "sequence": 0,
            "value": json.dumps(loss(packed["parameters"])),  # a trial reports its metric as a JSON string
        }
        dispatcher.handle_report_metric_data(metric)
        # The manager ends a trial with the NewTrialJob data the trial was submitted with.
        dispatcher.handle_trial_end({"trial_job_id": trial_id, "event": "SUCCEEDED", "hyper_params": hyper_parameters})
        return packed["parameters"]

    return one


def direct_cycle(tuner: Any) -> Cycle:
    """The tuner's own methods, nothing around them."""
    tuner.update_search_space(SPACE)

    def one(index: int) -> Any:
        parameters = tuner.generate_parameters(index)
        tuner.receive_trial_result(index, parameters, loss(parameters))
        tuner.trial_end(index, True)
        return parameters

    return one


def ms_per_trial(cycle: Cycle) -> tuple[float, list[Any]]:
    """Feed HISTORY results off the clock, then time TIMED more cycles; (ms per trial, timed proposals)."""
    for index in range(HISTORY):
        cycle(index)
    started = time.perf_counter()
    proposals = [cycle(HISTORY + index) for index in range(TIMED)]
    return (time.perf_counter() - started) / TIMED * 1000, proposals


def submit_delays_ms(service: TrainingService, concurrency: int) -> list[float]:
    """From the log: a trial ends -> the trial taking its slot is submitted (the runner's and the tuner's
    share of a refill; `slot_refills_ms` adds the worker's pick-up)."""
    last_ended_ms = 0
    delays = []
    for entry in service.store.read():
        if not isinstance(entry, StoredEvent):
            continue
        if isinstance(entry.event, TrialEnded):
            last_ended_ms = stream_ms(entry.id)
        elif isinstance(entry.event, TrialSubmitted) and entry.event.form.sequence_id >= concurrency:
            delays.append(float(stream_ms(entry.id) - last_ended_ms))
    return delays


def generation_figures(section: Section, runs: int) -> None:
    def measure(index: int) -> dict[str, float]:
        tpe_ours, ours = ms_per_trial(trialstream_cycle(build_tuner("TPE", TPE_ARGS)))
        tpe_nni, theirs = ms_per_trial(nni_cycle(build_tuner("TPE", TPE_ARGS)))
        if ours != theirs:
            raise AssertionError("the same seeded TPE proposed different parameters under the two dispatchers")
        tpe_direct, _ = ms_per_trial(direct_cycle(build_tuner("TPE", TPE_ARGS)))
        random, _ = ms_per_trial(trialstream_cycle(build_tuner("Random", {"seed": SEED})))
        return {"ours": tpe_ours, "nni": tpe_nni, "direct": tpe_direct, "random": random}

    results = repeat(max(runs, MIN_TUNER_RUNS), measure)
    ours, nni, direct, random = (median_of([r[key] for r in results]) for key in ("ours", "nni", "direct", "random"))
    cycle = "request 1 -> final result -> trial end"
    section.add(
        Figure(
            "TPE per generated trial, trialstream's TunerDispatcher",
            ours,
            "ms",
            detail=f"{cycle}, {HISTORY} results already fed, {TIMED} timed; mixed space (uniform, loguniform, choice)",
        ),
        Figure(
            "TPE per generated trial, NNI's MsgDispatcher",
            nni,
            "ms",
            detail=f"the same cycle through NNI 3.0's handlers, commands recorded instead of sent: {nni / ours:.2f}x "
            "trialstream's time (NNI's json_tricks dump and load); both proposed identical parameters",
        ),
        Figure(
            "TPE per generated trial, tuner called directly",
            direct,
            "ms",
            detail="generate_parameters / receive_trial_result / trial_end with no dispatcher: the tuner's own share",
        ),
        Figure(
            "Random per generated trial, trialstream's TunerDispatcher",
            random,
            "ms",
            detail="the native Random tuner through the same cycle, for reference",
        ),
    )


def refill_figures(section: Section, root: Path, runs: int) -> None:
    tuners: dict[str, dict[str, Any]] = {
        "Random": {"name": "Random"},
        "TPE": {"name": "TPE", "classArgs": TPE_ARGS},
    }
    with BenchStack(root, workers=WORKERS) as stack:

        def experiment(index: int) -> dict[str, tuple[list[float], list[float]]]:
            samples = {}
            for label, tuner in tuners.items():  # interleaved: both see the same drift of a shared machine
                config = stack.experiment_config(
                    f"{label.lower()}{index}",
                    trialConcurrency=CONCURRENCY,
                    maxTrialNumber=TRIALS,
                    searchSpace=SPACE,
                    tuner=tuner,
                )
                result, _ = stack.run_experiment(config)
                assert all(trial.status == "SUCCEEDED" for trial in result.trials), "a benchmark trial failed"
                service = TrainingService(stack.client, stack.rq_connection, result.experiment_id)
                samples[label] = (slot_refills_ms(service, CONCURRENCY), submit_delays_ms(service, CONCURRENCY))
            return samples

        results = repeat(runs, experiment)

    def summary(label: str, which: int, q: float) -> float:
        return median_of([percentile(result[label][which], q) for result in results])

    for label in tuners:
        section.add(
            Figure(
                f"slot refill at concurrency {CONCURRENCY}, {label} (trial ends -> next RUNNING) p50",
                summary(label, 0, 50),
                "ms",
                detail=f"{TRIALS} instant trials, {CONCURRENCY} at a time; median over runs of each run's p50",
            ),
            Figure(f"slot refill at concurrency {CONCURRENCY}, {label} p90", summary(label, 0, 90), "ms"),
            Figure(
                f"trial ends -> next submitted at concurrency {CONCURRENCY}, {label} p50",
                summary(label, 1, 50),
                "ms",
                detail="the runner's and the tuner's share of the refill, without the worker's pick-up",
            ),
        )
    p90_ratio = summary("TPE", 0, 90) / summary("Random", 0, 90)
    section.add(
        Figure(
            f"slot refill at concurrency {CONCURRENCY}: TPE / Random (p50)",
            summary("TPE", 0, 50) / summary("Random", 0, 50),
            "x",
            "<= 2",
            detail=f"a model-based tuner must not slow the refill past twice Random's; p90 ratio {p90_ratio:.2f}",
        )
    )


def run(root: Path, runs: int) -> Section:
    section = Section("Tuners", "python -m bench --only tuners")
    try:
        from nni.runtime import log
    except ImportError:
        section.notes.append("nni is not installed: TPE cannot be measured (`pip install nni`).")
        return section
    log.silence_stdout()  # TPE logs its seed on stdout each time it is built
    generation_figures(section, runs)
    refill_figures(section, root, runs)
    section.notes.append(
        f"TPE is NNI's (`nni.algorithms.hpo.tpe_tuner.TpeTuner`, {TPE_ARGS}); Random is trialstream's native "
        f"tuner. Search space: {json.dumps(SPACE)}. The refill runs start from an empty history, so TPE's first "
        "20 proposals are its random start-up ones."
    )
    return section
