"""A trial's output and files, read wherever it ran: what `trialstream trials logs` and the manager's API
(NNI's `/trial-file`, our `/output`) both need.

Output is read through the trial's platform (`read_output`), since a remote trial's stdout is on its host.
Other files are read only from under the trial's working directory on this machine: a name that resolves
outside it (`..`, an absolute path, a symlink out) is refused. The bytes are the trial's, never decoded.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import redis

from core.assignments import load_assignment
from core.platform import OutputStream, OutputUnavailable, Platform, TrialAssignment
from core.registry import add_platforms, platform_class
from core.settings import Settings
from schemas.trial import TrialJobDetail

# NNI's names for a trial's output. `trial.log` is first the file of that name in the trial's directory (what NNI
# serves: `nni`'s log and what the trial printed, on local), else its stdout.
OUTPUT_TAIL = 64 * 1024  # the end of an attempt's stdout the timeline keeps
OUTPUT_STREAMS: dict[str, OutputStream] = {"trial.log": "stdout", "stdout": "stdout", "stderr": "stderr"}
FILE_CHUNK_BYTES = 64 * 1024


class TrialFileRefused(LookupError):
    """The name is not a file under the trial's working directory (or leads out of it)."""


def started_attempt(trial: TrialJobDetail) -> int:
    """The latest attempt that started: a retry still waiting has not, its predecessor's output stands."""
    return trial.attempt if trial.start_time is not None else max(1, trial.attempt - 1)


def has_started(trial: TrialJobDetail) -> bool:
    return trial.url is not None or trial.start_time is not None


def output_chunks(
    settings: Settings, client: redis.Redis, trial: TrialJobDetail, stream: OutputStream, offset: int = 0
) -> Iterator[bytes]:
    """What the trial's latest started attempt wrote to `stream` from `offset` on, chunk by chunk, up to
    what has been written so far. Raises OutputUnavailable (before the first chunk) when it cannot be read."""
    if not has_started(trial):
        raise OutputUnavailable(f"trial {trial.id} has not started: no output")
    add_platforms(settings.platforms)
    platform = platform_class(trial.platform)(settings, client)
    try:
        yield from _read_all(platform, client, trial, stream, offset)
    finally:
        platform.close()


def _read_all(
    platform: Platform[Any], client: redis.Redis, trial: TrialJobDetail, stream: OutputStream, offset: int
) -> Iterator[bytes]:
    read_output, assignment = output_reader(platform, client, trial, started_attempt(trial))
    url = trial.url or trial.working_directory
    while chunk := read_output(assignment, url, stream, offset):
        offset += len(chunk)
        yield chunk


ReadOutput = Callable[[TrialAssignment[Any], str, OutputStream, int], bytes]


def output_reader(
    platform: Platform[Any], client: redis.Redis, trial: TrialJobDetail, attempt: int
) -> tuple[ReadOutput, TrialAssignment[Any]]:
    """The platform's `read_output` and the assignment of the trial's `attempt` it reads with; OutputUnavailable
    where either is missing."""
    read_output = getattr(platform, "read_output", None)  # optional for third-party platforms
    if read_output is None:
        raise OutputUnavailable(f"platform {platform.name} does not offer its trials' output")
    try:
        assignment = load_assignment(client, platform, trial.experiment_id, trial.id, attempt)
    except LookupError as missing:  # a log imported from elsewhere may lack the key that finds the submission
        raise OutputUnavailable(f"{missing}: where its output is cannot be told") from None
    return read_output, assignment


def output_tail(chunks: Iterable[bytes], limit: int = OUTPUT_TAIL) -> dict[str, Any]:
    """The last `limit` bytes of `chunks` as text, and whether more came before them: what the timeline
    shows of an attempt's output (its page and its file)."""
    tail, truncated = b"", False
    for chunk in chunks:
        tail += chunk
        if len(tail) > limit:
            tail, truncated = tail[-limit:], True
    return {"text": tail.decode(errors="replace"), "truncated": truncated}


def trial_file(trial: TrialJobDetail, name: str) -> Path:
    """The file `name` under the trial's working directory, which it must not leave once resolved."""
    base = Path(trial.working_directory).resolve()
    if not name or Path(name).is_absolute():
        raise TrialFileRefused(f"{name!r} is not a file of trial {trial.id}")
    target = (base / name).resolve()
    if not target.is_relative_to(base) or not target.is_file():
        raise TrialFileRefused(f"{name!r} is not a file of trial {trial.id}")
    return target


def file_chunks(path: Path) -> Iterator[bytes]:
    with path.open("rb") as source:
        while chunk := source.read(FILE_CHUNK_BYTES):
            yield chunk
