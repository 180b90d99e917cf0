"""Every built-in tuner and assessor runs a short experiment end to end: NNI's own classes from the
real `nni` package, a real worker, real trial processes. One whose extra is missing is refused."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest
import redis

from manager.algorithms import BUILTINS, AlgorithmError, Role, resolve
from manager.cli.trials import by_metric
from manager.config import load_experiment_config
from manager.runner import ExperimentResult, ExperimentRunner, Progress
from schemas.config import AlgorithmConfig, ConfigError
from tests.conftest import Processes

QUADRATIC_TRIAL = """
import json, os, trialstream_sdk as nni
params = nni.get_next_parameter()
with open(os.path.join(os.environ["NNI_OUTPUT_DIR"], "params.json"), "w") as out:
    json.dump(params, out)
x = params.get("x", 0.5)
x = x["_value"] if isinstance(x, dict) else x  # an architecture choice comes with its index
for step in range(2):
    nni.report_intermediate_result((x - 0.3) ** 2 + 1 - step)
nni.report_final_result({"default": (x - 0.3) ** 2, "x": x})
"""

SPACE: dict[str, Any] = {
    "x": {"_type": "uniform", "_value": [0, 1]},
    "c": {"_type": "choice", "_value": [1, 2, 3]},
}


def run_experiment(
    tmp_path: Path,
    client: redis.Redis,
    rq_connection: redis.Redis,
    trial: str = QUADRATIC_TRIAL,
    **config: Any,
) -> ExperimentResult:
    return runner_for(tmp_path, client, rq_connection, trial, **config).run()


def runner_for(
    tmp_path: Path,
    client: redis.Redis,
    rq_connection: redis.Redis,
    trial: str = QUADRATIC_TRIAL,
    **config: Any,
) -> ExperimentRunner:
    (tmp_path / "trial.py").write_text(trial)
    full = {
        "trialCommand": f"{sys.executable} trial.py",
        "trialCodeDirectory": str(tmp_path),
        "trialConcurrency": 2,
        "maxTrialNumber": 4,
        "maxExperimentDuration": "5m",
        "searchSpace": SPACE,
        "experimentWorkingDirectory": str(tmp_path / "experiments"),
        "trainingService": {"platform": "local"},
        **config,
    }
    (tmp_path / "config.yml").write_text(json.dumps(full))
    return ExperimentRunner.create(load_experiment_config(tmp_path / "config.yml"), client, rq_connection)


def ran_parameters(result: ExperimentResult) -> list[dict[str, Any]]:
    return [trial["hyperParameters"] for trial in json.loads(result.to_json())["trials"]]


def statuses(result: ExperimentResult) -> list[str]:
    return [str(trial.status) for trial in result.trials]


def in_space(parameters: dict[str, Any]) -> bool:
    return 0 <= parameters["x"] <= 1 and parameters["c"] in (1, 2, 3)


# Real classArgs for each tuner, small enough for a few trials.
TUNERS: dict[str, dict[str, Any]] = {
    "TPE": {"optimize_mode": "minimize", "seed": 1},
    "Random": {"seed": 2},
    "Anneal": {"optimize_mode": "minimize"},
    "Evolution": {"optimize_mode": "minimize", "population_size": 3},
    "DNGO": {"optimize_mode": "minimize"},
    "RegularizedEvolution": {"optimize_mode": "minimize", "population_size": 3, "sample_size": 2},
}


ARCHITECTURE = {  # NNI's classic NAS space, the only kind RegularizedEvolution takes
    "x": {"_type": "layer_choice", "_value": [0.1, 0.3, 0.7]},
    "c": {"_type": "input_choice", "_value": {"candidates": [1, 2, 3], "n_chosen": 1}},
}
SPACES = {"RegularizedEvolution": ARCHITECTURE}


@pytest.mark.parametrize("name", sorted(TUNERS))
def test_a_builtin_tuner_runs_an_experiment(
    name: str, tmp_path: Path, served: Processes, client: redis.Redis, rq_connection: redis.Redis
) -> None:
    tuner = {"name": name, "classArgs": TUNERS[name]}
    result = run_experiment(tmp_path, client, rq_connection, tuner=tuner, searchSpace=SPACES.get(name, SPACE))

    assert statuses(result) == ["SUCCEEDED"] * 4, served.logs()
    if name == "RegularizedEvolution":  # each choice comes as {"_value": ..., "_idx": ...}
        assert all(p["x"]["_value"] in (0.1, 0.3, 0.7) and len(p["c"]["_value"]) == 1 for p in ran_parameters(result))
    else:
        assert all(in_space(parameters) for parameters in ran_parameters(result))


def test_progress_shows_the_best_trial_in_the_tuners_direction(
    tmp_path: Path, served: Processes, client: redis.Redis, rq_connection: redis.Redis
) -> None:
    """TPE defaults to minimize: the best is the smallest `default`, and --sort metric lists it first."""
    seen: list[Progress] = []
    runner = runner_for(tmp_path, client, rq_connection, tuner={"name": "TPE", "classArgs": {"seed": 3}})
    runner.on_progress = seen.append
    result = runner.run()

    finals = sorted((trial.final_metric["default"], trial.id) for trial in result.trials)
    assert len(finals) == 4
    assert (seen[-1].optimize_mode, seen[-1].best, seen[-1].best_trial) == ("minimize", *finals[0])
    assert [trial.id for trial in by_metric(result.trials, "minimize")] == [trial_id for _, trial_id in finals]


def test_batch_tuner_runs_each_listed_set_once_then_the_search_ends(
    tmp_path: Path, served: Processes, client: redis.Redis, rq_connection: redis.Redis
) -> None:
    """NNI's BatchTuner example: a choice of plain dicts, each run as a whole parameter set; then
    no-more-trials ends the search without error."""
    sets = [{"x": 0.1, "c": 1}, {"x": 0.5, "c": 2}, {"x": 0.9, "c": 3}]
    result = run_experiment(
        tmp_path,
        client,
        rq_connection,
        searchSpace={"combine_params": {"_type": "choice", "_value": sets}},
        tuner={"name": "BatchTuner"},
        maxTrialNumber=10,
    )
    assert statuses(result) == ["SUCCEEDED"] * 3
    assert sorted(ran_parameters(result), key=lambda p: p["x"]) == sets


def test_grid_search_runs_out_and_the_experiment_is_done(
    tmp_path: Path, served: Processes, client: redis.Redis, rq_connection: redis.Redis
) -> None:
    result = run_experiment(
        tmp_path,
        client,
        rq_connection,
        searchSpace={"c": {"_type": "choice", "_value": [1, 2, 3]}},
        tuner={"name": "GridSearch"},
        maxTrialNumber=10,
    )
    assert sorted(p["c"] for p in ran_parameters(result)) == [1, 2, 3]


def test_hyperband_hands_out_trial_budgets_and_promotes_the_best(
    tmp_path: Path, served: Processes, client: redis.Redis, rq_connection: redis.Redis
) -> None:
    """An advisor: its parameter ids are its own ('0-1_0_0'), and each set carries TRIAL_BUDGET."""
    result = run_experiment(
        tmp_path,
        client,
        rq_connection,
        advisor={"name": "Hyperband", "classArgs": {"optimize_mode": "minimize", "R": 3, "eta": 3}},
        maxTrialNumber=6,
    )
    assert statuses(result) == ["SUCCEEDED"] * 6
    parameters = ran_parameters(result)
    assert all("TRIAL_BUDGET" in p for p in parameters)
    budgets = [p["TRIAL_BUDGET"] for p in parameters]
    assert max(budgets) > min(budgets)  # a later rung runs the survivors with more budget
    ids = [json.loads(trial.form.hyper_parameters.value)["parameter_id"] for trial in result.trials]
    assert all(isinstance(parameter_id, str) and parameter_id.count("_") == 2 for parameter_id in ids)


def test_pbt_runs_generations_that_load_the_checkpoints_of_the_last(
    tmp_path: Path, served: Processes, client: redis.Redis, rq_connection: redis.Redis
) -> None:
    trial = """
