"""Loading NNI v2 experiment YAML: what is accepted, and that every rejection names the key and the fix."""

from __future__ import annotations

import json
import sys
import textwrap
import types
from pathlib import Path
from typing import Any

import pytest
import yaml

from core.registry import available_platforms
from manager.config import ExperimentSpec, load_experiment_config, stored_experiment_spec
from schemas.config import ConfigError, ExperimentConfig, parse_duration
from tests.support.configs import TOO_DEEP, config_error, deep_mapping, deep_space, too_deep, write_config_file
from workers.platforms.local.config import LocalConfig

SEARCH_SPACE: dict[str, Any] = {
    "lr": {"_type": "loguniform", "_value": [0.0001, 0.1]},
    "batch_size": {"_type": "choice", "_value": [16, 32, 64]},
}


def minimal(**overrides: Any) -> dict[str, Any]:
    """The smallest valid config, in NNI's camelCase; a value of None removes the key."""
    config: dict[str, Any] = {
        "searchSpace": SEARCH_SPACE,
        "trialCommand": "python3 trial.py",
        "trialConcurrency": 2,
        "trainingService": {"platform": "local"},
    }
    config.update(overrides)
    return {key: value for key, value in config.items() if value is not None}


def write_yaml(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))
    return path


def load(tmp_path: Path, config: dict[str, Any]) -> ExperimentSpec:
    return load_experiment_config(write_config_file(tmp_path, config))


def rejection(tmp_path: Path, config: dict[str, Any]) -> str:
    """The ConfigError message for a config that must be rejected."""
    return config_error(write_config_file(tmp_path, config))


def problem_lines(message: str, source: Path) -> list[str]:
    """The `key.path: what is wrong` part of each line, without the file prefix."""
    prefix = f"{source.resolve()}: "
    lines = message.splitlines()
    assert all(line.startswith(prefix) for line in lines), message
    return [line.removeprefix(prefix) for line in lines]


# ---------------------------------------------------------------- valid configs


FULL_CONFIG = """\
experimentName: mnist
searchSpaceFile: search_space.json
trialCommand: python3 mnist.py
trialCodeDirectory: code
trialConcurrency: 4
trialGpuNumber: 1
maxExperimentDuration: 1h
maxTrialNumber: 20
maxTrialDuration: 30m
tuner:
  name: Random
  classArgs:
    optimize_mode: minimize
    seed: 7
trainingService:
  platform: local
  useActiveGpu: false
  maxTrialNumberPerGpu: 2
  gpuIndices: [0, 1]
experimentWorkingDirectory: ~/nni-experiments
nniManagerIp: 127.0.0.1
debug: true
logLevel: info
experimentType: hpo
"""


def test_full_nni_v2_config_loads(tmp_path: Path) -> None:
    (tmp_path / "code").mkdir()
    (tmp_path / "search_space.json").write_text(json.dumps(SEARCH_SPACE))
    source = write_yaml(tmp_path / "config.yml", FULL_CONFIG)

    spec = load_experiment_config(source)

    config = spec.config
    assert config.experiment_name == "mnist"
    assert config.trial_command == "python3 mnist.py"
    assert config.trial_concurrency == 4
    assert config.trial_gpu_number == 1
    assert config.max_experiment_duration == 3600
    assert config.max_trial_number == 20
    assert config.max_trial_duration == 1800
    assert config.tuner is not None
    assert config.tuner.name == "Random"
    assert config.tuner.class_args == {"optimize_mode": "minimize", "seed": 7}
    assert config.experiment_working_directory == "~/nni-experiments"
    assert config.nni_manager_ip == "127.0.0.1"
    assert config.debug is True
    assert config.log_level == "info"
    assert config.experiment_type == "hpo"
    assert spec.search_space == SEARCH_SPACE
    assert spec.code_directory == (tmp_path / "code").resolve()
    assert spec.source == source.resolve()
    assert spec.platform == LocalConfig(use_active_gpu=False, max_trial_number_per_gpu=2, gpu_indices=[0, 1])


def test_minimal_config_takes_nni_defaults(tmp_path: Path) -> None:
    spec = load(tmp_path, minimal())

    assert spec.config.tuner is None
    assert spec.config.tuner_section.name == "Random"
    assert spec.config.max_experiment_duration is None
    assert spec.code_directory == tmp_path.resolve()  # trialCodeDirectory defaults to "."
    assert spec.platform == LocalConfig()
    assert spec.platform.max_trial_number_per_gpu == 1
    assert spec.platform.use_active_gpu is None


