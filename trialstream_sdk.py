"""Trial-side SDK for trialstream: a stdlib-only drop-in for the trial functions of ``nni``.

Trial code can use ``import trialstream_sdk as nni`` (or keep ``import nni``): both read the same
environment and files and emit byte-identical metric records, so a launcher cannot tell them apart.
It imports in milliseconds instead of the ~1.7 s / 140 MB that ``import nni`` costs.

Protocol (observed by running trials under ``nni`` 3.0):

* parameters: ``$NNI_SYS_DIR/parameter.cfg`` (``parameter_<i>.cfg`` for later phases with
  ``MULTI_PHASE=true``), a JSON object whose ``parameters`` value is returned; while the file is
  missing a ``REQUEST_PARAMETER`` record is sent once and the file is polled.
* metrics, ``NNI_PLATFORM=local``: each record appended to ``$NNI_SYS_DIR/.nni/metrics`` as
  ``b"ME%06d" % (len(json) + 1) + json + b"\\n"`` -- the length counts the trailing newline.
* metrics, any other platform (or ``REUSE_MODE=true``): one stdout line ``NNISDK_MEb'<json>'``.
* ``NNI_PLATFORM`` unset: standalone; ``get_next_parameter()`` returns ``{}`` and metrics are printed.

Unlike ``nni`` this module refuses metrics the tuner cannot use (NaN, infinities, strings, dicts
without a numeric ``"default"``) at the call site, instead of letting them break the experiment later.
"""

from __future__ import annotations

import io
import json
import logging
import math
import numbers
import os
import sys
import threading
import time
import warnings
from collections.abc import Mapping
from datetime import datetime
from typing import Any, NamedTuple, TextIO, cast

__all__ = [
    "get_current_parameter",
    "get_experiment_id",
    "get_next_parameter",
    "get_next_parameters",
    "get_sequence_id",
    "get_trial_id",
    "report_final_result",
    "report_intermediate_result",
]

Parameters = dict[str, Any]

#: A framed record (local) or a stdout record must stay below this many bytes, as in nni.
MAX_RECORD_BYTES = 1_000_000
#: nni polls every 3 s for a missing parameter file; a stat() every 0.1 s is cheap and starts phases sooner.
PARAMETER_POLL_S = 0.1
#: A parameter file that stays unparsable this long is a launcher bug, not a write in progress.
PARAMETER_GARBLED_S = 5.0
_TRUE = ("true", "True")
_TIME_FORMAT = "%Y-%m-%d %H:%M:%S"


class _Env(NamedTuple):
    """The trial environment, read once (at import, as nni does) so later changes do not mix modes."""

    platform: str | None
    exp_id: str | None
    trial_id: str | None
    sys_dir: str | None
    output_dir: str | None
    seq_id: str | None
    multi_phase: str | None
    reuse_mode: str | None
    command_channel: str | None

    @classmethod
    def read(cls, environ: Mapping[str, str]) -> _Env:
        names = (
            "NNI_PLATFORM",
            "NNI_EXP_ID",
            "NNI_TRIAL_JOB_ID",
            "NNI_SYS_DIR",
            "NNI_OUTPUT_DIR",
            "NNI_TRIAL_SEQ_ID",
            "MULTI_PHASE",
            "REUSE_MODE",
            "NNI_TRIAL_COMMAND_CHANNEL",
        )
        return cls(*(environ.get(name) for name in names))

    @property
    def standalone(self) -> bool:
        """nni runs without a launcher when NNI_PLATFORM is unset (or ``unittest``) and no channel is given."""
        return (self.platform is None or self.platform == "unittest") and not self.command_channel

    @property
    def stdout_metrics(self) -> bool:
        """Only local non-reuse trials write the metrics file; everyone else prints records."""
        return self.platform != "local" or self.reuse_mode in _TRUE


