"""How trialstream's long-running processes log: text for people, or JSON lines for collectors.

A record logged with `extra={"experiment": ..., "trial": ...}` carries those ids in its JSON object.
In JSON mode every line on stderr is a JSON object: what other code writes there directly (a note
printed for the user, a warning, a thread's traceback) is turned into a record too, so a collector
never meets a line it cannot parse.
"""

from __future__ import annotations

import io
import json
import logging
import re
import sys
import threading
import time
from typing import Literal, TextIO

_IDS = ("experiment", "trial")
_ANSI = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]")  # colours a console may add to what it prints
_stray = logging.getLogger("stderr")


class JsonLines(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        line = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        line.update({name: str(getattr(record, name)) for name in _IDS if getattr(record, name, None) is not None})
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return json.dumps(line, ensure_ascii=False)


class StrayLines(io.TextIOBase):
    """Stands in for sys.stderr in JSON mode: each line written to it becomes a WARNING record of
    logger `stderr` (as Celery treats redirected output: nothing that bypassed logging is routine).
    Lines written while such a record is being handled go to the real stream as they are, so a
    failing handler cannot loop."""

    def __init__(self, original: TextIO) -> None:
        self.original = original
        self._pending = ""
        self._lock = threading.Lock()
        self._inside = threading.local()

    def writable(self) -> bool:
        return True

    def fileno(self) -> int:
        return self.original.fileno()  # for code that hands stderr to a child process or faulthandler

    def write(self, text: str) -> int:
        if getattr(self._inside, "active", False):
            return self.original.write(text)
        with self._lock:
            lines = (self._pending + text).split("\n")
            self._pending = lines.pop()
        self._inside.active = True
        try:
            for line in lines:
                if line := _ANSI.sub("", line).rstrip():
                    _stray.warning("%s", line)
        finally:
            self._inside.active = False
        return len(text)


def configure_logging(log_format: Literal["text", "json"], level: int = logging.INFO) -> None:
    stderr = sys.stderr.original if isinstance(sys.stderr, StrayLines) else sys.stderr
    handler = logging.StreamHandler(stderr)
    if log_format == "json":
        handler.setFormatter(JsonLines())
        logging.captureWarnings(True)
        threading.excepthook = _log_thread_exception
        sys.stderr = StrayLines(stderr)
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)


def _log_thread_exception(args: threading.ExceptHookArgs) -> None:
    """A thread's uncaught exception as one record, its traceback in `exception`."""
    if args.exc_type is SystemExit:
        return
    exc_info = (args.exc_type, args.exc_value or args.exc_type(), args.exc_traceback)
    thread = args.thread.name if args.thread is not None else "unknown"
    logging.getLogger("threading").error("uncaught exception in thread %s", thread, exc_info=exc_info)
