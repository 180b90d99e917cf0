"""The native Random and GridSearch tuners: NNI's Tuner interface (so the dispatcher drives them as it drives
NNI's own) over the search spaces of manager/search_space.py, with no `nni` package. Pure computation."""

from __future__ import annotations

import copy
import json
import math
import random
from bisect import bisect_left, bisect_right
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, TypeAlias

from manager.search_space import (
    OPTIMIZE_MODES,
    Choice,
    Numeric,
    Option,
    Param,
    RandInt,
    Space,
    is_int,
    parse_params,
    parse_space,
    show,
)

# Grid intervals narrower than this (in probability space) are not split further: no float-valued
# parameter can tell such points apart, and it bounds the search where quantization hides a value.
_MIN_WIDTH = 2.0**-40


class NativeTuner:
    """NNI's Tuner interface (the part its dispatcher calls), for tuners that need no `nni` package.

    `generate_parameters` returns None once the search space is exhausted (only GridSearch does);
    `generate_multiple_parameters` then returns fewer sets than asked, as NNI's does on NoMoreTrialError.
    """

    def __init__(self, optimize_mode: str | None = "maximize") -> None:
        if optimize_mode is None:
            optimize_mode = "maximize"
        if optimize_mode not in OPTIMIZE_MODES:
            raise ValueError(f"optimize_mode: expected one of {', '.join(OPTIMIZE_MODES)}; got {show(optimize_mode)}")
        self.optimize_mode = optimize_mode
        self._space: Space = ()

    def update_search_space(self, search_space: dict[str, Any]) -> None:
        self._space = parse_space(search_space)

    def generate_parameters(self, parameter_id: int, **kwargs: Any) -> dict[str, Any] | None:
        raise NotImplementedError

    def generate_multiple_parameters(self, parameter_id_list: list[int], **kwargs: Any) -> list[dict[str, Any]]:
        generated = []
        for parameter_id in parameter_id_list:
            parameters = self.generate_parameters(parameter_id, **kwargs)
            if parameters is None:
                break
            generated.append(parameters)
        return generated

    def receive_trial_result(self, parameter_id: int, parameters: dict[str, Any], value: Any, **kwargs: Any) -> None:
        """Results steer neither random nor grid search."""

    def import_data(self, data: list[dict[str, Any]]) -> None:
        """Results of trials run elsewhere (NNI's import-data): nothing to learn for a tuner that draws at random."""

    def trial_end(self, parameter_id: int, success: bool, **kwargs: Any) -> None:
        """Nothing to forget: no trial's end changes what comes next."""


class RandomTuner(NativeTuner):
    """Independent samples of every parameter; NNI's baseline, reproducible when seeded."""

    def __init__(self, seed: int | None = None, optimize_mode: str | None = "maximize") -> None:
        super().__init__(optimize_mode)
        if seed is not None and not is_int(seed):
            raise ValueError(f"seed: expected an integer; got {show(seed)}")
        self._rng = random.Random(seed)

    def generate_parameters(self, parameter_id: int, **kwargs: Any) -> dict[str, Any]:
        return _sample_space(self._space, self._rng)


def _sample_space(space: Space, rng: random.Random) -> dict[str, Any]:
    return {name: _sample(param, rng) for name, param in space}


def _sample(param: Param, rng: random.Random) -> Any:
    if isinstance(param, Choice):
        option = rng.choice(param.options)
        if isinstance(option, Option):
            return {"_name": option.name, **_sample_space(option.space, rng)}
        return copy.deepcopy(option)
    if isinstance(param, RandInt):
        return rng.randrange(param.lower, param.upper)
    return param.finish(param.draw(rng))


@dataclass(frozen=True)
class _Plain:
    """A plain choice option, boxed so no option value can pass for a nested (name, nodes) pair."""

    value: Any


class _ChoiceAxis:
    """A choice's grid: its distinct options, each nested space expanded in turn."""

    def __init__(self, choice: Choice, axes: list[_Axis]) -> None:
        self.bar = 0
        self._options: list[_Plain | tuple[str, list[_Node]]] = []
        keys: set[str] = set()
        for option in choice.options:
            if isinstance(option, Option):
                self._options.append((option.name, _grid_nodes(option.space, axes)))
            # Random keeps repeats (they weight the draw); for the grid they are one point.
            elif (key := json.dumps(option, sort_keys=True)) not in keys:
                keys.add(key)
                self._options.append(_Plain(option))

    @property
    def size(self) -> int:
        return len(self._options)

    def expand(self, index: int) -> Iterator[tuple[Any, bool]]:
        option = self._options[index]
        if isinstance(option, _Plain):
            yield copy.deepcopy(option.value), False
            return
        name, nodes = option
        for params, new in _walk(nodes):
            yield {"_name": name, **params}, new


class _IntAxis:
    """randint is unordered in NNI's grid (like choice), so every integer is on the first grid."""

    def __init__(self, param: RandInt) -> None:
        self.bar = 0
        self._lower = param.lower
        self.size = param.upper - param.lower

    def expand(self, index: int) -> Iterator[tuple[Any, bool]]:
        yield self._lower + index, False


