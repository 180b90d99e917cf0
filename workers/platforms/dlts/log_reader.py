"""A job's log read through the dashboard's API by cursor: its metrics, committed with the cursor, and the
bootstrap's exit line (DLTS tells no exit code)."""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from typing import Any

from core.platform import (
    TrialControl,
)
from workers.platforms.dlts.client import Dashboard
from workers.platforms.shared.trial_contract import (
    MetricBatch,
    StdoutMetricPump,
)

log = logging.getLogger(__name__)

EXIT_MARKER = b"NNI_DLTS_EXIT "

MAX_MARKER_LINE = 64 * 1024


def _cursor_offsets(cursor: str | None) -> dict[str, int] | None:
    """The log cursor (`<ms>.<seq>`, elasticsearch's sort values) as the integers offsets are kept as."""
    parts = (cursor or "").split(".")
    if len(parts) != 2 or not all(part.isdigit() for part in parts):
        return None
    return {"log_ms": int(parts[0]), "log_seq": int(parts[1])}


def _offsets_cursor(offsets: Mapping[str, int]) -> str | None:
    if "log_ms" not in offsets or "log_seq" not in offsets:
        return None
    return f"{offsets['log_ms']}.{offsets['log_seq']}"


class LogReader:
    """The job's log, page after page from the committed cursor: metric lines go to the trial as they
    are read, with the cursor they were read up to; the bootstrap's exit line is kept."""

    def __init__(self, dashboard: Dashboard, job_id: str, control: TrialControl) -> None:
        self.dashboard, self.job_id, self.control = dashboard, job_id, control
        self.cursor = _offsets_cursor(control.offsets())
        self.batch = MetricBatch(control)
        self.pump = StdoutMetricPump(self.batch)
        self.line = bytearray()
        self.too_long = False
        self.exit: dict[str, Any] | None = None

    def read(self) -> None:
        """Every page there is now."""
        while True:
            page = self.dashboard.log(self.job_id, self.cursor)
            if page is None:
                return
            text, cursor = page
            data = text.encode()
            self.pump.feed(data)
            self._scan(data)
            found = self.batch.take()
            at_line_end = not self.line and not self.too_long  # else the line's start would be skipped
            offsets = _cursor_offsets(cursor) if at_line_end else None
            if found or offsets:
                self.control.metrics(found, offsets=offsets)
            if cursor is None or cursor == self.cursor:
                return
            self.cursor = cursor

    def _scan(self, data: bytes) -> None:
        for piece in data.splitlines(keepends=True):
            if not self.too_long:
                self.line += piece
                if len(self.line) > MAX_MARKER_LINE:
                    self.too_long, self.line = True, bytearray()
            if piece.endswith(b"\n"):
                if not self.too_long and self.line.startswith(EXIT_MARKER):
                    try:
                        self.exit = json.loads(bytes(self.line[len(EXIT_MARKER) :]))
                    except ValueError:
                        log.warning("job %s: an unreadable exit line", self.job_id)
                self.line, self.too_long = bytearray(), False
