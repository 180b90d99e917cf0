"""The simulated OpenPAI cluster: the REST server v2's endpoints a client of jobs uses, and its jobs.

Endpoints (all under /rest-server/api/v2, all behind `Authorization: Bearer <token>`, else 401 with
OpenPAI's `{"code": "UnauthorizedUserError", "message": ...}`):
  GET  /virtual-clusters                       the virtual clusters, by name
  GET  /storages/{name}                        one storage config (404 NoStorageError)
  POST /jobs                                   a protocol v2 job as YAML (400 InvalidProtocolError, 403 for a
                                               virtual cluster the user may not use, 404 an unknown storage,
                                               409 ConflictJobError for a name taken); 202
  GET  /jobs?username=U                        the user's jobs (summaries)
  GET  /jobs/{user}~{name}                     a job's detail: jobStatus.state is WAITING, RUNNING, SUCCEEDED,
                                               FAILED, STOPPING or STOPPED (404 NoJobError)
  PUT  /jobs/{user}~{name}/executionType       {"value": "STOP"}: 202, the job STOPPING, then STOPPED

A job's task instances run as local processes (`sh -c` on its commands, in their own session). The
storages a job names are "mounted" by rewriting their container mount path (OpenPAI mounts a storage at
`/mnt/<name>`) to the storage's local directory in the commands: a local process cannot be given a
mount of its own without root, and the rewrite keeps the two paths different, so a platform that mixed
up its local and container mount points would fail here as on a real cluster.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field
from http import HTTPStatus
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

import yaml

from simulators.httpserver import LoopbackServer, QuietHandler
from simulators.paisim.protocol import ProtocolError, validate

API = "/rest-server/api/v2"
KILL_GRACE_S = 5.0
UNAUTHORIZED = "UnauthorizedUserError"


@dataclass(frozen=True)
class Storage:
    """A storage config: `path` is its share as this machine sees it; jobs see it at `mount_path`."""

    name: str
    path: Path

    @property
    def mount_path(self) -> str:
        return f"/mnt/{self.name}"


class PaiError(Exception):
    def __init__(self, status: HTTPStatus, code: str, message: str) -> None:
        super().__init__(message)
        self.status, self.code, self.message = status, code, message


@dataclass
class Job:
    user: str
    name: str
    protocol: dict[str, Any]
    raw: str
    state: str = "WAITING"
    execution_type: str = "START"
    processes: list[subprocess.Popen[bytes]] = field(default_factory=list)
    exit_code: int | None = None
    created: float = field(default_factory=time.time)
    launched: float | None = None
    completed: float | None = None

    def summary(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "username": self.user,
            "state": self.state,
            "subState": self.state,
            "executionType": self.execution_type,
            "retries": 0,
            "createdTime": int(self.created * 1000),
            "launchedTime": int(self.launched * 1000) if self.launched else None,
            "completedTime": int(self.completed * 1000) if self.completed else None,
            "virtualCluster": self.protocol.get("defaults", {}).get("virtualCluster", "default"),
            "appExitCode": self.exit_code,
        }

    def detail(self) -> dict[str, Any]:
        status = {key: value for key, value in self.summary().items() if key not in ("name", "virtualCluster")}
        return {"name": self.name, "jobStatus": {**status, "appTrackingUrl": ""}, "taskRoles": {}}


class SimulatedOpenpai:
    """One cluster: users and their tokens, virtual clusters, storages, jobs."""

    def __init__(
        self,
        users: dict[str, str],
        storages: list[Storage],
        virtual_clusters: tuple[str, ...] = ("default",),
    ) -> None:
        self.users = dict(users)
        self.tokens = {token: user for user, token in users.items()}
        self.storages = {storage.name: storage for storage in storages}
        self.virtual_clusters = virtual_clusters
        self.jobs: dict[str, Job] = {}
        self.requests: list[tuple[str, str, dict[str, str]]] = []  # method, path, headers: what clients sent
        self.hold = threading.Event()  # set: new jobs stay WAITING until released (a queue the cluster has)
        self._lock = threading.Lock()
        self._server = LoopbackServer(_handler(self))

    @property
    def url(self) -> str:
        return self._server.url()

    def start(self) -> None:
        self._server.start()

    def stop(self) -> None:
        self._server.stop()
        for job in list(self.jobs.values()):
            self._kill(job)

    # what a test does to the cluster

    def job(self, user: str, name: str) -> Job:
        return self.jobs[f"{user}~{name}"]

    def release(self) -> None:
        """Start every job held WAITING."""
        self.hold.clear()
        for job in list(self.jobs.values()):
            if job.state == "WAITING":
                self._launch(job)

    def stop_by_cluster(self, user: str, name: str) -> None:
        """The cluster (an admin, a preemption) stops a job: STOPPING, then STOPPED."""
        self._stop(self.job(user, name))

    # the REST server's work

    def authenticate(self, headers: Any) -> str:
        authorization = headers.get("Authorization", "")
        if not authorization.startswith("Bearer "):
            raise PaiError(HTTPStatus.UNAUTHORIZED, UNAUTHORIZED, "Guest is not allowed to do this operation.")
        user = self.tokens.get(authorization.removeprefix("Bearer "))
        if user is None:
            raise PaiError(HTTPStatus.UNAUTHORIZED, UNAUTHORIZED, "Your token is invalid.")
        return user

    def submit(self, user: str, body: str) -> None:
        try:
            protocol = validate(yaml.safe_load(body))
        except yaml.YAMLError as error:
            raise PaiError(HTTPStatus.BAD_REQUEST, "InvalidProtocolError", str(error)) from None
        except ProtocolError as error:
            raise PaiError(HTTPStatus.BAD_REQUEST, "InvalidProtocolError", str(error)) from None
        cluster = protocol.get("defaults", {}).get("virtualCluster") or "default"
        if cluster not in self.virtual_clusters:
            raise PaiError(
                HTTPStatus.FORBIDDEN, "ForbiddenUserError", f"User {user} is not allowed to do operation in {cluster}"
            )
        for storage in protocol.get("extras", {}).get("storages", []):
            if storage.get("name") not in self.storages:
                raise PaiError(HTTPStatus.NOT_FOUND, "NoStorageError", f"Storage {storage.get('name')} is not found.")
        key = f"{user}~{protocol['name']}"
        with self._lock:
            if key in self.jobs:
                raise PaiError(HTTPStatus.CONFLICT, "ConflictJobError", f"Job {key} already exists.")
            job = self.jobs[key] = Job(user, str(protocol["name"]), protocol, body)
        if not self.hold.is_set():
            self._launch(job)

    def get_job(self, key: str) -> Job:
        job = self.jobs.get(key)
        if job is None:
            raise PaiError(HTTPStatus.NOT_FOUND, "NoJobError", f"Job {key} is not found.")
        return job

    def execute(self, user: str, key: str, value: str) -> None:
        job = self.get_job(key)
        if job.user != user:
            message = f"User {user} is not allowed to execute job {key}."
            raise PaiError(HTTPStatus.FORBIDDEN, "ForbiddenUserError", message)
        if value == "STOP":
            self._stop(job)

    def _launch(self, job: Job) -> None:
        mounts = [self.storages[storage["name"]] for storage in job.protocol.get("extras", {}).get("storages", [])]
        with self._lock:
            if job.state != "WAITING":
                return
            for role_name, role in job.protocol["taskRoles"].items():
                for index in range(role.get("instances", 1)):
                    script = "\n".join(role["commands"])
                    for storage in mounts:
                        script = script.replace(f"{storage.mount_path}/", f"{storage.path}/")
                    environment = {
                        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
                        "HOME": os.environ.get("HOME", "/root"),
                        "LANG": "C.UTF-8",
                        "PAI_JOB_NAME": job.name,
                        "PAI_USER_NAME": job.user,
                        "PAI_CURRENT_TASK_ROLE_NAME": role_name,
                        "PAI_CURRENT_TASK_ROLE_CURRENT_TASK_INDEX": str(index),
                    }
                    job.processes.append(
                        subprocess.Popen(
                            ["/bin/sh", "-c", script],
                            env=environment,
                            cwd="/",
                            stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL,
                            start_new_session=True,
                        )
                    )
            job.state = "RUNNING"
            job.launched = time.time()
        threading.Thread(target=self._watch, args=(job,), daemon=True).start()

    def _watch(self, job: Job) -> None:
        """The job ends as its completion policy says (NNI's: any failure fails it, else all must succeed)."""
        codes = [process.wait() for process in job.processes]
        with self._lock:
            failed = [code for code in codes if code != 0]
            job.exit_code = failed[0] if failed else 0
            job.completed = time.time()
            if job.state == "STOPPING":
                job.state = "STOPPED"
            else:
                job.state = "FAILED" if failed else "SUCCEEDED"

    def _stop(self, job: Job) -> None:
        with self._lock:
            job.execution_type = "STOP"
            if job.state == "WAITING":
                job.state, job.completed = "STOPPED", time.time()
                return
            if job.state != "RUNNING":
                return
            job.state = "STOPPING"
        threading.Thread(target=self._kill, args=(job,), daemon=True).start()

    def _kill(self, job: Job) -> None:
        for process in job.processes:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGTERM)
        for process in job.processes:
            try:
                process.wait(KILL_GRACE_S)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)
                process.wait()