class _NumericAxis:
    """Points of an ordered parameter, added by bisecting probability space one level per epoch.

    Each grid point is the midpoint of a kept interval; an interval is kept only while a value not
    yet on the grid may lie inside it, so quantized types run out exactly when every value is found.
    """

    def __init__(self, spec: Numeric) -> None:
        self.bar = 0
        self._values: list[float] = []
        self._spec = spec
        self._bounds = spec.coord_bounds()
        self._seen: list[float] = []  # sorted coordinates of self._values
        self._intervals = [(0.0, self._bounds[0], 1.0, self._bounds[1])]  # (u, coord, u, coord)

    @property
    def size(self) -> int:
        return len(self._values)

    @property
    def divisible(self) -> bool:
        return bool(self._intervals)

    def expand(self, index: int) -> Iterator[tuple[Any, bool]]:
        yield self._values[index], False

    def split(self) -> bool:
        """Add every kept interval's midpoint; True when that put a new value on the grid."""
        added = False
        kept = []
        for low_u, low_c, high_u, high_c in self._intervals:
            mid_u = (low_u + high_u) / 2
            mid_c = self._spec.coord(mid_u, self._bounds)
            at = bisect_left(self._seen, mid_c)
            if at == len(self._seen) or self._seen[at] != mid_c:
                self._seen.insert(at, mid_c)
                self._values.append(self._spec.value(mid_c))
                added = True
            for part in ((low_u, low_c, mid_u, mid_c), (mid_u, mid_c, high_u, high_c)):
                if part[2] - part[0] >= _MIN_WIDTH and self._may_hold_new(part[1], part[3]):
                    kept.append(part)
        self._intervals = kept
        return added

    def _may_hold_new(self, low: float, high: float) -> bool:
        if math.isinf(low) or math.isinf(high):
            return True
        if self._spec.q is None:
            return low < high
        found = bisect_right(self._seen, high) - bisect_left(self._seen, low)
        return found < high - low + 1


_Axis: TypeAlias = _ChoiceAxis | _IntAxis | _NumericAxis
_Node: TypeAlias = tuple[str, _Axis]


def _grid_nodes(space: Space, axes: list[_Axis]) -> list[_Node]:
    """One axis per parameter, nested ones included; `axes` collects them all so epochs can advance."""
    nodes: list[_Node] = []
    for name, param in space:
        axis: _Axis
        if isinstance(param, Choice):
            axis = _ChoiceAxis(param, axes)
        elif isinstance(param, RandInt):
            axis = _IntAxis(param)
        else:
            axis = _NumericAxis(param)
        axes.append(axis)
        nodes.append((name, axis))
    return nodes


def _walk(nodes: Sequence[_Node]) -> Iterator[tuple[dict[str, Any], bool]]:
    """The cartesian product of the current grid, last parameter fastest, flagging combinations
    that use at least one point added this epoch (the others were offered in earlier epochs)."""
    if not nodes:
        yield {}, False
        return
    (name, axis), rest = nodes[0], nodes[1:]
    for index in range(axis.size):
        for value, nested_new in axis.expand(index):
            for tail, tail_new in _walk(rest):
                yield {name: value, **tail}, index >= axis.bar or nested_new or tail_new


class GridSearchTuner(NativeTuner):
    """NNI 2.7+ grid search: all discrete combinations, with numeric ranges divided ever finer.

    The first epoch uses every choice/randint value and the midpoint of each numeric parameter; each
    later epoch adds the midpoints between existing points and offers only combinations not seen yet.
    """

    def __init__(self, optimize_mode: str | None = "maximize") -> None:
        super().__init__(optimize_mode)
        self._imported: set[str] = set()  # points run elsewhere (import_data), as JSON with sorted keys
        self.update_search_space({})

    def update_search_space(self, search_space: dict[str, Any]) -> None:
        self._axes: list[_Axis] = []
        self._nodes = _grid_nodes(parse_params(search_space, "searchSpace"), self._axes)
        self._numeric = [axis for axis in self._axes if isinstance(axis, _NumericAxis)]
        for axis in self._numeric:
            axis.split()
        self._epoch: Iterator[dict[str, Any]] | None = self._new_epoch()

    def _new_epoch(self) -> Iterator[dict[str, Any]]:
        return (params for params, new in _walk(self._nodes) if new)

    def generate_parameters(self, parameter_id: int, **kwargs: Any) -> dict[str, Any] | None:
        """The next unseen grid point (not one imported), or None once no parameter can be divided further."""
        while self._epoch is not None:
            params = next(self._epoch, None)
            if params is None:
                self._epoch = self._new_epoch() if self._refine() else None
            elif json.dumps(params, sort_keys=True) not in self._imported:
                return params
        return None

    def import_data(self, data: list[dict[str, Any]]) -> None:
        """As NNI's GridSearch: a point imported is not proposed."""
        self._imported.update(json.dumps(record["parameter"], sort_keys=True) for record in data)

    def _refine(self) -> bool:
        """Start the next epoch; False when the whole space has been offered."""
        for axis in self._axes:
            axis.bar = axis.size
        while any(axis.divisible for axis in self._numeric):
            added = [axis.split() for axis in self._numeric]
            if any(added):
                return True
        return False
