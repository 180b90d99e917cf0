"""The profile's `params` against NNI 3.0's own config classes: for the YAML a user writes, the params served
are what NNI's manager serves (its launcher's `ExperimentConfig.json()`), and NNI's client reads them back
(`ExperimentConfig(**params)`, which refuses a key it has no field for) into the same canonical config. Configs
with trialstream's own keys are read back too, those keys left out."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest

from manager.config import load_experiment_config
from schemas import nni_rest
from schemas.nni_params import nni_duration
from schemas.trial import ExperimentView
from tests.support.configs import write_config_file

SPACE = {"x": {"_type": "choice", "_value": [1, 2]}}
REMOTE_MACHINE = {"host": "h", "user": "u", "password": "secret"}
K8S_STORAGE = {"storageType": "nfs", "server": "nfs.example", "path": "/exports"}


def _config(code: Path, mount: Path) -> dict[str, dict[str, Any]]:
    """Configs a user writes, by what they show: NNI's keys alone, or with trialstream's own (`extra`)."""
    local = {"platform": "local"}
    return {
        "local": {"maxExperimentDuration": "1h", "maxTrialDuration": 90, "trainingService": local},
        "local-gpus": {
            "trialGpuNumber": 1,
            "debug": True,
            "trainingService": {**local, "useActiveGpu": False, "gpuIndices": "0,1", "maxTrialNumberPerGpu": 2},
        },
        "hybrid": {
            "nniManagerIp": "10.0.0.1",
            "trainingService": [local, {"platform": "remote", "machineList": [REMOTE_MACHINE]}],
        },
        "frameworkcontroller": {
            "nniManagerIp": "10.0.0.1",
            "trainingService": {
                "platform": "frameworkcontroller",
                "storage": K8S_STORAGE,
                "serviceAccountName": "frameworkcontroller",
                "taskRoles": [
                    {
                        "name": "worker",
                        "taskNumber": 1,
                        "command": "python3 trial.py",
                        "gpuNumber": 0,
                        "cpuNumber": 1,
                        "memorySize": 1024,
                        "frameworkAttemptCompletionPolicy": {"minFailedTaskCount": 1, "minSucceedTaskCount": 1},
                    }
                ],
            },
        },
        "extra-advisor": {
            "tuner": None,
            "advisor": {"name": "Hyperband", "classArgs": {"R": 9, "optimize_mode": "maximize"}},
            "maxTrialRetries": 2,
            "maxExperimentDuration": "90m",
            "trainingService": local,
        },
        "extra-remote": {
            "nniManagerIp": "10.0.0.1",
            "trainingService": {
                "platform": "remote",
                "machineList": [{**REMOTE_MACHINE, "checkHostKey": False}],
                "unreachableTimeout": "10m",
                "keepTrialFiles": True,
            },
        },
        "extra-aml": {
            "trainingService": {
                "platform": "aml",
                "subscriptionId": "s",
                "resourceGroup": "r",
                "workspaceName": "w",
                "computeTarget": "c",
                "credential": "azureCli",
                "pollInterval": "5s",
            },
        },
        "extra-kubeflow": {
            "nniManagerIp": "10.0.0.1",
            "trainingService": {
                "platform": "kubeflow",
                "operator": "tf-operator",
                "apiVersion": "v1",
                "storage": K8S_STORAGE,
                "worker": {"command": "python3 trial.py", "cpuNumber": 1, "codeDirectory": str(code)},
                "kubeconfig": str(mount / "kubeconfig"),
                "reportUnschedulableAfter": "30s",
            },
        },
        "extra-openpai": {
            "trialGpuNumber": 0,
            "nniManagerIp": "10.0.0.1",
            "trainingService": {
                "platform": "openpai",
                "host": "https://pai.example",
                "username": "u",
                "token": "t",
                "trialCpuNumber": 1,
                "trialMemorySize": 1024,
                "storageConfigName": "s",
                "virtualCluster": "default",
                "localStorageMountPoint": str(mount),
                "containerStorageMountPoint": "/mnt",
            },
        },
    }


def _profile_params(tmp_path: Path, overrides: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The YAML as written (NNI's keys), and the params served for the experiment trialstream made of it."""
    code, mount = tmp_path / "code", tmp_path / "mount"
    code.mkdir(exist_ok=True)
    mount.mkdir(exist_ok=True)
    written = {
        "experimentName": "profile",
        "trialCommand": "python3 trial.py",
        "trialCodeDirectory": str(code),
        "trialConcurrency": 2,
        "maxTrialNumber": 5,
        "searchSpace": SPACE,
        "tuner": {"name": "TPE", "classArgs": {"optimize_mode": "maximize"}},
        "experimentWorkingDirectory": str(tmp_path / "experiments"),
        **overrides,
    }
    written = {key: value for key, value in written.items() if value is not None}
    spec = load_experiment_config(write_config_file(tmp_path, written))
    view = ExperimentView(id="abc", config=spec.as_event_config, working_directory=str(tmp_path / "experiments/abc"))
    return written, nni_rest.experiment_profile(view, 0, 0, now_ms=0).wire()["params"]


@pytest.mark.parametrize("name", ["local", "local-gpus", "hybrid", "frameworkcontroller"])
def test_params_are_what_nni_serves_for_the_same_yaml(tmp_path: Path, name: str) -> None:
    from nni.experiment.config import ExperimentConfig

    written, params = _profile_params(tmp_path, _config(tmp_path / "code", tmp_path / "mount")[name])
    secret = {"password": "**********"}  # masked: NNI would show the password itself
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # NNI warns of a password in a config
        expected = ExperimentConfig(**written).json()
        assert ExperimentConfig(**params).json() == params  # canonical: NNI's client reads back what it serves
    for section in expected["trainingService"] if isinstance(expected["trainingService"], list) else []:
        for machine in section.get("machineList", []):
            machine.update(secret)
    assert params == expected


@pytest.mark.parametrize("name", ["extra-advisor", "extra-remote", "extra-aml", "extra-kubeflow", "extra-openpai"])
def test_params_with_trialstream_keys_are_read_by_nni_without_them(tmp_path: Path, name: str) -> None:
    from nni.experiment.config import ExperimentConfig

    _, params = _profile_params(tmp_path, _config(tmp_path / "code", tmp_path / "mount")[name])
    assert "maxTrialRetries" not in params
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # NNI warns of a password in a config, and of no nniManagerIp
        assert ExperimentConfig(**params).json() == params
    if name == "extra-advisor":  # NNI serves an advisor as the tuner
        assert params["tuner"]["name"] == "Hyperband" and "advisor" not in params
        assert params["maxExperimentDuration"] == "90m"


def test_a_duration_is_served_in_a_form_nni_keeps() -> None:
    assert [nni_duration(seconds) for seconds in (3600.0, 5400.0, 172800.0, 90.0, 1.5)] == [
        "1h",
        "90m",
        "2d",
        90,
        "1.5s",
    ]
    assert (nni_duration("2h"), nni_duration("soon"), nni_duration(True)) == ("2h", None, None)
