"""Tuners, advisors and assessors by NNI's names, or custom ones from a code directory.

Random and GridSearch are native (no `nni` needed); every other built-in is NNI's own class from
the `nni` package, under the name NNI's table (`nni/runtime/default_config/builtin_algorithms.yml`)
gives it. A config is checked here before anything runs: an unknown name, a class argument the
class does not take, or a missing package is refused with the fix (`pip install ...`).
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import os
import re
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from importlib import metadata
from importlib.machinery import ModuleSpec, PathFinder
from importlib.util import find_spec, module_from_spec
from pathlib import Path
from typing import Any, Literal

from manager.search_space import OPTIMIZE_MODES, SearchSpaceError, validate_search_space
from schemas.config import AlgorithmConfig

Role = Literal["tuner", "assessor"]
Kind = Literal["tuner", "advisor", "assessor"]

_HPO = "nni.algorithms.hpo"
NNI_PIP = "pip install nni"


@dataclass(frozen=True)
class Builtin:
    """One built-in algorithm: where its class is, and what it needs installed."""

    name: str
    target: str  # module.Class
    kind: Kind
    pip: str = NNI_PIP  # what installs everything it imports
    aliases: tuple[str, ...] = ()
    fixed_args: dict[str, Any] = field(default_factory=dict)  # NNI's table sets these; users cannot
    validator: str | None = None  # NNI's classArgsValidator, run on the user's classArgs
    own_space: bool = False  # builds its own search space: an empty searchSpace is fine
    nas: bool = False  # takes NNI's architecture choices (layer_choice, input_choice)
    unavailable: str | None = None  # why it cannot work here, whatever is installed
    below: tuple[tuple[str, str], ...] = ()  # (distribution, version) it fails from, measured on NNI 3.0
    environment: dict[str, str] = field(default_factory=dict)  # set while its module is imported
    default_mode: str = "maximize"  # its optimize_mode when classArgs give none (NNI's class default)
    # (classArg, folder): the class writes files where that classArg says, by default relative to the current
    # directory; unless the user sets it, it is pointed at that folder of the experiment's directory
    files_arg: tuple[str, str] | None = None


def _nni(name: str, target: str, kind: Kind = "tuner", **extra: Any) -> Builtin:
    return Builtin(name, f"{_HPO}.{target}", kind, **extra)


_SMAC_PIP = (
    "apt-get install swig; pip install nni 'numpy<1.24' 'scipy<1.10' 'scikit-learn<1.3' 'pandas<2.1' 'cython<3' "
    "setuptools wheel; pip install --no-build-isolation ConfigSpaceNNI smac4nni"
)

# What each needs was measured on Python 3.11 in clean environments with NNI 3.0 (README, "Tuners").
BUILTINS: tuple[Builtin, ...] = (
    Builtin("Random", "manager.tuners.RandomTuner", "tuner", pip=""),
    Builtin("GridSearch", "manager.tuners.GridSearchTuner", "tuner", pip=""),
    _nni("TPE", "tpe_tuner.TpeTuner", default_mode="minimize"),
    _nni(
        "Anneal",
        "hyperopt_tuner.HyperoptTuner",
        pip="pip install nni hyperopt 'numpy<2.4'",
        fixed_args={"algorithm_name": "anneal"},
        validator="hyperopt_tuner.HyperoptClassArgsValidator",
        default_mode="minimize",
        below=(("numpy", "2.4"),),
    ),
    _nni("Evolution", "evolution_tuner.EvolutionTuner", validator="evolution_tuner.EvolutionClassArgsValidator"),
    _nni("BatchTuner", "batch_tuner.BatchTuner", aliases=("Batch",)),
    _nni(
        "Hyperband", "hyperband_advisor.Hyperband", "advisor", validator="hyperband_advisor.HyperbandClassArgsValidator"
    ),
    _nni(
        "BOHB",
        "bohb_advisor.BOHB",
        "advisor",
        pip="pip install nni ConfigSpace statsmodels",
        validator="bohb_advisor.BOHBClassArgsValidator",
    ),
    _nni(
        "SMAC",
        "smac_tuner.SMACTuner",
        pip=_SMAC_PIP,
        validator="smac_tuner.SMACClassArgsValidator",
        below=(("numpy", "1.24"),),
    ),
    _nni(
        "Metis",
        "metis_tuner.MetisTuner",
        aliases=("MetisTuner",),
        pip="pip install nni 'scipy<1.11' 'numpy<2' 'scikit-learn<1.6'",
        validator="metis_tuner.MetisClassArgsValidator",
        below=(("scipy", "1.11"),),
    ),
    _nni(
        "GP",
        "gp_tuner.GPTuner",
        aliases=("GPTuner",),
        validator="gp_tuner.GPClassArgsValidator",
        unavailable=(
            "NNI 3.0's GP tuner fails after its cold start with every SciPy that supports Python 3.11 "
            "(SciPy >= 1.11 refuses its 2-D x0; older ones return a float it indexes); use TPE, or "
            "Metis with old SciPy"
        ),
    ),
    _nni(
        "PBT",
        "pbt_tuner.PBTTuner",
        aliases=("PBTTuner",),
        validator="pbt_tuner.PBTClassArgsValidator",
        files_arg=("all_checkpoint_dir", "checkpoint"),
    ),
    _nni(
        "DNGO",
        "dngo_tuner.DNGOTuner",
        aliases=("DNGOTuner",),
        pip="pip install nni torch pybnn",
        validator="dngo_tuner.DNGOClassArgsValidator",
    ),
    _nni(
        "RegularizedEvolution",
        "regularized_evolution_tuner.RegularizedEvolutionTuner",
        aliases=("RegularizedEvolutionTuner",),
        validator="regularized_evolution_tuner.EvolutionClassArgsValidator",
        nas=True,
    ),
    _nni(
        "NetworkMorphism",
        "networkmorphism_tuner.NetworkMorphismTuner",
        pip="pip install nni torch 'numpy<2.4'",
        validator="networkmorphism_tuner.NetworkMorphismClassArgsValidator",
        own_space=True,
        files_arg=("path", "model_path"),
        below=(("numpy", "2.4"),),
    ),
    _nni(
        "PPO",
        "ppo_tuner.PPOTuner",
        aliases=("PPOTuner",),
        pip="pip install nni gym tensorflow tf-keras",
        validator="ppo_tuner.PPOClassArgsValidator",
        environment={"TF_USE_LEGACY_KERAS": "1"},  # NNI's PPO uses tf.layers, gone from Keras 3
        nas=True,
    ),
    _nni(
        "Medianstop",
        "medianstop_assessor.MedianstopAssessor",
        "assessor",
        validator="medianstop_assessor.MedianstopClassArgsValidator",
    ),
    _nni(
        "Curvefitting",
        "curvefitting_assessor.CurvefittingAssessor",
        "assessor",
        validator="curvefitting_assessor.CurvefittingClassArgsValidator",
    ),
)


class AlgorithmError(ValueError):
    """A tuner or assessor section that cannot work; `key` is the offending key within the section."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(message)
        self.key = key


