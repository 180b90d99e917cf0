"""The DLTS dashboard's REST API as NNI's client called it: jobs submitted, read, killed and listed, the
password sent only in the query and masked in httpx's log."""

from __future__ import annotations

import json
import logging
import re
from typing import Any

import httpx

from workers.platforms.dlts.config import DltsAccess

JOB_LIST_LIMIT = 1000  # the team's most recent jobs searched for one by name


class MaskPassword(logging.Filter):
    """httpx logs each request's URL at INFO: the query's password is masked there."""

    _pattern = re.compile(r"((?:password|token)=)[^&\s\"']*")

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.args, tuple) and record.args:
            record.args = tuple(self._pattern.sub(r"\1*****", str(arg)) for arg in record.args)
        return True


logging.getLogger("httpx").addFilter(MaskPassword())


class DashboardError(Exception):
    """The dashboard answered, and not with what was asked (its status and its text)."""

    def __init__(self, status: int, text: str) -> None:
        super().__init__(f"{status} {text.strip()[:300]}")
        self.status = status


class Refused(Exception):
    """The cluster's RestAPI refused a job (`{"error": ...}` in a 200 answer)."""


def describe(error: Exception) -> str:
    """In one line, never with the request's URL (its query holds the password)."""
    if isinstance(error, DashboardError):
        return str(error)
    return f"{type(error).__name__}: {error}" if str(error) else type(error).__name__


class Dashboard:
    """The calls NNI's client made, as one user of one cluster and team."""

    def __init__(self, http: httpx.Client, access: DltsAccess) -> None:
        self.http, self.access = http, access

    def _call(self, method: str, path: str, body: Any = None, **query: str | int) -> httpx.Response:
        params: dict[str, str | int] = {
            "email": self.access.email,
            "password": self.access.password.get_secret_value(),
            **query,
        }
        response = self.http.request(method, self.access.dashboard + path, params=params, json=body)
        if response.status_code >= 300:
            raise DashboardError(response.status_code, response.text)
        return response

    def team(self) -> dict[str, Any]:
        access = self.access
        answer: dict[str, Any] = self._call("GET", f"api/teams/{access.team}/clusters/{access.cluster}").json()
        return answer

    def gpu_type(self) -> str:
        """NNI's getGpuType: the first key of the team's `metadata` (a JSON string)."""
        metadata = json.loads(self.team().get("metadata") or "{}")
        if not isinstance(metadata, dict) or not metadata:
            raise DashboardError(200, f"team {self.access.team!r} has no GPU type in its metadata")
        return str(next(iter(metadata)))

    def submit(self, body: dict[str, Any]) -> str:
        answer = self._call("POST", f"api/clusters/{self.access.cluster}/jobs", body).json()
        if not isinstance(answer, dict) or not answer.get("jobId"):
            raise Refused(str(answer.get("error") if isinstance(answer, dict) else answer))
        return str(answer["jobId"])

    def job(self, job_id: str) -> dict[str, Any]:
        """The job's detail; {} when the cluster has no such job of this user."""
        answer = self._call("GET", f"api/v2/clusters/{self.access.cluster}/jobs/{job_id}").json()
        return answer if isinstance(answer, dict) else {}

    def kill(self, job_id: str) -> None:
        self._call("PUT", f"api/clusters/{self.access.cluster}/jobs/{job_id}/status", {"status": "killing"})

    def log(self, job_id: str, cursor: str | None) -> tuple[str, str | None] | None:
        """The next page of the job's log after `cursor`: its text and the cursor after it; None when none yet."""
        query: dict[str, str | int] = {"cursor": cursor} if cursor else {}
        try:
            answer = self._call("GET", f"api/clusters/{self.access.cluster}/jobs/{job_id}/log", **query).json()
        except DashboardError as error:
            if error.status == 404:  # DLWorkspace's answer for "no log (after this cursor)"
                return None
            raise
        pods = answer.get("log") or {}
        text = "".join(pods.values()) if isinstance(pods, dict) else str(pods)
        next_cursor = answer.get("cursor")
        return text, str(next_cursor) if next_cursor is not None else None

    def jobs(self) -> list[dict[str, Any]]:
        """The user's most recent jobs in the team."""
        access = self.access
        path = f"api/v2/clusters/{access.cluster}/teams/{access.team}/jobs"
        answer = self._call("GET", path, limit=JOB_LIST_LIMIT).json()
        return [job for job in answer if isinstance(job, dict)] if isinstance(answer, list) else []

    def find(self, name: str) -> dict[str, Any] | None:
        return next((job for job in self.jobs() if job.get("jobName") == name), None)