import os, trialstream_sdk as nni
p = nni.get_next_parameter()
load, save = p["load_checkpoint_dir"], p["save_checkpoint_dir"]
previous = float(open(os.path.join(load, "score")).read()) if os.path.exists(os.path.join(load, "score")) else 0.0
os.makedirs(save, exist_ok=True)
score = previous + p["x"]
open(os.path.join(save, "score"), "w").write(str(score))
nni.report_final_result(score)
"""
    result = run_experiment(
        tmp_path,
        client,
        rq_connection,
        trial=trial,
        searchSpace={"x": {"_type": "uniform", "_value": [0.5, 1]}},
        tuner={"name": "PBT", "classArgs": {"optimize_mode": "maximize", "population_size": 2}},
        maxTrialNumber=6,
    )
    assert statuses(result) == ["SUCCEEDED"] * 6
    parameters = ran_parameters(result)
    first, later = parameters[:2], parameters[2:]
    saved_first = {p["save_checkpoint_dir"] for p in first}
    assert all(p["load_checkpoint_dir"] in saved_first for p in later[:2])  # generation 2 goes on from 1
    assert all(str(tmp_path / "experiments") in p["save_checkpoint_dir"] for p in parameters)
    scores = [trial.final_metric for trial in result.trials]
    assert min(scores[2:4]) > min(scores[:2])  # it built on checkpoints, not from scratch


@pytest.mark.parametrize(
    ("name", "why"),
    [
        ("GP", "GP cannot run here: NNI 3.0's GP tuner fails after its cold start with every SciPy"),
        ("Metis", "Metis fails with scipy "),  # CI has the newest SciPy, which NNI 3.0's Metis predates
        ("SMAC", "SMAC needs the 'smac' package, which is not installed: apt-get install swig; pip install"),
        ("PPO", "PPO needs the 'gym' package, which is not installed: pip install nni gym tensorflow tf-keras"),
    ],
)
def test_a_tuner_that_cannot_work_here_is_refused_at_config_time_with_why(name: str, why: str, tmp_path: Path) -> None:
    """The four whose needs this machine's CI does not meet (README: what each needs, and why)."""
    (tmp_path / "config.yml").write_text(
        json.dumps(
            {
                "trialCommand": "python3 trial.py",
                "trialConcurrency": 1,
                "searchSpace": SPACE,
                "tuner": {"name": name},
                "trainingService": {"platform": "local"},
            }
        )
    )
    with pytest.raises(ConfigError) as refused:
        load_experiment_config(tmp_path / "config.yml")
    assert f": tuner.name: {why}" in str(refused.value)
    assert "TF_USE_LEGACY_KERAS" not in os.environ  # PPO's import setting never reaches trials