def test_keys_in_any_case_and_underscore_spelling_load_the_same(tmp_path: Path) -> None:
    camel = write_yaml(
        tmp_path / "camel" / "config.yml",
        """\
        searchSpace: {x: {_type: uniform, _value: [0, 1]}}
        trialCommand: python3 trial.py
        trialConcurrency: 3
        maxTrialNumber: 5
        trialGpuNumber: 1
        trainingService: {platform: local, useActiveGpu: false, maxTrialNumberPerGpu: 2}
        """,
    )
    mixed = write_yaml(
        tmp_path / "mixed" / "config.yml",
        """\
        search_space: {x: {_type: uniform, _value: [0, 1]}}
        trial_command: python3 trial.py
        TrialConcurrency: 3
        MAXTRIALNUMBER: 5
        Trial_GPU_Number: 1
        training_service: {PLATFORM: local, use_active_gpu: false, MaxTrialNumberPerGPU: 2}
        """,
    )

    expected, actual = load_experiment_config(camel), load_experiment_config(mixed)

    # trainingService keeps the user's spelling until the platform's model reads it
    assert actual.config.model_dump(exclude={"training_service"}) == expected.config.model_dump(
        exclude={"training_service"}
    )
    assert actual.platform == expected.platform
    assert actual.search_space == expected.search_space
    assert actual.config.trial_concurrency == 3
    assert isinstance(actual.platform, LocalConfig)
    assert actual.platform.use_active_gpu is False
    assert actual.platform.max_trial_number_per_gpu == 2


def test_tuner_name_and_section_keys_are_case_insensitive(tmp_path: Path) -> None:
    spec = load(tmp_path, minimal(tuner={"NAME": "gridsearch", "class_args": {"optimize_mode": "minimize"}}))

    assert spec.config.tuner is not None
    assert spec.config.tuner.class_args == {"optimize_mode": "minimize"}


def test_training_service_given_as_a_one_element_list_is_accepted(tmp_path: Path) -> None:
    spec = load(tmp_path, minimal(trainingService=[{"platform": "local", "useActiveGpu": True}]))

    assert spec.platform == LocalConfig(use_active_gpu=True)


# ---------------------------------------------------------------- unknown and duplicate keys


def test_unknown_top_level_key_is_rejected_with_its_path(tmp_path: Path) -> None:
    message = rejection(tmp_path, minimal(fooBar=1))

    lines = problem_lines(message, tmp_path / "config.yml")
    assert lines == ["fooBar: unknown key; check its spelling against the NNI v2 config reference"]


def test_unknown_key_inside_training_service_is_rejected_with_its_path(tmp_path: Path) -> None:
    message = rejection(tmp_path, minimal(trainingService={"platform": "local", "fooBar": 1}))

    lines = problem_lines(message, tmp_path / "config.yml")
    assert len(lines) == 1
    assert lines[0].startswith("trainingService.fooBar: unknown key")
    assert "did you mean" not in lines[0]  # nothing is close to fooBar


@pytest.mark.parametrize(
    ("config", "path", "suggestion"),
    [
        (minimal(trialConcurrency=None, trialConcurency=2), "trialConcurency", "trialConcurrency"),
        (minimal(trialConcurrency=None, trial_concurency=2), "trial_concurency", "trialConcurrency"),
        (minimal(trialComand="x"), "trialComand", "trialCommand"),
        (
            minimal(trainingService={"platform": "local", "useActivGpu": True}),
            "trainingService.useActivGpu",
            "useActiveGpu",
        ),
        (minimal(tuner={"name": "Random", "clasArgs": {}}), "tuner.clasArgs", "classArgs"),
    ],
)
def test_near_miss_key_gets_a_did_you_mean_suggestion(
    tmp_path: Path, config: dict[str, Any], path: str, suggestion: str
) -> None:
    message = rejection(tmp_path, config)

    line = next(line for line in problem_lines(message, tmp_path / "config.yml") if line.startswith(f"{path}:"))
    assert "unknown key" in line
    assert f"did you mean {suggestion!r}?" in line


def test_every_problem_is_reported_at_once(tmp_path: Path) -> None:
    message = rejection(
        tmp_path, minimal(trialCommand=None, trialConcurrency=None, trialConcurency=2, maxTrialDuration="forever")
    )

    paths = {line.split(":")[0] for line in problem_lines(message, tmp_path / "config.yml")}
    assert paths == {"trialCommand", "trialConcurrency", "trialConcurency", "maxTrialDuration"}


def test_key_given_twice_in_two_spellings_is_rejected(tmp_path: Path) -> None:
    path = write_yaml(
        tmp_path / "config.yml",
        """\
        searchSpace: {x: {_type: uniform, _value: [0, 1]}}
        trialCommand: python3 a.py
        trial_command: python3 b.py
        trialConcurrency: 1
        trainingService: {platform: local}
        """,
    )

    with pytest.raises(ConfigError, match=r"key 'trial_command' is given twice"):
        load_experiment_config(path)


def test_key_given_twice_inside_training_service_is_rejected(tmp_path: Path) -> None:
    message = rejection(
        tmp_path, minimal(trainingService={"platform": "local", "useActiveGpu": False, "USE_ACTIVE_GPU": True})
    )

    assert problem_lines(message, tmp_path / "config.yml") == [
        "trainingService: key 'USE_ACTIVE_GPU' is given twice (keys are case- and underscore-insensitive)"
    ]


# ---------------------------------------------------------------- unreadable files


@pytest.mark.parametrize(
    "text",
    [
        "trialCommand: python3 trial.py\n\ttrialConcurrency: 1\n",  # a tab where YAML wants spaces
        "trainingService:\n  platform: local\n useActiveGpu: true\n",  # bad indentation
        "trialCommand: [unclosed\n",
    ],
    ids=["tab", "indent", "unclosed"],
)
def test_invalid_yaml_names_the_file(tmp_path: Path, text: str) -> None:
    path = tmp_path / "config.yml"
    path.write_text(text)

    with pytest.raises(ConfigError) as caught:
        load_experiment_config(path)

    message = str(caught.value)
    assert message.startswith(f"{path.resolve()}: invalid YAML:")
    assert "line " in message  # PyYAML's position, so the user can find the mistake


