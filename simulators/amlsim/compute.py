"""The workspace's compute target: each command job runs as a local process (`sh -c <command>`) in a fresh
directory holding its code asset (downloaded from Azurite), with the job's environment variables and
nothing of the test's own. Its stdout and stderr, merged as Azure ML merges them, are appended to the
job's `user_logs/std_log.txt` in the workspace's datastore as they are written."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from azure.storage.blob import BlobServiceClient

from simulators.amlsim.azurite import ACCOUNT_KEY

if TYPE_CHECKING:
    from simulators.amlsim.workspace import SimulatedWorkspace


def std_log_path(job_name: str) -> str:
    """Where Azure ML keeps a job's stdout in the workspace's artifact store (its default datastore)."""
    return f"ExperimentRun/dcid.{job_name}/user_logs/std_log.txt"


class Compute:
    def __init__(self, workspace: SimulatedWorkspace) -> None:
        self.workspace = workspace
        self.root = Path(tempfile.mkdtemp(prefix="amlsim-compute-"))
        self.hold = threading.Event()  # set: new jobs stay Queued until it is cleared
        self._released = threading.Condition()
        self._processes: dict[str, subprocess.Popen[bytes]] = {}
        self._canceled: set[str] = set()
        self._lock = threading.Lock()
        self._client: BlobServiceClient | None = None

    def blobs(self) -> BlobServiceClient:
        """Azurite by its path-style address (the simulator needs no proxy)."""
        if self._client is None:
            self._client = BlobServiceClient(
                self.workspace.azurite.url,
                credential={"account_name": "devstoreaccount1", "account_key": ACCOUNT_KEY},
                connection_verify=str(self.workspace.ca),
            )
        return self._client

    def submit(self, name: str) -> None:
        self.workspace.set_status(name, "Queued")
        threading.Thread(target=self._run, args=(name,), name=f"amlsim-job-{name}", daemon=True).start()

    def release_hold(self) -> None:
        with self._released:
            self.hold.clear()
            self._released.notify_all()

    def cancel(self, name: str) -> None:
        with self._lock:
            self._canceled.add(name)
            process = self._processes.get(name)
        if process is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGTERM)
        with self._released:
            self._released.notify_all()
        if process is None:
            self.workspace.set_status(name, "Canceled")

    def kill_all(self) -> None:
        with self._lock:
            processes = list(self._processes.values())
        for process in processes:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)

    def stop(self) -> None:
        self.kill_all()
        shutil.rmtree(self.root, ignore_errors=True)

    def _run(self, name: str) -> None:
        with self._released:
            self._released.wait_for(lambda: not self.hold.is_set() or name in self._canceled)
        with self._lock:
            if name in self._canceled:
                return
        job = self.workspace.job(name)["properties"]
        work = self.root / name
        self.workspace.set_status(name, "Preparing")
        try:
            self._download_code(str(job.get("codeId") or ""), work)
        except Exception as error:
            self.workspace.set_status(name, "Failed")
            print(f"amlsim: job {name}: its code could not be downloaded: {error!r}", file=sys.stderr)
            return
        environment = {
            "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '/usr/bin:/bin')}",
            "HOME": str(work),
            "LANG": "C.UTF-8",
            **{key: str(value) for key, value in (job.get("environmentVariables") or {}).items()},
        }
        log = self.blobs().get_blob_client(self.workspace.container, std_log_path(name))
        log.create_append_blob()
        with self._lock:
            if name in self._canceled:
                return
            process = subprocess.Popen(
                ["sh", "-c", job["command"]],
                cwd=work,
                env=environment,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
            self._processes[name] = process
        self.workspace.set_status(name, "Running")
        assert process.stdout is not None
        while data := os.read(process.stdout.fileno(), 64 * 1024):
            log.append_block(data)
        code = process.wait()
        with self._lock:
            self._processes.pop(name, None)
            canceled = name in self._canceled
        self.workspace.set_status(name, "Canceled" if canceled else "Completed" if code == 0 else "Failed")

    def _download_code(self, code_id: str, work: Path) -> None:
        """The code version's folder (`codeUri`, in the datastore) as the job's working directory."""
        work.mkdir(parents=True)
        parts = code_id.split("/")
        if "codes" not in parts:
            return
        index = parts.index("codes")
        key = ("codes", parts[index + 1], parts[index + 3])
        with self.workspace.lock:
            asset = self.workspace.assets[key]
        uri = urlsplit(asset["properties"]["codeUri"])
        container, _, prefix = uri.path.lstrip("/").partition("/")
        client = self.blobs().get_container_client(container)
        for blob in client.list_blobs(name_starts_with=prefix.rstrip("/") + "/"):
            target = work / blob.name[len(prefix.rstrip("/")) + 1 :]
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(client.download_blob(blob.name).readall())