@pytest.mark.parametrize("builtin", [b for b in BUILTINS if b.pip and not b.unavailable], ids=lambda b: b.name)
def test_a_tuner_with_a_missing_extra_is_refused(builtin: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without its packages (hidden from import here), the name is refused with the pip line that fixes it."""
    hidden = ["nni", "hyperopt", "ConfigSpace", "torch", "pybnn", "gym", "statsmodels", "smac"]
    for module in list(sys.modules):
        if module.split(".")[0] in hidden:
            monkeypatch.delitem(sys.modules, module)
    for module in hidden:
        monkeypatch.setitem(sys.modules, module, None)
    role: Role = "assessor" if builtin.kind == "assessor" else "tuner"
    with pytest.raises(AlgorithmError) as refused:
        resolve(AlgorithmConfig(name=builtin.name), role)
    assert str(refused.value).endswith(f"which is not installed: {builtin.pip}")


def test_bohb_hands_out_budgets_from_its_model(
    tmp_path: Path, served: Processes, client: redis.Redis, rq_connection: redis.Redis
) -> None:
    """Its first bracket runs 3 configurations on budget 1, then the best of them on budget 3."""
    bohb = {"optimize_mode": "minimize", "min_budget": 1, "max_budget": 3, "eta": 3, "min_points_in_model": 2}
    advisor = {"name": "BOHB", "classArgs": bohb}
    result = run_experiment(tmp_path, client, rq_connection, advisor=advisor, maxTrialNumber=6)

    assert statuses(result) == ["SUCCEEDED"] * 6
    budgets = [p["TRIAL_BUDGET"] for p in ran_parameters(result)]
    assert budgets[:3] == [1, 1, 1] and budgets[3] == 3


def test_network_morphism_defines_its_own_space_and_runs_without_one(
    tmp_path: Path, served: Processes, client: redis.Redis, rq_connection: redis.Redis, monkeypatch
) -> None:
    """Also a regression (issue 24 A8): its models went to `model_path/` in the current directory, and so
    into the repository's top level from this test. They belong to the experiment, in its directory."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    trial = """
import trialstream_sdk as nni
graph = nni.get_next_parameter()
nni.report_final_result(0.5 if graph else 0.0)
"""
    args = {"optimize_mode": "maximize", "task": "cv", "input_width": 8, "input_channel": 3, "n_output_node": 2}
    result = run_experiment(
        tmp_path,
        client,
        rq_connection,
        trial=trial,
        searchSpace=None,
        tuner={"name": "NetworkMorphism", "classArgs": args},
        maxTrialNumber=2,
    )
    assert statuses(result) == ["SUCCEEDED"] * 2
    assert all(trial.final_metric == 0.5 for trial in result.trials)  # each got a model description
    assert list(elsewhere.iterdir()) == []
    experiment_dir = tmp_path / "experiments" / result.experiment_id
    assert sorted(path.name for path in (experiment_dir / "model_path").iterdir())[:2] == ["0.json", "1.json"]


def test_curvefitting_judges_trials_from_their_learning_curves(
    tmp_path: Path, served: Processes, client: redis.Redis, rq_connection: redis.Redis
) -> None:
    trial = """
import trialstream_sdk as nni
x = nni.get_next_parameter()["x"]
for epoch in range(1, 6):
    nni.report_intermediate_result(x * (1 - 0.5 ** epoch))
nni.report_final_result(x)
"""
    curvefitting = {"epoch_num": 6, "start_step": 3, "threshold": 0.9, "gap": 1}
    result = run_experiment(
        tmp_path,
        client,
        rq_connection,
        trial=trial,
        tuner={"name": "Random", "classArgs": {"seed": 4}},
        assessor={"name": "Curvefitting", "classArgs": curvefitting},
        maxTrialNumber=4,
    )
    assert set(statuses(result)) <= {"SUCCEEDED", "EARLY_STOPPED"}
    assert len(result.trials) == 4
