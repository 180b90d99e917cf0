"""Our entry in nnictl's experiment registry (`~/nni-experiments/.experiment`), so `nnictl list/stop/view` find us.

The file is shared with nnictl and NNI's Node manager, which may hold other experiments' entries: every write is a
read-modify-write under NNI's own lock protocol that leaves those entries as NNI wrote them (`json.dump`, indent 4).
"""

from __future__ import annotations

import json
import os
import random
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from time import sleep
from typing import Any

from schemas.nni_rest import ExperimentMetadata

REGISTRY_PATH_DEFAULT = Path("~/nni-experiments/.experiment")
LOCK_STALE_S = 2.0  # NNI's `stale=2` (Python) and `lockStale = 2000` (Node): an older lock file is ignored
POLL_S = 0.05  # NNI's poll interval, both sides
SETTLE_S = 0.02  # how long after taking the lock we look again for a lock file NNI created on an earlier check

_THREADS = threading.Lock()


class RegistryLockTimeout(TimeoutError):
    """The registry stayed locked by another writer (nnictl, NNI's manager, another of us) past our deadline."""


class NnictlRegistry:
    """nnictl's registry file; `path` defaults to NNI's fixed location, expanded when used (so HOME is honoured)."""

    def __init__(self, path: Path | None = None, *, lock_timeout: float = 10.0) -> None:
        self._path = path
        self.lock_timeout = lock_timeout

    @property
    def path(self) -> Path:
        return (self._path or REGISTRY_PATH_DEFAULT).expanduser()

    def register(self, entry: ExperimentMetadata) -> None:
        """Add or replace our entry."""

        def change(experiments: dict[str, Any]) -> bool:
            experiments[entry.id] = entry.model_dump(by_alias=True)
            return True

        self._modify(change)

    def update(self, experiment_id: str, status: str, end_time: int | None) -> None:
        """Set status and endTime ("N/A" while running), as NNI's manager does; no-op once the entry is gone."""

        def change(experiments: dict[str, Any]) -> bool:
            entry = experiments.get(experiment_id)
            if not isinstance(entry, dict):
                return False
            entry.update(status=status, endTime="N/A" if end_time is None else end_time)
            return True

        self._modify(change)

    def remove(self, experiment_id: str) -> None:
        self._modify(lambda experiments: experiments.pop(experiment_id, None) is not None)

    def entries(self) -> dict[str, dict[str, Any]]:
        """All entries, ours and NNI's, read under the lock (NNI writes in place, so an unlocked read can be torn)."""
        if not self.path.parent.is_dir():
            return {}
        with self._locked():
            return self._read()

    def _modify(self, change: Callable[[dict[str, Any]], bool]) -> None:
        """Locked read-modify-write; written only if `change` says it changed something."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self._locked():
            experiments = self._read()
            if change(experiments):
                self._write(experiments)

    def _read(self) -> dict[str, Any]:
        """As nnictl's `read_file`: a missing or unparseable file is `{}` (and the next write replaces it)."""
        try:
            experiments = json.loads(self.path.read_text(encoding="utf-8"))
        except (FileNotFoundError, ValueError):
            return {}
        return experiments if isinstance(experiments, dict) else {}

    def _write(self, experiments: dict[str, Any]) -> None:
        """NNI writes in place, so a crash mid-write leaves a file that reads as `{}`, losing every entry; we write a
        temporary file beside it and rename it over (readers, all locked, see the old file or the new one)."""
        path = self.path
        temporary = path.with_name(f"{path.name}.tmp.{os.getpid()}.{random.getrandbits(32):08x}")
        fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        try:
            if path.exists():
                os.fchmod(fd, path.stat().st_mode & 0o7777)
            with os.fdopen(fd, "w", encoding="utf-8") as file:
                json.dump(experiments, file, indent=4)
                file.flush()
                os.fsync(file.fileno())
            os.replace(temporary, path)
        except BaseException:
            temporary.unlink(missing_ok=True)
            raise

    def _fresh_locks(self, exclude: Path | None = None) -> list[Path]:
        """Lock files under LOCK_STALE_S old, found as NNI finds them: glob `<file>.lock.*`, then each one's mtime."""
        fresh = []
        for lock in self.path.parent.glob(f"{self.path.name}.lock.*"):
            try:
                if lock != exclude and time.time() - lock.stat().st_mtime < LOCK_STALE_S:
                    fresh.append(lock)
            except FileNotFoundError:
                continue
        return fresh

    @contextmanager
    def _locked(self) -> Iterator[None]:
        """Hold `<file>.lock.<pid>`, the name nnictl and NNI's manager use. They check for fresh lock files and then
        create theirs (O_EXCL); we create ours first and check after, twice, backing off on a tie: so two of us never
        both proceed, and NNI only could if its check and its create were more than SETTLE_S apart."""
        deadline = time.monotonic() + self.lock_timeout
        if not _THREADS.acquire(timeout=self.lock_timeout):  # our threads share the one pid-named lock file
            raise RegistryLockTimeout(f"{self.path}: another thread of this process held it for {self.lock_timeout} s")
        own = self.path.with_name(f"{self.path.name}.lock.{os.getpid()}")
        try:
            while True:
                if not self._fresh_locks():
                    try:
                        os.close(os.open(own, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_TRUNC))
                    except FileExistsError:  # NNI's lock in a thread of ours, or left by a dead process with our pid
                        with suppress(FileNotFoundError):
                            if time.time() - own.stat().st_mtime >= LOCK_STALE_S:
                                own.unlink()
                        continue
                    if not self._fresh_locks(exclude=own):
                        sleep(SETTLE_S)
                        if not self._fresh_locks(exclude=own):
                            break
                    own.unlink(missing_ok=True)
                if time.monotonic() > deadline:
                    held_by = ", ".join(str(lock) for lock in self._fresh_locks()) or "lock files that came and went"
                    raise RegistryLockTimeout(f"{self.path} stayed locked for {self.lock_timeout} s by {held_by}")
                sleep(POLL_S * random.uniform(0.5, 1.5))
            try:
                yield
            finally:
                own.unlink(missing_ok=True)
        finally:
            _THREADS.release()