@pytest.mark.parametrize("text", ["- trialCommand: x\n- trialConcurrency: 1\n", "just a string\n", "", "42\n"])
def test_config_that_is_not_a_mapping_is_rejected(tmp_path: Path, text: str) -> None:
    path = tmp_path / "config.yml"
    path.write_text(text)

    with pytest.raises(ConfigError, match="the config must be a YAML mapping of NNI v2 keys"):
        load_experiment_config(path)


def test_missing_config_file_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no such config file"):
        load_experiment_config(tmp_path / "absent.yml")


def test_config_path_that_is_a_directory_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=str(tmp_path.resolve())):
        load_experiment_config(tmp_path)


# ---------------------------------------------------------------- required and ranged values


def test_missing_trial_command_is_named(tmp_path: Path) -> None:
    message = rejection(tmp_path, minimal(trialCommand=None))

    assert problem_lines(message, tmp_path / "config.yml") == ["trialCommand: required key is missing"]


def test_empty_trial_command_is_rejected(tmp_path: Path) -> None:
    message = rejection(tmp_path, minimal(trialCommand=""))

    assert problem_lines(message, tmp_path / "config.yml")[0].startswith("trialCommand: ")


@pytest.mark.parametrize("concurrency", [0, -1])
def test_trial_concurrency_below_one_is_named(tmp_path: Path, concurrency: int) -> None:
    message = rejection(tmp_path, minimal(trialConcurrency=concurrency))

    assert problem_lines(message, tmp_path / "config.yml") == [
        "trialConcurrency: Input should be greater than or equal to 1"
    ]


@pytest.mark.parametrize(
    ("overrides", "line"),
    [
        ({"trialConcurrency": True}, "trialConcurrency: Input should be a valid integer"),
        ({"maxTrialNumber": True}, "maxTrialNumber: Input should be a valid integer"),
        (
            {"trainingService": "local"},
            "trainingService: expected a platform's section (a mapping such as {platform: local}) or a list of them,"
            " got 'local'",
        ),
        (
            {"trainingService": ["local"]},
            "trainingService: expected a platform's section (a mapping such as {platform: local}) or a list of them,"
            " got ['local']",
        ),
        (
            {"trainingService": {"platform": 3}},
            "trainingService.platform: expected a platform's name (e.g. platform: local), got 3",
        ),
        (
            {"trainingService": {"platform": "local", "gpuIndices": "a,b"}},
            "trainingService.gpuIndices: 'a,b' is not a list of GPU indices: write them as '0,1' or [0, 1]",
        ),
    ],
    ids=["bool-concurrency", "bool-max-trials", "platform-as-text", "list-of-text", "platform-number", "gpu-indices"],
)
def test_a_value_of_the_wrong_kind_is_named_with_its_fix(tmp_path: Path, overrides: dict[str, Any], line: str) -> None:
    """Each was accepted (YAML's `true` as 1 trial), or said in pydantic's words for its union's branches, or as
    int()'s ValueError."""
    assert problem_lines(rejection(tmp_path, minimal(**overrides)), tmp_path / "config.yml") == [line]


def test_missing_training_service_is_named(tmp_path: Path) -> None:
    message = rejection(tmp_path, minimal(trainingService=None))

    assert problem_lines(message, tmp_path / "config.yml") == ["trainingService: required key is missing"]


# ---------------------------------------------------------------- durations


@pytest.mark.parametrize(
    ("written", "seconds"),
    [("1h", 3600), ("30m", 1800), ("45s", 45), ("2d", 172800), (90, 90), ("90", 90), ("1.5h", 5400), ("10 M", 600)],
)
def test_durations_parse_to_seconds(tmp_path: Path, written: str | int, seconds: float) -> None:
    spec = load(tmp_path, minimal(maxExperimentDuration=written, maxTrialDuration=written))

    assert spec.config.max_experiment_duration == seconds
    assert spec.config.max_trial_duration == seconds
    assert parse_duration(written) == seconds


@pytest.mark.parametrize("key", ["maxExperimentDuration", "maxTrialDuration"])
def test_bad_duration_names_the_key_and_how_to_write_one(tmp_path: Path, key: str) -> None:
    message = rejection(tmp_path, minimal(**{key: "ten minutes"}))

    assert problem_lines(message, tmp_path / "config.yml") == [
        f"{key}: 'ten minutes' is not a duration: use a number with a unit s, m, h or d, e.g. '30m'"
    ]


@pytest.mark.parametrize("written", ["0s", 0, "-5m", "5w"])
def test_zero_negative_or_unknown_unit_durations_are_rejected(tmp_path: Path, written: str | int) -> None:
    message = rejection(tmp_path, minimal(maxExperimentDuration=written))

    assert problem_lines(message, tmp_path / "config.yml")[0].startswith("maxExperimentDuration: ")


