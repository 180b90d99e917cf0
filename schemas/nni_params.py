"""The experiment profile's `params` as NNI 3.0's manager serves them: the canonical ExperimentConfig JSON
its launcher sent (`ExperimentConfig.json()`), which NNI's client reads back as `ExperimentConfig(**params)`.

Built from the config an experiment stored (ExperimentCreated's, with its updates), which says the same
things in trialstream's terms, as NNI's canonicalisation would: keys in NNI's order, its defaults filled in
(`experimentType`, `logLevel`, `experimentWorkingDirectory`, each platform's `reuseMode`), the experiment's
trial keys copied into every platform section, an advisor served as the tuner, unset keys left out.
Durations are stored as seconds, where NNI keeps them as written: they are served as `<n><unit>` in the
largest unit that holds them exactly (`1h`, `30m`: a YAML's and `update_max_experiment_duration`'s form),
else as seconds (`90`). Keys NNI has no field for (maxTrialRetries, a platform's trialstream-only keys) are
left out: NNI's client refuses a config with one. A platform NNI does not know (dlts) keeps its section:
NNI's client takes such a section as it is.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import PurePosixPath
from typing import Any

Shape = Mapping[str, "Shape | None"]
"""The keys NNI's config class of a section has, in its order; each key's value the shape of its nested
section (also of each item of a list), or None for a value taken whole."""


def _keys(names: str, **nested: Shape) -> Shape:
    """A shape of whole values, `names` in order, then the `nested` sections."""
    return {**dict.fromkeys(names.split()), **nested}


_TRIAL_KEYS = ("trialCommand", "trialCodeDirectory", "trialGpuNumber", "nniManagerIp", "debug")
_PLATFORM = "platform " + " ".join(_TRIAL_KEYS)  # NNI's TrainingServiceConfig: the keys every section has
_STORAGE = _keys("storageType azureAccount azureShare keyVaultName keyVaultKey server path")
_KUBEFLOW_ROLE = _keys("replicas command gpuNumber cpuNumber memorySize dockerImage codeDirectory")
_TASK_ROLE = _keys(
    "name dockerImage taskNumber command gpuNumber cpuNumber memorySize",
    frameworkAttemptCompletionPolicy=_keys("minFailedTaskCount minSucceedTaskCount"),
)
_MACHINE = _keys(
    "host port user password sshKeyFile sshPassphrase useActiveGpu maxTrialNumberPerGpu gpuIndices pythonPath"
)
_PLATFORM_SHAPES: Mapping[str, Shape] = {
    "local": _keys(f"{_PLATFORM} useActiveGpu maxTrialNumberPerGpu gpuIndices reuseMode"),
    "remote": {**_keys(_PLATFORM, machineList=_MACHINE), "reuseMode": None},
    "openpai": _keys(
        f"{_PLATFORM} host username token trialCpuNumber trialMemorySize storageConfigName dockerImage virtualCluster"
        " localStorageMountPoint containerStorageMountPoint reuseMode openpaiConfig openpaiConfigFile"
    ),
    "aml": _keys(
        f"{_PLATFORM} subscriptionId resourceGroup workspaceName computeTarget dockerImage maxTrialNumberPerGpu"
    ),
    "kubeflow": {
        **_keys(f"{_PLATFORM} operator apiVersion", storage=_STORAGE),
        **dict.fromkeys(("worker", "ps", "master"), _KUBEFLOW_ROLE),
        **_keys("reuseMode namespace"),
    },
    "frameworkcontroller": {
        **_keys(_PLATFORM, storage=_STORAGE),
        **_keys("serviceAccountName", taskRoles=_TASK_ROLE),
        **_keys("reuseMode namespace"),
    },
}
"""NNI 3.0's training service config classes, by platform (nni/experiment/config/training_services)."""

_REUSE_MODE = {"local": False, "remote": False, "openpai": True, "kubeflow": True, "frameworkcontroller": True}
_DURATION_TEXT = re.compile(r"^\d+(\.\d+)?[smhd]$")
_UNITS = (("d", 86400), ("h", 3600), ("m", 60))