@dataclass(frozen=True)
class Algorithm:
    """A checked algorithm section: its class, the arguments to build it with, and how it is driven."""

    label: str  # NNI's name, or the custom className
    cls: type
    class_args: dict[str, Any]
    kind: Kind
    own_space: bool
    space: Literal["standard", "nas", "own"]  # what its searchSpace may hold: custom ones read theirs alone

    def check_search_space(self, search_space: dict[str, Any]) -> None:
        if self.space == "own":
            if not isinstance(search_space, dict):
                raise SearchSpaceError(f"searchSpace: expected a mapping; got {type(search_space).__name__}")
            return
        validate_search_space(search_space, allow_empty=self.own_space, nas=self.space == "nas")

    default_mode: str = "maximize"

    @property
    def optimize_mode(self) -> str:
        """The direction results are better in: the classArg, else NNI's default for the class."""
        mode = self.class_args.get("optimize_mode")
        return str(mode) if mode in OPTIMIZE_MODES else self.default_mode

    def build(self) -> Any:
        return self.cls(**self.class_args)


def names(role: Role) -> list[str]:
    """The built-in names usable as `role`, as NNI spells them."""
    kinds = ("tuner", "advisor") if role == "tuner" else ("assessor",)
    return [builtin.name for builtin in BUILTINS if builtin.kind in kinds]