def test_boolean_duration_is_rejected(tmp_path: Path) -> None:
    message = rejection(tmp_path, minimal(maxExperimentDuration=True))

    assert problem_lines(message, tmp_path / "config.yml")[0].startswith("maxExperimentDuration: ")


# ---------------------------------------------------------------- platform and tuner


def test_unknown_platform_lists_the_available_ones(tmp_path: Path) -> None:
    message = rejection(tmp_path, minimal(trainingService={"platform": "nowhere"}))

    (line,) = problem_lines(message, tmp_path / "config.yml")
    assert line.startswith("trainingService.platform: unknown platform 'nowhere'; available platforms: ")
    listed = line.rsplit("available platforms: ", 1)[1].split(", ")
    assert "local" in listed
    assert listed == available_platforms()


def test_missing_platform_is_named(tmp_path: Path) -> None:
    message = rejection(tmp_path, minimal(trainingService={"useActiveGpu": True}))

    assert problem_lines(message, tmp_path / "config.yml")[0].startswith(
        "trainingService.platform: required key is missing"
    )


def test_hybrid_list_names_the_section_of_each_problem(tmp_path: Path) -> None:
    """Hybrid lists are accepted (tests/platforms/test_hybrid.py); a section's problem names its index."""
    message = rejection(tmp_path, minimal(trainingService=[{"platform": "local"}, {"platform": "remote"}]))

    assert problem_lines(message, tmp_path / "config.yml") == ["trainingService.1.machineList: required key is missing"]


def test_unknown_tuner_names_tuner_name_and_lists_supported_tuners(tmp_path: Path) -> None:
    message = rejection(tmp_path, minimal(tuner={"name": "TPEE"}))

    (line,) = problem_lines(message, tmp_path / "config.yml")
    assert line.startswith("tuner.name: unknown tuner 'TPEE': supported tuners are Random, GridSearch, TPE, ")
    assert "Hyperband" in line


def test_an_assessor_is_not_a_tuner_and_a_tuner_not_an_assessor(tmp_path: Path) -> None:
    message = rejection(tmp_path, minimal(tuner={"name": "Medianstop"}))
    assert problem_lines(message, tmp_path / "config.yml") == ["tuner.name: Medianstop is an assessor, not a tuner"]
    message = rejection(tmp_path, minimal(assessor={"name": "TPE"}))
    assert problem_lines(message, tmp_path / "config.yml") == ["assessor.name: TPE is a tuner, not an assessor"]


def test_tuner_without_a_name_or_class_is_rejected(tmp_path: Path) -> None:
    message = rejection(tmp_path, minimal(tuner={"classArgs": {"seed": 1}}))

    assert "tuner: give 'name' (a built-in such as TPE) or 'className' with 'codeDirectory'" in message


def test_a_name_and_a_class_name_together_are_rejected(tmp_path: Path) -> None:
    message = rejection(tmp_path, minimal(tuner={"name": "TPE", "className": "my.Tuner", "codeDirectory": "."}))

    assert "give either 'name' (built-in) or 'className' and 'codeDirectory' (custom), not both" in message


def test_unknown_class_arg_is_named_under_tuner_class_args(tmp_path: Path) -> None:
    message = rejection(tmp_path, minimal(tuner={"name": "Random", "classArgs": {"seeed": 1}}))

    assert problem_lines(message, tmp_path / "config.yml")[0].startswith("tuner.classArgs: unknown classArg 'seeed'")


def test_an_nni_tuner_class_arg_is_checked_against_its_class(tmp_path: Path) -> None:
    message = rejection(tmp_path, minimal(tuner={"name": "TPE", "classArgs": {"optimise_mode": "minimize"}}))

    assert problem_lines(message, tmp_path / "config.yml") == [
        "tuner.classArgs: unknown classArg 'optimise_mode' for TPE; "
        "accepted classArgs are optimize_mode, seed, tpe_args"
    ]


def test_nni_own_class_arg_checks_give_their_message(tmp_path: Path) -> None:
    message = rejection(tmp_path, minimal(tuner={"name": "Evolution", "classArgs": {"population_size": "many"}}))

    (line,) = problem_lines(message, tmp_path / "config.yml")
    assert line.startswith("tuner.classArgs: Evolution: ")
    assert "population_size" in line


def test_an_advisor_goes_under_tuner_or_advisor_but_takes_no_assessor(tmp_path: Path) -> None:
    hyperband = {"name": "Hyperband", "classArgs": {"R": 9, "eta": 3, "optimize_mode": "maximize"}}
    assert load(tmp_path, minimal(advisor=hyperband)).config.tuner_section.name == "Hyperband"
    message = rejection(tmp_path, minimal(advisor=hyperband, tuner={"name": "TPE"}))
    assert "advisor: an advisor is both tuner and assessor; remove 'tuner' and 'assessor'" in message
    message = rejection(tmp_path, minimal(tuner=hyperband, assessor={"name": "Medianstop"}))
    assert problem_lines(message, tmp_path / "config.yml") == [
        "assessor: Hyperband is an advisor, which early-stops trials itself"
    ]


def test_use_annotation_is_refused_clearly(tmp_path: Path) -> None:
    message = rejection(tmp_path, minimal(useAnnotation=True))

    assert "useAnnotation: NNI 3.0 no longer ships its annotation tool" in message
    assert "nni.get_next_parameter()" in message