class _Channel:
    """Where records go: an O_APPEND fd on the local metrics file, or stdout lines."""

    def __init__(self, env: _Env) -> None:
        if env.command_channel:
            raise NotImplementedError(
                f"NNI_TRIAL_COMMAND_CHANNEL={env.command_channel!r}: the HTTP channel is not supported "
                "by trialstream_sdk; launch the trial without it (file/stdout protocol)"
            )
        if not env.sys_dir or not env.output_dir:
            raise RuntimeError("NNI_SYS_DIR and NNI_OUTPUT_DIR must both be set when NNI_PLATFORM is set")
        self.env = env
        os.makedirs(os.path.join(env.sys_dir, ".nni"), exist_ok=True)
        os.makedirs(env.output_dir, exist_ok=True)
        # Created even in stdout mode, like nni, so the trial directory looks the same to a launcher.
        flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC
        self.fd = os.open(os.path.join(env.sys_dir, ".nni", "metrics"), flags, 0o666)
        self.param_index = 0

    def send(self, record: dict[str, Any]) -> None:
        """Frame and emit one record atomically (one write call), or raise ValueError if too large."""
        text = json.dumps(record)  # ensure_ascii: characters == bytes
        if self.env.stdout_metrics:
            if len(text) >= MAX_RECORD_BYTES:
                raise ValueError(f"metric record of {len(text)} bytes exceeds the {MAX_RECORD_BYTES} limit")
            sys.stdout.write(f"NNISDK_MEb'{text}'\n")
            sys.stdout.flush()
            return
        data = text.encode("ascii") + b"\n"
        if len(data) >= MAX_RECORD_BYTES:
            raise ValueError(f"metric record of {len(data)} bytes exceeds the {MAX_RECORD_BYTES} limit")
        frame = memoryview(b"ME%06d" % len(data) + data)
        while frame:  # a regular file takes it in one call; loop only for the pathological short write
            frame = frame[os.write(self.fd, frame) :]

    def receive_parameter(self) -> dict[str, Any] | None:
        """Block until the launcher provides the next parameter file; None when no more phases exist."""
        index = self.param_index
        if index > 0 and self.env.multi_phase not in _TRUE:
            return None
        name = f"parameter_{index}.cfg" if index else "parameter.cfg"
        path = os.path.join(cast(str, self.env.sys_dir), name)
        if not os.path.isfile(path):
            self.send(
                {
                    "trial_job_id": self.env.trial_id,
                    "type": "REQUEST_PARAMETER",
                    "sequence": 0,
                    "parameter_index": index,
                }
            )
        garbled_since: float | None = None
        while True:
            try:
                with open(path, encoding="utf-8") as file:
                    text = file.read()
            except FileNotFoundError:
                text = ""
            if text.strip():
                try:
                    record = json.loads(text)
                    break
                except json.JSONDecodeError:  # the launcher may be mid-write; give it a moment
                    garbled_since = garbled_since or time.monotonic()
                    if time.monotonic() - garbled_since > PARAMETER_GARBLED_S:
                        raise
            time.sleep(PARAMETER_POLL_S)
        if not isinstance(record, dict) or "parameters" not in record:
            raise ValueError(f"{path}: expected a JSON object with a 'parameters' key")
        self.param_index += 1
        return record


def _number(value: Any, what: str) -> int | float:
    """Normalise int/float and numpy-like scalars as nni's json_tricks does; refuse what a tuner can't use."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{what} must be a number, got {type(value).__name__}: {value!r}")
    result: int | float = int(value) if isinstance(value, numbers.Integral) else float(value)
    if not math.isfinite(result):
        raise ValueError(f"{what} must be finite, got {value!r}")
    return result


def _json_default(value: Any) -> Any:
    """Let numpy-like scalars inside a metric dict serialise as plain numbers."""
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        return int(value) if isinstance(value, numbers.Integral) else float(value)
    raise TypeError(f"metric field of type {type(value).__name__} is not JSON serialisable: {value!r}")


def encode_metric(metric: Any) -> str:
    """Return the inner JSON string nni stores as a record's ``value`` (the double encoding)."""
    if isinstance(metric, Mapping):
        if "default" not in metric:
            raise TypeError(f"a dict metric needs a numeric 'default' key, got keys {list(metric)}")
        metric = {**metric, "default": _number(metric["default"], "metric['default']")}
        try:
            return json.dumps(metric, allow_nan=False, default=_json_default)
        except ValueError as exc:
            raise ValueError(f"metric contains NaN or infinity: {metric!r}") from exc
    return json.dumps(_number(metric, "metric"))