def find_builtin(name: str, role: Role) -> Builtin:
    wanted = name.lower()
    for builtin in BUILTINS:
        if wanted in (builtin.name.lower(), *(alias.lower() for alias in builtin.aliases)):
            if (builtin.kind == "assessor") != (role == "assessor"):
                raise AlgorithmError(
                    "name", f"{builtin.name} is {with_article(builtin.kind)}, not {with_article(role)}"
                )
            return builtin
    raise AlgorithmError("name", f"unknown {role} {name!r}: supported {role}s are {', '.join(names(role))}")


def resolve(section: AlgorithmConfig, role: Role, files_dir: Path | None = None) -> Algorithm:
    """Import the section's class and check its classArgs, without building it.

    `files_dir` (the experiment's directory) is where a built-in that writes files (PBT's checkpoints,
    NetworkMorphism's models) writes them, unless its classArgs say otherwise: never the current directory."""
    args = section.class_args or {}
    if section.class_name is not None:
        cls = _custom_class(section.class_name, section.code_directory)
        kind: Kind = "assessor" if role == "assessor" else "advisor" if _is_advisor(cls) else "tuner"
        return Algorithm(section.class_name, cls, _checked_args(cls, args, {}, section.class_name), kind, True, "own")
    builtin = find_builtin(section.name or "", role)
    if builtin.unavailable:
        raise AlgorithmError("name", f"{builtin.name} cannot run here: {builtin.unavailable}")
    with _environment(builtin.environment):
        cls = _import(builtin.target, builtin.pip, f"{builtin.name} needs")
    _check_versions(builtin)
    checked = _checked_args(cls, args, builtin.fixed_args, builtin.name)
    _nni_validation(builtin, args)
    if builtin.files_arg and files_dir is not None and checked.get(builtin.files_arg[0]) is None:
        argument, folder = builtin.files_arg
        checked[argument] = str(files_dir / folder)
    space: Literal["standard", "nas"] = "nas" if builtin.nas else "standard"
    return Algorithm(builtin.name, cls, checked, builtin.kind, builtin.own_space, space, builtin.default_mode)


def with_article(kind: str) -> str:
    return f"an {kind}" if kind[0] in "aeiou" else f"a {kind}"


def _import(target: str, pip: str, needs: str, key: str = "name", top: ModuleSpec | None = None) -> type:
    """The class `target` names; a failure is filed under `key`, the section's key that chose it: a built-in's
    `name`, a custom one's `className`. `top`, a custom class's top-level module as found in its code directory,
    is loaded from there first: its submodules are then found inside it."""
    module_name, _, class_name = target.rpartition(".")
    try:
        if top is not None:
            _load_top_level(top)
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        missing = (error.name or str(error)).split(".")[0]
        fix = pip or f"pip install {missing}"
        raise AlgorithmError(key, f"{needs} the {missing!r} package, which is not installed: {fix}") from None
    except Exception as error:
        raise AlgorithmError(key, f"{needs} {module_name}, which fails to import here: {error!r}") from None
    cls = getattr(module, class_name, None)
    if not isinstance(cls, type):
        raise AlgorithmError(key, f"{module_name} has no class {class_name!r}")
    return cls