# ---------------------------------------------------------------- GPUs


def test_trial_gpu_number_without_use_active_gpu_names_the_key(tmp_path: Path) -> None:
    message = rejection(tmp_path, minimal(trialGpuNumber=1))

    (line,) = problem_lines(message, tmp_path / "config.yml")
    assert line.startswith("trainingService.useActiveGpu: required when trialGpuNumber > 0")
    assert "true" in line
    assert "false" in line


@pytest.mark.parametrize("use_active_gpu", [True, False])
def test_trial_gpu_number_with_use_active_gpu_loads(tmp_path: Path, use_active_gpu: bool) -> None:
    spec = load(
        tmp_path, minimal(trialGpuNumber=1, trainingService={"platform": "local", "useActiveGpu": use_active_gpu})
    )

    assert isinstance(spec.platform, LocalConfig)
    assert spec.platform.use_active_gpu is use_active_gpu


def test_zero_gpus_need_no_use_active_gpu(tmp_path: Path) -> None:
    assert load(tmp_path, minimal(trialGpuNumber=0)).config.trial_gpu_number == 0


@pytest.mark.parametrize(
    ("written", "indices"), [("0,1", [0, 1]), ("0, 2", [0, 2]), (1, [1]), ([0, 1], [0, 1]), ("3", [3])]
)
def test_gpu_indices_in_every_nni_spelling(tmp_path: Path, written: Any, indices: list[int]) -> None:
    spec = load(tmp_path, minimal(trainingService={"platform": "local", "gpuIndices": written}))

    assert isinstance(spec.platform, LocalConfig)
    assert spec.platform.gpu_indices == indices


@pytest.mark.parametrize("written", ["0,a", -1, [-1], "x", True])
def test_bad_gpu_indices_are_named(tmp_path: Path, written: Any) -> None:
    message = rejection(tmp_path, minimal(trainingService={"platform": "local", "gpuIndices": written}))

    assert all(
        line.startswith("trainingService.gpuIndices") for line in problem_lines(message, tmp_path / "config.yml")
    )


# ---------------------------------------------------------------- files relative to the config


def test_search_space_file_is_relative_to_the_config_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    experiment = tmp_path / "experiment"
    experiment.mkdir()
    (experiment / "space.json").write_text(json.dumps(SEARCH_SPACE))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)

    spec = load(experiment, minimal(searchSpace=None, searchSpaceFile="space.json"))

    assert spec.search_space == SEARCH_SPACE


def test_search_space_file_may_be_yaml(tmp_path: Path) -> None:
    (tmp_path / "space.yml").write_text(yaml.safe_dump(SEARCH_SPACE))

    assert load(tmp_path, minimal(searchSpace=None, searchSpaceFile="space.yml")).search_space == SEARCH_SPACE


def test_missing_search_space_file_is_named(tmp_path: Path) -> None:
    message = rejection(tmp_path, minimal(searchSpace=None, searchSpaceFile="nope.json"))

    assert message.startswith("searchSpaceFile: ")
    assert str(tmp_path / "nope.json") in message
    assert "does not exist" in message


def test_search_space_file_that_is_not_a_mapping_is_named(tmp_path: Path) -> None:
    (tmp_path / "space.json").write_text("[1, 2]")

    message = rejection(tmp_path, minimal(searchSpace=None, searchSpaceFile="space.json"))

    assert message.startswith("searchSpaceFile: ")
    assert "mapping of parameter names" in message


def test_search_space_file_that_is_not_json_is_named(tmp_path: Path) -> None:
    (tmp_path / "space.json").write_text('{"lr": {"_type": "uniform", "_value": [0, 1]')

    message = rejection(tmp_path, minimal(searchSpace=None, searchSpaceFile="space.json"))

    assert message.startswith("searchSpaceFile: ")
    assert "is not valid JSON or YAML" in message


def test_search_space_file_that_is_a_directory_is_named(tmp_path: Path) -> None:
    (tmp_path / "spaces").mkdir()

    message = rejection(tmp_path, minimal(searchSpace=None, searchSpaceFile="spaces"))

    assert "searchSpaceFile" in message


def test_search_space_and_search_space_file_together_are_refused(tmp_path: Path) -> None:
    (tmp_path / "space.json").write_text(json.dumps(SEARCH_SPACE))

    message = rejection(tmp_path, minimal(searchSpaceFile="space.json"))

    assert "give either searchSpace or searchSpaceFile, not both" in message


def test_no_search_space_at_all_is_named(tmp_path: Path) -> None:
    message = rejection(tmp_path, minimal(searchSpace=None))

    assert message.startswith("searchSpace: required key is missing")


def test_invalid_search_space_names_the_parameter(tmp_path: Path) -> None:
    space = {"lr": {"_type": "gaussian", "_value": [0, 1]}}

    message = rejection(tmp_path, minimal(searchSpace=space))

    (line,) = problem_lines(message, tmp_path / "config.yml")
    assert line.startswith("searchSpace.lr._type: unknown type 'gaussian'")
    assert "uniform" in line  # the supported types are listed