class _LogFileWriter(io.TextIOBase):
    """nni's stdout replacement on local: each printed line lands in trial.log as ``[time] PRINT line``."""

    def __init__(self, file: TextIO) -> None:
        self.file = file
        self.pending = ""

    def writable(self) -> bool:
        return True

    def write(self, s: str) -> int:
        *lines, self.pending = (self.pending + s).split("\n")
        if lines:
            stamp = datetime.now().strftime(_TIME_FORMAT)
            self.file.write("".join(f"[{stamp}] PRINT {line}\n" for line in lines))
            self.file.flush()
        return len(s)

    def flush(self) -> None:
        if self.pending and not self.file.closed:
            line, self.pending = self.pending, ""
            self.write(line + "\n")


def _init_trial_log(env: _Env) -> None:
    """Mirror nni's import-time logging: root logger to trial.log, and on local also stdout."""
    if not env.platform or env.platform == "unittest" or env.reuse_mode:
        return
    out_dir = env.output_dir or "."
    os.makedirs(out_dir, exist_ok=True)
    log_file = open(os.path.join(out_dir, "trial.log"), "a", encoding="utf-8")  # noqa: SIM115 (lives on)
    handler = logging.StreamHandler(log_file)
    log_format = "[%(asctime)s] %(levelname)s (%(name)s/%(threadName)s) %(message)s"
    handler.setFormatter(logging.Formatter(log_format, _TIME_FORMAT))
    root = logging.getLogger()
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    if env.platform == "local":
        sys.stdout = cast(TextIO, _LogFileWriter(log_file))


# --- module state (one trial per process, as in nni) ---
_env = _Env.read(os.environ)
_channel: _Channel | None = None
_params: dict[str, Any] | None = None
_intermediate_seq = 0
_lock = threading.Lock()
_experiment_id = _env.exp_id or "STANDALONE"
_trial_id = _env.trial_id or "STANDALONE"
_sequence_id = int(_env.seq_id) if _env.seq_id is not None else 0


def _get_channel() -> _Channel:
    global _channel
    if _channel is None:
        _channel = _Channel(_env)
    return _channel


def get_next_parameter() -> Parameters | None:
    """Block for this trial's next parameter set; None once a single-phase trial has had its one."""
    global _params
    if _env.standalone:
        warnings.warn(
            "Running trial code without a launcher (NNI_PLATFORM is unset): get_next_parameter() returns {}",
            RuntimeWarning,
            stacklevel=2,
        )
        _params = {"parameter_id": None, "parameters": {}}
    else:
        _params = _get_channel().receive_parameter()
    return None if _params is None else _params["parameters"]


get_next_parameters = get_next_parameter


def get_current_parameter(tag: str | None = None) -> Any:
    """The last parameter set (or one value of it), without asking the launcher again."""
    if _params is None:
        return None
    return _params["parameters"] if tag is None else _params["parameters"][tag]


def get_experiment_id() -> str:
    return _experiment_id


def get_trial_id() -> str:
    return _trial_id


def get_sequence_id() -> int:
    return _sequence_id


def _report(kind: str, metric: Any) -> None:
    global _intermediate_seq
    assert _params or _env.platform is None, f"nni.get_next_parameter() needs to be called before report_{kind}_result"
    value = encode_metric(metric)  # validate first: a refused metric must not consume a sequence number
    with _lock:
        sequence = _intermediate_seq if kind == "intermediate" else 0
        rtype = "PERIODICAL" if kind == "intermediate" else "FINAL"
        if _env.standalone:
            text = (
                f"Intermediate result: {metric}  (Index {sequence})"
                if kind == "intermediate"
                else f"Final result: {metric}"
            )
            print(f"[{datetime.now().strftime(_TIME_FORMAT)}] {text}", flush=True)
        else:
            _get_channel().send(
                {
                    "parameter_id": _params["parameter_id"] if _params else None,
                    "trial_job_id": _env.trial_id,
                    "type": rtype,
                    "sequence": sequence,
                    "value": value,
                }
            )
        if kind == "intermediate":
            _intermediate_seq += 1


def report_intermediate_result(metric: Any) -> None:
    """Report a per-epoch metric: a number, or a dict whose ``default`` is the number the tuner uses."""
    _report("intermediate", metric)


def report_final_result(metric: Any) -> None:
    """Report the trial's final metric: a number, or a dict with a numeric ``default``."""
    _report("final", metric)


_init_trial_log(_env)
