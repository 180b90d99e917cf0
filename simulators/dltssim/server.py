"""A DLTS dashboard as NNI's client spoke to it: a real HTTP server on loopback with the endpoints,
query parameters, bodies and answers of DLWorkspace's `src/dashboard/server/api` (and of the RestAPI
behind it), where every job runs as a local process (its `cmd` under `sh -c`, its image ignored).

What it keeps from DLWorkspace:
- auth by `email` and `password` in the query (`token` as the older name), the password being the hex
  of md5(`email:masterToken`); a wrong one is 403 "Invalid token", none at all 403 "Forbidden";
- `/api/clusters/:clusterId` with `.default` as the first cluster, an unknown one 404 "Cluster is not
  found" (before auth: it is a router param); an unknown team 404 "Team is not found";
- POST jobs: a body without `team` (or `vcName`) is 400; the RestAPI's refusals are a 200 carrying
  `{"error": "Cannot create job!..."}` (no jobName, a team the user may not use, a gpuType it has not);
- job status as GetJobDetailV2 has it (`{}` for a job that is not the caller's or does not exist),
  `jobStatusDetail` a list whose first item has `startedAt` once running; PUT status `killing`,
  `pausing`, `queued` (resume), `approved`, anything else 400 "Invalid status";
- the log endpoint as its elasticsearch backend answers: 100 lines per call after `cursor`
  (`<ms>.<seq>`, the sort values of the last line), `{"log": {podName: text}, "cursor": ...}`, and a
  404 when there is nothing after the cursor.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import signal
import subprocess
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

from simulators.httpserver import JSON, LoopbackServer, QuietHandler

LOG_PAGE = 100  # lines per log call: JobRestAPIUtils.GetJobLog's default size
ENDED = ("finished", "failed", "killed", "error")


def token_for(email: str, master_token: str) -> str:
    """The password DLWorkspace gives a user: User.generateToken, in hex."""
    return hashlib.md5(f"{email}:{master_token}".encode()).hexdigest()


class HttpError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


@dataclass
class SimJob:
    job_id: str
    cluster: str
    team: str
    user: str
    params: dict[str, Any]
    status: str = "queued"
    detail: list[dict[str, Any]] = field(default_factory=list)
    error: str | None = None
    created: float = field(default_factory=time.time)
    lines: list[tuple[int, str]] = field(default_factory=list)  # (ms, line): the job's log documents
    process: subprocess.Popen[bytes] | None = None
    exit_code: int | None = None
    runs: int = 0

    def as_detail(self) -> dict[str, Any]:
        return {
            "jobId": self.job_id,
            "jobName": self.params.get("jobName"),
            "userName": self.user,
            "vcName": self.team,
            "jobStatus": self.status,
            "jobStatusDetail": self.detail,
            "jobType": self.params.get("jobType", "training"),
            "jobTime": datetime.fromtimestamp(self.created, UTC).isoformat(),
            "jobParams": self.params,
            "errorMsg": self.error,
        }


class DltsSimulator:
    """`clusters`: cluster id -> team -> the GPU type of its nodes; `access`: email -> the teams it may use."""

    def __init__(
        self,
        root: Path,
        clusters: dict[str, dict[str, str]] | None = None,
        access: dict[str, set[str]] | None = None,
        master_token: str = "the-dashboard-s-master-token",
    ) -> None:
        self.root = root
        self.clusters = clusters or {"eastus-p40": {"platform": "P40", "research": "V100"}}
        self.access = access or {"alice@example.com": {"platform"}}
        self.master_token = master_token
        self.jobs: dict[str, SimJob] = {}
        self.requests: list[tuple[str, str, dict[str, str]]] = []  # method, path, query: the wire as sent
        self.lock = threading.Lock()
        self.changed = threading.Condition(self.lock)
        self._held = False
        self._server: LoopbackServer | None = None

    # the test's side

    @property
    def url(self) -> str:
        assert self._server is not None
        return f"{self._server.url()}/"

    def password(self, email: str) -> str:
        return token_for(email, self.master_token)

    def start(self) -> None:
        simulator = self

        class Handler(_Handler):
            sim = simulator

        self._server = LoopbackServer(Handler)
        self._server.start("dltssim")

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop()
        with self.lock:
            processes = [job.process for job in self.jobs.values() if job.process and job.process.poll() is None]
        for process in processes:
            _signal(process, signal.SIGKILL)
            process.wait()

    def hold_queue(self, held: bool) -> None:
        """While held, new jobs stay `queued` (a busy cluster); released, the queued ones start."""
        with self.lock:
            self._held = held
            queued = [job for job in self.jobs.values() if job.status == "queued"] if not held else []
        for job in queued:
            self._run(job)

    def pause(self, job_id: str) -> None:
        """What an administrator's pause does: the job's pod goes, the job is `paused`."""
        self._set_status(self.jobs[job_id], "pausing")

    def wait_for(self, probe: Callable[[], bool], timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        with self.changed:
            while not probe():
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError("timed out waiting on the simulated DLTS cluster")
                self.changed.wait(left)

    def job_named(self, name: str) -> SimJob | None:
        with self.lock:
            return next((job for job in self.jobs.values() if job.params.get("jobName") == name), None)

    # the cluster

    def cluster_id(self, cluster: str) -> str:
        if cluster == ".default":
            cluster = next(iter(self.clusters))
        if cluster not in self.clusters:
            raise HttpError(404, "Cluster is not found")
        return cluster

    def user(self, query: dict[str, str]) -> str:
        """middlewares/user.js: by email and password (or token); nothing else is accepted here."""
        if "email" in query:
            email = query["email"]
            password = query.get("password", query.get("token"))
            if password:
                try:
                    given = bytes.fromhex(password)
                except ValueError:
                    given = b""
                if given != hashlib.md5(f"{email}:{self.master_token}".encode()).digest():
                    raise HttpError(403, "Invalid token")
                return email
        raise HttpError(403, "Forbidden")

    def team(self, cluster: str, team: str, user: str) -> dict[str, Any]:
        """GetVC as the v1 team endpoint passes it on: `metadata` a JSON string keyed by GPU type."""
        gpu_type = self.clusters[cluster].get(team)
        if gpu_type is None or team not in self.access.get(user, set()):
            raise HttpError(404, "Team is not found")
        return {
            "vcName": team,
            "quota": json.dumps({gpu_type: 8}),
            "metadata": json.dumps({gpu_type: {"num_gpu_per_node": 4}}),
            "AvaliableJobNum": sum(1 for job in self.jobs.values() if job.team == team and job.status == "running"),
        }

    def submit(self, cluster: str, user: str, body: Any) -> str:
        if not isinstance(body, dict):
            raise HttpError(400, " should be object")
        if not body.get("team") and body.get("vcName"):
            body["team"] = body["vcName"]
        if not isinstance(body.get("team"), str):
            raise HttpError(400, " should have required property 'team'")
        job = dict(body, userName=user, familyToken=str(uuid.uuid4()), isParent=1)
        if not str(job.get("jobName", "")).strip():
            return json.dumps({"error": "Cannot create job!ERROR: Job name cannot be empty"})
        team = str(job.get("vcName") or job["team"])
        if team not in self.access.get(user, set()) or team not in self.clusters[cluster]:
            return json.dumps({"error": "Cannot create job!Access Denied!"})
        if job.get("gpuType") != self.clusters[cluster][team]:
            return json.dumps({"error": f"Cannot create job!no GPU of type {job.get('gpuType')!r} in team {team}"})
        created = SimJob(job_id=str(uuid.uuid4()), cluster=cluster, team=team, user=user, params=job)
        with self.lock:
            self.jobs[created.job_id] = created
            held = self._held
            self.changed.notify_all()
        if not held:
            self._run(created)
        return json.dumps({"jobId": created.job_id})

    def own_job(self, cluster: str, job_id: str, user: str) -> SimJob | None:
        job = self.jobs.get(job_id)
        return job if job is not None and job.cluster == cluster and job.user == user else None

    def set_status(self, cluster: str, job_id: str, user: str, status: Any) -> str:
        if status not in ("approved", "killing", "pausing", "queued"):
            raise HttpError(400, "Invalid status")
        job = self.own_job(cluster, job_id, user)
        if job is None or job.status in ENDED:
            verb = {"killing": "Kill", "pausing": "Pause", "queued": "Resume", "approved": "Approve"}[status]
            return json.dumps({"result": f"Cannot {verb} the job. Job ID:{job_id}"})
        if status == "queued" and job.status == "paused":
            with self.lock:
                job.status = "queued"
            self._run(job)
        elif status in ("killing", "pausing"):
            self._set_status(job, status)
        return json.dumps({"result": "Success, the job is scheduled to be terminated."})

    def log(self, cluster: str, job_id: str, user: str, cursor: str | None) -> dict[str, Any]:
        job = self.own_job(cluster, job_id, user)
        start = 0
        if cursor:
            try:
                start = int(cursor.split(".", 2)[1]) + 1
            except (IndexError, ValueError):
                start = 0  # TryParseCursor failing: searched from the start
        with self.lock:
            page = list(enumerate(job.lines))[start : start + LOG_PAGE] if job is not None else []
        if not page:
            raise HttpError(404, "Not Found")
        last, (ms, _) = page[-1]
        assert job is not None
        return {"log": {job.job_id: "".join(line for _, (_, line) in page)}, "cursor": f"{ms}.{last}"}

    def team_jobs(self, cluster: str, team: str, user: str, everyone: bool, limit: int) -> list[dict[str, Any]]:
        with self.lock:
            jobs = [
                job
                for job in self.jobs.values()
                if job.cluster == cluster and job.team == team and (everyone or job.user == user)
            ]
        jobs.sort(key=lambda job: job.created, reverse=True)
        return [job.as_detail() for job in jobs[:limit]]

    # jobs as processes

    def _run(self, job: SimJob) -> None:
        work = self.root / job.job_id
        (work / "home").mkdir(parents=True, exist_ok=True)
        cmd = str(job.params.get("cmd") or "")
        env = {
            "PATH": os.environ.get("PATH", "/usr/local/bin:/usr/bin:/bin"),
            "HOME": str(work / "home"),
            "DLWS_JOB_ID": job.job_id,
            "DLTS_JOB_ID": job.job_id,
            "DLWS_USER_EMAIL": job.user,
            "DLWS_VC_NAME": job.team,
            "DLWS_NUM_GPU_PER_WORKER": str(job.params.get("resourcegpu", 0)),
            "DLTS_LAUNCH_CMD": cmd,
        }
        process = subprocess.Popen(
            ["sh", "-c", cmd],
            cwd=work / "home",
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        started = datetime.now(UTC).isoformat()
        with self.lock:
            job.process, job.exit_code, job.runs = process, None, job.runs + 1
            job.status = "running"
            job.detail = [{"startedAt": started, "message": f"started at: {started}", "podName": job.job_id}]
            self.changed.notify_all()
        threading.Thread(target=self._follow, args=(job, process), name=f"job-{job.job_id}", daemon=True).start()

    def _follow(self, job: SimJob, process: subprocess.Popen[bytes]) -> None:
        assert process.stdout is not None
        for raw in iter(process.stdout.readline, b""):
            with self.lock:
                job.lines.append((int(time.time() * 1000), raw.decode(errors="replace")))
                self.changed.notify_all()
        code = process.wait()
        finished = datetime.now(UTC).isoformat()
        with self.lock:
            job.exit_code = code
            if job.status == "killing":
                job.status = "killed"
            elif job.status == "pausing":
                job.status = "paused"
            elif job.status == "running":
                job.status = "finished" if code == 0 else "failed"
                if code != 0:
                    job.error = f"the job's container exited with code {code}"
            for item in job.detail:
                item.setdefault("finishedAt", finished)
            self.changed.notify_all()

    def _set_status(self, job: SimJob, status: str) -> None:
        with self.lock:
            process = job.process if job.status == "running" else None
            if job.status in ("queued", "paused") and status == "killing":
                job.status = "killed"
            elif job.status == "running":
                job.status = status
            self.changed.notify_all()
        if process is not None:
            _signal(process, signal.SIGTERM)


def _signal(process: subprocess.Popen[bytes], signum: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signum)


class _Handler(QuietHandler):
    sim: DltsSimulator  # the requests are kept in `sim.requests`

    def do_GET(self) -> None:
        self._serve("GET")

    def do_POST(self) -> None:
        self._serve("POST")

    def do_PUT(self) -> None:
        self._serve("PUT")

    def _serve(self, method: str) -> None:
        split = urlsplit(self.path)
        query = {key: values[-1] for key, values in parse_qs(split.query, keep_blank_values=True).items()}
        raw = self.read_body()
        with self.sim.lock:
            self.sim.requests.append((method, split.path, query))
        try:
            status, body = self._route(method, [part for part in split.path.split("/") if part], query, raw)
            payload, kind = (body.encode(), "application/json") if isinstance(body, str) else _json(body)
        except HttpError as error:
            status, payload, kind = error.status, error.message.encode(), "text/plain; charset=utf-8"
        self.answer(status, payload, kind)

    def _route(self, method: str, parts: list[str], query: dict[str, str], raw: bytes) -> tuple[int, Any]:
        sim = self.sim
        match method, parts:
            case "GET", ["api", "teams", team, "clusters", cluster]:
                cluster = sim.cluster_id(cluster)
                return 200, sim.team(cluster, team, sim.user(query))
            case "POST", ["api", "clusters", cluster, "jobs"]:
                cluster = sim.cluster_id(cluster)
                user = sim.user(query)
                try:
                    body = json.loads(raw or b"null")
                except ValueError:
                    raise HttpError(400, "invalid JSON body") from None
                return 200, sim.submit(cluster, user, body)
            case "GET", ["api", "v2", "clusters", cluster, "jobs", job_id] | [
                "api",
                "clusters",
                cluster,
                "jobs",
                job_id,
            ]:
                cluster = sim.cluster_id(cluster)
                job = sim.own_job(cluster, job_id, sim.user(query))
                with sim.lock:
                    return 200, job.as_detail() if job is not None else {}
            case "PUT", ["api", "clusters", cluster, "jobs", job_id, "status"]:
                cluster = sim.cluster_id(cluster)
                user = sim.user(query)
                try:
                    body = json.loads(raw or b"null")
                except ValueError:
                    raise HttpError(400, "invalid JSON body") from None
                if not isinstance(body, dict) or "status" not in body:
                    raise HttpError(400, " should have required property 'status'")
                return 200, sim.set_status(cluster, job_id, user, body["status"])
            case "GET", ["api", "clusters", cluster, "jobs", job_id, "log"]:
                cluster = sim.cluster_id(cluster)
                return 200, sim.log(cluster, job_id, sim.user(query), query.get("cursor"))
            case "GET", ["api", "v2", "clusters", cluster, "teams", team, "jobs"]:
                cluster = sim.cluster_id(cluster)
                user = sim.user(query)
                limit = int(query["limit"]) if query.get("limit", "").isdigit() else 10
                return 200, sim.team_jobs(cluster, team, user, query.get("user") == "all", limit or 10)
        raise HttpError(404, "Not Found")


def _json(body: Any) -> tuple[bytes, str]:
    return json.dumps(body).encode(), JSON
