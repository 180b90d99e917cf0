"""Each experiment a manager keeps open has a process of its own, as each NNI experiment has its NNI manager.

NNI's tools act on an experiment through a pid: nnictl's registry and `/experiments-info` give it, `nnictl stop`
and the client's kill fallback (`nni.experiment.Experiment.stop`) send it SIGTERM, and the client's `stop()` waits
for it to end. The manager's own pid would make each of those stop every experiment it hosts, or wait forever.
So each experiment gets a stand-in: `cat`, reading a pipe from the manager and nothing else. It ends when the
manager closes the pipe (the experiment stopped, or the manager lets go of it) or dies (end of file), and a
signal from anyone else ending it means that experiment, and it alone, is to stop. It runs in a session of
its own, so a Ctrl-C meant for the manager's terminal never reaches it, and the manager reaps it as soon as it
ends, so whoever waits for its pid (psutil polls a non-child's pid) sees it gone at once.
"""

from __future__ import annotations

import shutil
import subprocess
import threading
from collections.abc import Callable

RELEASE_WAIT_S = 5.0  # `cat` ends as soon as it reads the end of its input


class ExperimentProcess:
    def __init__(self, experiment_id: str, on_ended: Callable[[ExperimentProcess], None]) -> None:
        """Start it; `on_ended` is called (on its waiting thread) if it ends without `release`."""
        self.experiment_id = experiment_id
        self._on_ended = on_ended
        self._released = False
        self._popen = subprocess.Popen(
            [f"trialstream-experiment-{experiment_id}"],  # what `ps` shows: argv[0], `cat` runs all the same
            executable=shutil.which("cat") or "/bin/cat",
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            env={},  # nothing of the manager's: its secrets would be readable in this process's /proc
            start_new_session=True,
        )
        self._waiter = threading.Thread(target=self._wait, name=f"process-{experiment_id}", daemon=True)
        self._waiter.start()

    @property
    def pid(self) -> int:
        return self._popen.pid

    def release(self) -> None:
        """End it on the manager's behalf (no `on_ended`), reaped before this returns."""
        self._released = True
        assert self._popen.stdin is not None
        self._popen.stdin.close()
        self._waiter.join(RELEASE_WAIT_S)

    def _wait(self) -> None:
        self._popen.wait()  # reaps it: no zombie keeps its pid alive for those waiting on it
        if not self._released:
            self._on_ended(self)