def _handler(cluster: SimulatedOpenpai) -> type[QuietHandler]:
    class Handler(QuietHandler):
        def do_GET(self) -> None:
            self._serve("GET")

        def do_POST(self) -> None:
            self._serve("POST")

        def do_PUT(self) -> None:
            self._serve("PUT")

        def _serve(self, method: str) -> None:
            body = self.read_body().decode()
            url = urlsplit(self.path)
            cluster.requests.append((method, url.path, dict(self.headers.items())))
            try:
                if not url.path.startswith(API):
                    raise PaiError(HTTPStatus.NOT_FOUND, "NotFoundError", f"{url.path} is not found.")
                user = cluster.authenticate(self.headers)
                status, answer = self._route(method, url.path.removeprefix(API), parse_qs(url.query), user, body)
            except PaiError as error:
                status, answer = error.status, {"code": error.code, "message": error.message}
            self.answer(status, json.dumps(answer).encode())

        def _route(
            self, method: str, path: str, query: dict[str, list[str]], user: str, body: str
        ) -> tuple[HTTPStatus, Any]:
            parts = [unquote(part) for part in path.strip("/").split("/")]
            if method == "GET" and parts == ["virtual-clusters"]:
                return HTTPStatus.OK, {name: {"status": "RUNNING"} for name in cluster.virtual_clusters}
            if method == "GET" and len(parts) == 2 and parts[0] == "storages":
                storage = cluster.storages.get(parts[1])
                if storage is None:
                    raise PaiError(HTTPStatus.NOT_FOUND, "NoStorageError", f"Storage {parts[1]} is not found.")
                return HTTPStatus.OK, {"name": storage.name, "share": True, "volumeName": storage.name, "type": "nfs"}
            if parts == ["jobs"] and method == "POST":
                if "yaml" not in self.headers.get("Content-Type", ""):
                    raise PaiError(HTTPStatus.BAD_REQUEST, "InvalidProtocolError", "send the protocol as text/yaml")
                cluster.submit(user, body)
                return HTTPStatus.ACCEPTED, {"status": 202, "message": f"Update job for user {user} successfully."}
            if parts == ["jobs"] and method == "GET":
                wanted = query.get("username", [None])[0]
                jobs = [job for job in cluster.jobs.values() if wanted is None or job.user == wanted]
                return HTTPStatus.OK, [job.summary() for job in jobs]
            if len(parts) == 2 and parts[0] == "jobs" and method == "GET":
                return HTTPStatus.OK, cluster.get_job(parts[1]).detail()
            if len(parts) == 3 and parts[0] == "jobs" and parts[2] == "executionType" and method == "PUT":
                value = json.loads(body or "{}").get("value")
                if value not in ("START", "STOP"):
                    raise PaiError(HTTPStatus.BAD_REQUEST, "InvalidParametersError", "value should be START or STOP")
                cluster.execute(user, parts[1], value)
                return HTTPStatus.ACCEPTED, {"status": 202, "message": f"Execute job {parts[1]} successfully."}
            raise PaiError(HTTPStatus.NOT_FOUND, "NotFoundError", f"{method} {API}{path} is not found.")

    return Handler