@contextlib.contextmanager
def _environment(variables: dict[str, str]) -> Iterator[None]:
    """Set while a module is imported, then put back: trials inherit the runner's environment."""
    saved = {name: os.environ.get(name) for name in variables}
    os.environ.update({name: value for name, value in variables.items() if saved[name] is None})
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)


# Runners and API requests resolve custom classes in threads of their own; sys.modules is shared.
_CUSTOM_IMPORTS = threading.Lock()
_CODE_DIRECTORIES: set[str] = set()  # every code directory appended to sys.path


def _custom_class(class_name: str, code_directory: str | None) -> type:
    """NNI v2's customized algorithm: `className` is `module.Class` inside `codeDirectory`.

    A manager hosts many experiments, and two code directories may each hold a `mine.py`: the module that
    `className` names is loaded from this experiment's directory alone, never found along sys.path (where an
    earlier experiment's directory comes first). The directory is still appended to sys.path, as NNI does: it
    never shadows installed modules (one of the same name is refused), and the modules the custom one imports
    from beside it (`import helpers`) are found. Those are found as any import is, though: by name, once per
    process, in the first directory on sys.path that holds them; two code directories with a different
    `helpers.py` both get the one loaded first. A package (`className: pkg.mod.Class`) has no such limit: what it
    imports from itself (`from . import helpers`) comes from its own directory."""
    module_name, _, short = class_name.rpartition(".")
    if not module_name or not short:
        raise AlgorithmError("className", f"expected module.Class (a module in codeDirectory); got {class_name!r}")
    if code_directory is None:
        raise AlgorithmError("codeDirectory", "required with className: the directory holding the module")
    directory = Path(code_directory).expanduser().resolve()
    if not directory.is_dir():
        raise AlgorithmError("codeDirectory", f"{directory} is not a directory")
    with _CUSTOM_IMPORTS:
        if str(directory) not in sys.path:
            sys.path.append(str(directory))
        _CODE_DIRECTORIES.add(str(directory))
        importlib.invalidate_caches()
        top = module_name.split(".")[0]
        spec = PathFinder.find_spec(top, [str(directory)])
        module_path = directory / Path(*module_name.split("."))
        if spec is None or not (module_path.with_suffix(".py").is_file() or (module_path / "__init__.py").is_file()):
            raise AlgorithmError("className", f"no module {module_name!r} in {directory}")
        if _installed(top):
            raise AlgorithmError(
                "className", f"{top!r} is an installed module, which a code directory does not replace: rename yours"
            )
        if spec.submodule_search_locations is not None:  # a namespace package's would follow sys.path to others
            spec.submodule_search_locations = [str(directory / top)]
        return _import(class_name, "", f"{class_name} needs", "className", spec)


def _installed(top: str) -> bool:
    """Whether the module `top` is found other than in a code directory: sys.path finds installed modules
    before the code directories appended to it (or sys.modules holds one)."""
    try:
        found = find_spec(top)
    except ValueError:  # in sys.modules without a spec (made at run time, as `__main__` may be): not a code module
        return True
    if found is None:
        return False
    folders = found.submodule_search_locations  # a package's
    where = Path(next(iter(folders))) if folders else Path(found.origin or "")
    return str(where.parent) not in _CODE_DIRECTORIES