def nni_params(config: Mapping[str, Any], working_directory: str) -> dict[str, Any]:
    """NNI's canonical config JSON for a stored config; `working_directory` is the experiment's own
    (`<experimentWorkingDirectory>/<id>`)."""
    tuner = config.get("advisor") or config.get("tuner") or {"name": "Random"}  # NNI: an advisor is the tuner
    debug = bool(config.get("debug", False))
    params = {
        "experimentName": config.get("experimentName"),
        "experimentType": config.get("experimentType") or "hpo",
        "searchSpace": config.get("searchSpace", {}),
        "trialCommand": config.get("trialCommand"),
        "trialCodeDirectory": config.get("trialCodeDirectory"),
        "trialConcurrency": config.get("trialConcurrency"),
        "trialGpuNumber": config.get("trialGpuNumber"),
        "maxExperimentDuration": nni_duration(config.get("maxExperimentDuration")),
        "maxTrialNumber": config.get("maxTrialNumber"),
        "maxTrialDuration": nni_duration(config.get("maxTrialDuration")),
        "nniManagerIp": config.get("nniManagerIp"),
        "useAnnotation": bool(config.get("useAnnotation", False)),
        "debug": debug,
        "logLevel": config.get("logLevel") or ("debug" if debug else "info"),
        "experimentWorkingDirectory": str(PurePosixPath(working_directory).parent),
        "tuner": tuner,
        "assessor": config.get("assessor"),
        "trainingService": _training_service(config.get("trainingService", {}), config),
    }
    return {key: value for key, value in params.items() if value is not None}


def nni_duration(value: Any) -> str | int | None:
    """A duration as NNI keeps one: seconds as `<n><unit>` in the largest unit of minutes or more that
    holds them exactly, else as a number of seconds; a `<n><unit>` text as it is; None for anything else
    (NNI's web UI cannot render it: shown as no limit)."""
    if isinstance(value, str):
        return value if _DURATION_TEXT.match(value) else None
    if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
        return None
    for unit, seconds in _UNITS:
        if value >= seconds and value % seconds == 0:
            return f"{int(value // seconds)}{unit}"
    return int(value) if value == int(value) else format(value, "f").rstrip("0") + "s"


def _training_service(service: Any, top: Mapping[str, Any]) -> Any:
    """One platform's section, or NNI's hybrid list of them."""
    if isinstance(service, list):
        return [_platform_section(section, top) for section in service]
    return _platform_section(service, top)


def _platform_section(section: Any, top: Mapping[str, Any]) -> Any:
    """One platform's section as NNI's class for it canonicalises it: the experiment's trial keys copied in
    where the section has none (local drops nniManagerIp), NNI's defaults trialstream leaves unset, only NNI's
    keys."""
    if not isinstance(section, dict):
        return section
    platform = section.get("platform")
    merged = {**{key: top[key] for key in _TRIAL_KEYS if key in top}, **section}
    if platform == "local":
        merged.pop("nniManagerIp", None)
    if platform in _REUSE_MODE and merged.get("reuseMode") is None:
        merged["reuseMode"] = _REUSE_MODE[platform]
    if platform == "remote" and isinstance(merged.get("machineList"), list):  # NNI: useActiveGpu is a bool
        merged["machineList"] = [
            {"useActiveGpu": False, **machine} if isinstance(machine, dict) else machine
            for machine in merged["machineList"]
        ]
    shape = _PLATFORM_SHAPES.get(str(platform))
    return _shaped(merged, shape) if shape is not None else merged


def _shaped(value: Any, shape: Shape | None) -> Any:
    """`value` with only the keys of `shape`, in its order, at every level it describes. NNI's sections have
    no float field: a whole number stored as one (a role's cpuNumber) is served as an int."""
    if shape is None:
        return int(value) if isinstance(value, float) and value.is_integer() else value
    if isinstance(value, list):
        return [_shaped(item, shape) for item in value]
    if not isinstance(value, dict):
        return value
    return {key: _shaped(value[key], inner) for key, inner in shape.items() if value.get(key) is not None}