def test_trial_code_directory_is_relative_to_the_config_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    experiment = tmp_path / "experiment"
    (experiment / "src").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)

    spec = load(experiment, minimal(trialCodeDirectory="src"))

    assert spec.code_directory == (experiment / "src").resolve()
    assert spec.code_directory.is_absolute()


def test_missing_trial_code_directory_is_named(tmp_path: Path) -> None:
    message = rejection(tmp_path, minimal(trialCodeDirectory="src"))

    assert problem_lines(message, tmp_path / "config.yml") == [
        f"trialCodeDirectory: {(tmp_path / 'src').resolve()} is not a directory"
    ]


def test_trial_code_directory_expands_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    home = tmp_path / "home"
    (home / "code").mkdir(parents=True)
    monkeypatch.setenv("HOME", str(home))

    spec = load(tmp_path / "experiment", minimal(trialCodeDirectory="~/code"))

    assert spec.code_directory == (home / "code").resolve()


def test_search_space_file_expands_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    home = tmp_path / "home"
    home.mkdir()
    (home / "space.json").write_text(json.dumps(SEARCH_SPACE))
    monkeypatch.setenv("HOME", str(home))

    spec = load(tmp_path / "experiment", minimal(searchSpace=None, searchSpaceFile="~/space.json"))

    assert spec.search_space == SEARCH_SPACE


# ---------------------------------------------------------------- the stored config


def _keys(value: Any, skip: frozenset[str]) -> list[str]:
    """Every mapping key in value, not descending into the keys named in skip."""
    if isinstance(value, dict):
        found = []
        for key, item in value.items():
            found.append(key)
            if key not in skip:
                found.extend(_keys(item, skip))
        return found
    if isinstance(value, list):
        return [key for item in value for key in _keys(item, skip)]
    return []


def test_event_config_uses_nni_keys_and_inlines_the_search_space(tmp_path: Path) -> None:
    (tmp_path / "code").mkdir()
    (tmp_path / "search_space.json").write_text(json.dumps(SEARCH_SPACE))
    source = write_yaml(tmp_path / "config.yml", FULL_CONFIG.replace("trialConcurrency", "trial_concurrency"))

    data = load_experiment_config(source).as_event_config

    assert json.loads(json.dumps(data)) == data  # storable as JSON
    assert data["searchSpace"] == SEARCH_SPACE
    assert "searchSpaceFile" not in data
    assert data["trialCodeDirectory"] == str((tmp_path / "code").resolve())
    assert data["trialCommand"] == "python3 mnist.py"
    assert data["trialConcurrency"] == 4
    assert data["trialGpuNumber"] == 1
    assert data["maxExperimentDuration"] == 3600
    assert data["maxTrialDuration"] == 1800
    assert data["tuner"] == {"name": "Random", "classArgs": {"optimize_mode": "minimize", "seed": 7}}
    assert data["trainingService"] == {
        "platform": "local",
        "useActiveGpu": False,
        "maxTrialNumberPerGpu": 2,
        "gpuIndices": [0, 1],
    }
    # NNI's camelCase everywhere, except inside the user's own search space and classArgs
    keys = _keys(data, skip=frozenset({"searchSpace", "classArgs"}))
    assert [key for key in keys if "_" in key] == []
    # and it validates again as an NNI config
    assert ExperimentConfig.model_validate(data).trial_concurrency == 4


def test_event_config_omits_unset_keys(tmp_path: Path) -> None:
    data = load(tmp_path, minimal()).as_event_config

    assert "maxExperimentDuration" not in data
    assert "assessor" not in data
    assert data["trainingService"] == {"platform": "local", "maxTrialNumberPerGpu": 1}


# ---------------------------------------------------------------- custom algorithms and own search spaces

CUSTOM_TUNER = """
from nni.tuner import Tuner


class Mine(Tuner):
    def __init__(self, width=3):
        self.width = width

    def update_search_space(self, search_space):
        self.space = search_space

    def generate_parameters(self, parameter_id, **kwargs):
        return {"layers": [self.width] * parameter_id}
"""


def test_a_custom_tuner_loads_from_its_code_directory_and_may_define_its_own_space(tmp_path: Path) -> None:
    (tmp_path / "tuners").mkdir()
    (tmp_path / "tuners" / "mine.py").write_text(CUSTOM_TUNER)
    tuner = {"codeDirectory": "tuners", "className": "mine.Mine", "classArgs": {"width": 5}}

    spec = load(tmp_path, minimal(searchSpace=None, tuner=tuner))

    assert spec.search_space == {}
    section = spec.config.tuner_section
    assert section.code_directory == str(tmp_path / "tuners")  # stored absolute: resume finds it anywhere
    algorithm, assessor = spec.algorithms()
    assert (algorithm.label, algorithm.kind, assessor) == ("mine.Mine", "tuner", None)
    assert algorithm.build().generate_parameters(2) == {"layers": [5, 5]}