def _load_top_level(spec: ModuleSpec) -> None:
    """The module or package `spec` found, into sys.modules in place of one of that name from elsewhere (another
    experiment's code directory) and its submodules; one already loaded from this file is kept, not run again."""
    loaded = sys.modules.get(spec.name)
    if (
        loaded is not None
        and getattr(loaded, "__file__", None) == spec.origin
        and getattr(loaded, "__path__", None) == spec.submodule_search_locations
    ):
        return
    for name in [name for name in sys.modules if name == spec.name or name.startswith(f"{spec.name}.")]:
        del sys.modules[name]
    module = module_from_spec(spec)  # sets a namespace package's loader
    assert spec.loader is not None
    sys.modules[spec.name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[spec.name]  # as a failed import: not left half-run
        raise


def _check_versions(builtin: Builtin) -> None:
    """NNI 3.0's code predates some releases of what it imports: refuse those before a run fails."""
    for distribution, limit in builtin.below:
        try:
            installed = metadata.version(distribution)
        except metadata.PackageNotFoundError:
            continue
        if version_tuple(installed) >= version_tuple(limit):
            raise AlgorithmError(
                "name",
                f"{builtin.name} fails with {distribution} {installed} (NNI 3.0's code needs "
                f"{distribution} < {limit}): {builtin.pip}",
            )


def version_tuple(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", version.split("+")[0])[:3])


def _is_advisor(cls: type) -> bool:
    """An advisor drives itself through NNI's dispatcher commands instead of the Tuner interface."""
    return any(base.__name__ == "MsgDispatcherBase" for base in cls.__mro__)


def _parameters(cls: type) -> dict[str, inspect.Parameter]:
    signature = inspect.signature(cls)
    return {name: p for name, p in signature.parameters.items() if p.kind is not p.VAR_POSITIONAL}


def _checked_args(cls: type, args: dict[str, Any], fixed: dict[str, Any], label: str) -> dict[str, Any]:
    parameters = _parameters(cls)
    takes_any = any(p.kind is p.VAR_KEYWORD for p in parameters.values())
    accepted = [name for name, p in parameters.items() if p.kind is not p.VAR_KEYWORD and name not in fixed]
    for key in args:
        if key in fixed or (key not in accepted and not takes_any):
            what = f"accepted classArgs are {', '.join(accepted)}" if accepted else "it takes no classArgs"
            raise AlgorithmError("classArgs", f"unknown classArg {key!r} for {label}; {what}")
    mode = args.get("optimize_mode")
    if mode is not None and mode not in OPTIMIZE_MODES:
        raise AlgorithmError("classArgs", f"optimize_mode: expected one of {', '.join(OPTIMIZE_MODES)}; got {mode!r}")
    required = [
        name
        for name, p in parameters.items()
        if p.default is p.empty and p.kind not in (p.VAR_KEYWORD,) and name not in args and name not in fixed
    ]
    if required:
        raise AlgorithmError("classArgs", f"{label} needs classArgs {', '.join(required)}")
    return {**fixed, **args}


def _nni_validation(builtin: Builtin, args: dict[str, Any]) -> None:
    """NNI's own classArgs checks (value ranges, types), with NNI's message."""
    if builtin.validator is None:
        return
    validator_cls = _import(f"{_HPO}.{builtin.validator}", builtin.pip, f"{builtin.name} needs")
    try:
        validator_cls().validate_class_args(**args)
    except Exception as error:
        raise AlgorithmError("classArgs", f"{builtin.name}: {error}") from None


def is_no_more_trials(error: BaseException) -> bool:
    """NNI's NoMoreTrialError, recognised without importing nni (native tuners never raise it)."""
    return type(error).__name__ == "NoMoreTrialError"


def optimize_mode_of(section: AlgorithmConfig) -> str:
    """The direction an experiment's results are better in: its classArg, else the built-in's default
    (TPE and Anneal minimize), else maximize. Nothing is imported: `trials list` runs no tuner code."""
    mode = (section.class_args or {}).get("optimize_mode")
    if mode in OPTIMIZE_MODES:
        return str(mode)
    if section.name is not None:
        try:
            return find_builtin(section.name, "tuner").default_mode
        except AlgorithmError:
            pass
    return "maximize"


def create_tuner(name: str, class_args: dict[str, Any] | None, search_space: dict[str, Any]) -> Any:
    """A built-in tuner, built and given the search space: what the dispatcher starts from."""
    tuner = resolve(AlgorithmConfig(name=name, class_args=class_args), "tuner").build()
    tuner.update_search_space(search_space)
    return tuner
