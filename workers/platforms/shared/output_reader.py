"""Reading a trial's output files where they are kept (on an SSH host, on a mounted share), by byte
offset, for the platforms whose workers follow a trial that runs elsewhere (remote, openpai).

Two files: its stdout, whose `NNISDK_MEb'...'` lines are metrics, and NNI's metrics file
(`ME%06d` records). What is read is committed with the offsets it was read up to
(`TrialControl.metrics(found, offsets=...)`) chunk by chunk, before the next read: the offsets move
only with what is committed, so a read that fails (a dropped connection, an unreadable mount) loses
nothing read before it, and a worker that takes the attempt over resumes exactly there.
"""

from __future__ import annotations

from collections.abc import Callable

from core.platform import ParsedMetric, TrialControl
from workers.platforms.shared.metrics import parse_records
from workers.platforms.shared.trial_contract import MetricBatch, StdoutMetricPump

READ_LIMIT = 1 << 20  # bytes of one file per read
METRICS_FILE = ".nni/metrics"

Read = Callable[[str, int, int], bytes]
"""(file name in the attempt's directory, offset, at most so many bytes) -> bytes; b"" at the end or
when the file does not exist yet. Any other failure is raised, and reading starts again there."""


class OutputReader:
    """One attempt's stdout and metrics file, read from the offsets committed for it."""

    def __init__(self, control: TrialControl, read: Read, stdout_name: str, read_limit: int = READ_LIMIT) -> None:
        self.control = control
        self._read = read
        self.stdout_name = stdout_name
        self.read_limit = read_limit
        offsets = control.offsets()
        self.stdout_offset = offsets.get("stdout", 0)
        self.metrics_offset = offsets.get("metrics", 0)
        self._metrics_rest = b""  # read after metrics_offset, not a whole record yet: never committed
        self._batch = MetricBatch(control)
        self._pump = StdoutMetricPump(self._batch)

    def pull(self, final: bool, stdout_size: int | None = None, metrics_size: int | None = None) -> None:
        """Read what the trial wrote since the committed offsets, committing each chunk's metrics with the
        offsets after it. Only whole stdout lines are taken (a follower that takes over starts on a
        line), all of them when `final` (the trial has ended). Sizes, where known (the remote monitor
        reports them), spare a read of a file that has not grown; None: read to the end."""
        limit = self.read_limit
        while stdout_size is None or self.stdout_offset < stdout_size:
            chunk = self._read(self.stdout_name, self.stdout_offset, limit)
            cut = chunk.rfind(b"\n") + 1
            whole = chunk if final or (cut == 0 and len(chunk) == limit) else chunk[:cut]  # a line longer than a read
            if not whole:
                break
            self._pump.feed(whole)
            self._commit([], stdout=len(whole))
            if len(chunk) < limit:
                break
        if final:
            self._pump.close()
            self._commit([])
        while metrics_size is None or self.metrics_offset + len(self._metrics_rest) < metrics_size:
            chunk = self._read(METRICS_FILE, self.metrics_offset + len(self._metrics_rest), limit)
            if not chunk:
                break
            last = final and len(chunk) < limit
            self._parse(self._metrics_rest + chunk, last)
            if len(chunk) < limit:
                break
        if final and self._metrics_rest:  # a record the trial never finished: rejected, not dropped
            self._parse(self._metrics_rest, True)

    def _parse(self, buffer: bytes, final: bool) -> None:
        position, found, problems = parse_records(buffer, final)
        for problem in problems:
            self.control.rejected(problem)
        self._commit(found, metrics=position)
        self._metrics_rest = buffer[position:]

    def _commit(self, found: list[ParsedMetric], stdout: int = 0, metrics: int = 0) -> None:
        """Report the metrics read with the offsets moved past them, in one transaction; then, and only
        then, the offsets move here too."""
        metrics_found = self._batch.take() + found
        if not (metrics_found or stdout or metrics):
            return
        offsets = {"stdout": self.stdout_offset + stdout, "metrics": self.metrics_offset + metrics}
        self.control.metrics(metrics_found, offsets=offsets)
        self.stdout_offset, self.metrics_offset = offsets["stdout"], offsets["metrics"]