@pytest.mark.parametrize(
    ("tuner", "expected"),
    [
        ({"codeDirectory": "missing", "className": "mine.Mine"}, "tuner.codeDirectory: "),
        ({"codeDirectory": "tuners", "className": "Mine"}, "tuner.className: expected module.Class"),
        ({"codeDirectory": "tuners", "className": "other.Mine"}, "tuner.className: no module 'other' in "),
        ({"codeDirectory": "tuners", "className": "mine.Yours"}, "tuner.className: mine has no class 'Yours'"),
        ({"codeDirectory": "tuners", "className": "mine.Mine", "classArgs": {"depth": 1}}, "unknown classArg 'depth'"),
    ],
)
def test_a_broken_custom_tuner_section_names_the_key(tmp_path: Path, tuner: dict[str, Any], expected: str) -> None:
    (tmp_path / "tuners").mkdir()
    (tmp_path / "tuners" / "mine.py").write_text(CUSTOM_TUNER)

    message = rejection(tmp_path, minimal(tuner=tuner))

    assert expected in message


def test_a_custom_tuner_whose_module_needs_a_missing_package_says_what_to_install(tmp_path: Path) -> None:
    (tmp_path / "tuners").mkdir()
    (tmp_path / "tuners" / "needy.py").write_text("import no_such_package_here\n")

    message = rejection(tmp_path, minimal(tuner={"codeDirectory": "tuners", "className": "needy.Tuner"}))

    assert "needy.Tuner needs the 'no_such_package_here' package, which is not installed: " in message
    assert message.endswith("pip install no_such_package_here")


@pytest.mark.parametrize("key", ["tuner", "assessor", "advisor"])
@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("import no_such_package_here\n", "needs the 'no_such_package_here' package, which is not installed"),
        ("raise RuntimeError('broken')\n", "which fails to import here: RuntimeError('broken')"),
    ],
    ids=["missing package", "failing module"],
)
def test_a_custom_class_that_cannot_be_imported_is_filed_under_class_name(
    tmp_path: Path, key: str, source: str, expected: str
) -> None:
    """It was filed under `name`, a key the section does not have: the user looked for the mistake there."""
    module = tmp_path.name  # a name of its own: the code directories of earlier tests stay on sys.path
    (tmp_path / "algorithms").mkdir()
    (tmp_path / "algorithms" / f"{module}.py").write_text(source)
    section = {"codeDirectory": "algorithms", "className": f"{module}.Custom"}

    message = rejection(tmp_path, minimal(**{key: section}))

    (line,) = problem_lines(message, tmp_path / "config.yml")
    assert line.startswith(f"{key}.className: {module}.Custom needs "), line
    assert expected in line, line


def custom_class_in(directory: Path, files: dict[str, str], class_name: str) -> Any:
    """The class that a config in `directory` naming the custom tuner `class_name` loads, its code directory
    `directory/tuners` holding `files` (path there: source)."""
    for name, source in files.items():
        path = directory / "tuners" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(source)
    tuner = {"codeDirectory": "tuners", "className": class_name}
    return load(directory, minimal(searchSpace=None, tuner=tuner)).algorithms()[0].cls


def test_custom_modules_of_one_name_in_two_code_directories_load_each_from_its_own(tmp_path: Path) -> None:
    """A manager hosts many experiments: the second one's `mine.T` was the first one's, the first code directory
    on sys.path holding a mine.py, and the wrong tuner code ran."""
    a, b = ({"mine.py": f"class T:\n    where = {where!r}\n"} for where in ("a", "b"))

    first = custom_class_in(tmp_path / "a", a, "mine.T")

    assert first.where == "a"
    assert custom_class_in(tmp_path / "a", a, "mine.T") is first  # loaded once: resolved again, the same class
    assert custom_class_in(tmp_path / "b", b, "mine.T").where == "b"
    assert custom_class_in(tmp_path / "a", a, "mine.T").where == "a"


@pytest.mark.parametrize("init", [True, False], ids=["package", "namespace package"])
def test_custom_packages_of_one_name_in_two_code_directories_load_each_from_its_own(tmp_path: Path, init: bool) -> None:
    """Submodules, the class's and those it imports, come from the package in its own code directory."""
    mod = "from .where import WHERE\n\n\nclass T:\n    where = WHERE\n"
    a, b = (
        {"pkg/mod.py": mod, "pkg/where.py": f"WHERE = {where!r}\n", **({"pkg/__init__.py": ""} if init else {})}
        for where in ("a", "b")
    )

    assert custom_class_in(tmp_path / "a", a, "pkg.mod.T").where == "a"
    assert custom_class_in(tmp_path / "b", b, "pkg.mod.T").where == "b"
    assert custom_class_in(tmp_path / "a", a, "pkg.mod.T").where == "a"


def test_a_custom_module_imports_the_modules_beside_it(tmp_path: Path) -> None:
    """`import helpers` in the custom module finds helpers.py in its code directory, as in NNI."""
    helpers = f"{tmp_path.name}_helpers"  # a name of its own: the code directories of earlier tests stay on sys.path
    files = {
        f"{helpers}.py": "WHERE = 'beside'\n",
        "mine.py": f"from {helpers} import WHERE\n\n\nclass T:\n    where = WHERE\n",
    }

    assert custom_class_in(tmp_path, files, "mine.T").where == "beside"


@pytest.mark.parametrize(
    "name", ["json", "colorsys", "made_at_run_time"], ids=["loaded", "not loaded yet", "loaded without a spec"]
)
def test_a_custom_module_named_as_an_installed_one_is_refused_not_loaded_in_its_place(
    tmp_path: Path, name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """It would have replaced the installed module for the whole manager process; so would one a program made
    at run time (find_spec raises on its missing spec)."""
    if name == "made_at_run_time":
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    (tmp_path / "tuners").mkdir()
    (tmp_path / "tuners" / f"{name}.py").write_text("class T:\n    pass\n")

    message = rejection(
        tmp_path, minimal(searchSpace=None, tuner={"codeDirectory": "tuners", "className": f"{name}.T"})
    )

    (line,) = problem_lines(message, tmp_path / "config.yml")
    assert (
        line
        == f"tuner.className: {name!r} is an installed module, which a code directory does not replace: rename yours"
    )
    assert not str(getattr(sys.modules.get(name), "__file__", "")).startswith(str(tmp_path))


@pytest.mark.parametrize("tuner", [{"name": "TPE"}, {"codeDirectory": "tuners", "className": "mine.Mine"}])
def test_a_search_space_nested_too_deep_is_refused_naming_where_whatever_the_tuner(
    tmp_path: Path, tuner: dict[str, Any]
) -> None:
    """Its event could not be read back (pydantic's JSON parser stops at 200 levels), and the tuner's checks
    recurse: past 64 levels, far above a real space's few, it is refused before either, as a file too."""
    (tmp_path / "tuners").mkdir()
    (tmp_path / "tuners" / "mine.py").write_text(CUSTOM_TUNER)
    assert load(tmp_path, minimal(searchSpace=deep_space(64), tuner=tuner)).search_space == deep_space(64)

    for levels in (65, 200):
        message = rejection(tmp_path, minimal(searchSpace=deep_space(levels), tuner=tuner))
        (line,) = problem_lines(message, tmp_path / "config.yml")
        assert line.startswith(TOO_DEEP), line

    (tmp_path / "space.json").write_text(json.dumps(deep_space(65)))
    message = rejection(tmp_path, minimal(searchSpace=None, searchSpaceFile="space.json", tuner=tuner))
    assert message.startswith(f"{tmp_path / 'config.yml'}: {TOO_DEEP}"), message
    (tmp_path / "space.json").write_text("[" * 5000 + "]" * 5000)  # too deep for PyYAML's recursive parser
    message = rejection(tmp_path, minimal(searchSpace=None, searchSpaceFile="space.json", tuner=tuner))
    assert message.startswith("searchSpaceFile: nested too deep to read"), message


def test_a_stored_config_is_not_held_to_the_depth_limit_added_since(tmp_path: Path) -> None:
    """An experiment created before the limit, its log readable, still resumes."""
    config = load(tmp_path, minimal(searchSpace=deep_space(64))).as_event_config

    spec = stored_experiment_spec({**config, "searchSpace": deep_space(100)}, str(tmp_path))

    assert spec.search_space == deep_space(100)


def custom_section(tmp_path: Path, class_args: dict[str, Any]) -> dict[str, Any]:
    """A custom algorithm's section (CUSTOM_TUNER's, taking `width`) with these classArgs."""
    (tmp_path / "tuners").mkdir(exist_ok=True)
    (tmp_path / "tuners" / "mine.py").write_text(CUSTOM_TUNER)
    return {"codeDirectory": "tuners", "className": "mine.Mine", "classArgs": class_args}


@pytest.mark.parametrize("key", ["tuner", "assessor", "advisor"])
def test_class_args_nested_too_deep_are_refused_naming_where(tmp_path: Path, key: str) -> None:
    """Past ~200 levels the event holding the config could not be read back: the experiment was lost. Past 64,
    as a search space's, classArgs are refused naming where."""
    spec = load(tmp_path, minimal(**{key: custom_section(tmp_path, deep_mapping(64, "width"))}))
    assert getattr(spec.config, key).class_args == deep_mapping(64, "width")

    for levels in (65, 200):
        message = rejection(tmp_path, minimal(**{key: custom_section(tmp_path, deep_mapping(levels, "width"))}))
        (line,) = problem_lines(message, tmp_path / "config.yml")
        assert line.startswith(too_deep(f"{key}.classArgs.width")), line

    deep = yaml.safe_dump(minimal(**{key: custom_section(tmp_path, {"width": "DEEP"})}))
    path = write_yaml(tmp_path / "config.yml", deep.replace("DEEP", "[" * 5000 + "]" * 5000))
    assert config_error(path) == f"{path}: nested too deep to read (at most 64 levels are taken)"  # not a search space


def test_a_stored_config_s_class_args_are_not_held_to_the_depth_limit_added_since(tmp_path: Path) -> None:
    """An experiment created before the limit, its log readable, still resumes."""
    config = load(tmp_path, minimal(tuner=custom_section(tmp_path, {}))).as_event_config
    tuner = {**config["tuner"], "classArgs": deep_mapping(100, "width")}

    spec = stored_experiment_spec({**config, "tuner": tuner}, str(tmp_path))

    assert spec.config.tuner_section.class_args == deep_mapping(100, "width")


def test_a_builtin_tuner_still_needs_a_search_space(tmp_path: Path) -> None:
    message = rejection(tmp_path, minimal(searchSpace=None, tuner={"name": "TPE"}))

    assert "searchSpace: required key is missing" in message
