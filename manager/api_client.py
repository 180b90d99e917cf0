"""A client of a `trialstream manager`'s own API (/api/v1): how the CLI works with `--manager URL`, so
its user needs the manager's URL and token, never Redis.

Every failure is one line (ManagerError): the manager's own `{"error": ...}`, an unreachable URL, or
the token it wants.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any
from urllib.parse import quote

import httpx

from core.event_store import LogEntry, StoredEvent, UnreadableEvent
from core.platform import OutputStream
from core.variables import MANAGER_TOKEN_ENV as TOKEN_ENV
from manager.local_token import found_token
from schemas.api import ExperimentState
from schemas.config import ConfigError
from schemas.events import EVENT_ADAPTER
from schemas.trial import MetricRecord, TrialJobDetail

PAGE = 1000
_TIMEOUT = httpx.Timeout(60.0, connect=10.0)


class ManagerError(Exception):
    """The manager could not be reached, or refused the request; the message says which, in one line."""


class ManagerUnreachable(ManagerError):
    """No answer came (refused, timed out, cut off): a read may be asked again, as following a run does."""


class ManagerConfigError(ManagerError, ConfigError):
    """The manager refused what was sent as invalid (422): a bad config, as the CLI's own checks say it."""


class ManagerClient:
    def __init__(self, url: str, token: str | None) -> None:
        if not url.startswith(("http://", "https://")):
            raise ManagerError(f"manager URL {url!r}: give it as http://HOST:PORT (or https://)")
        self.url = url.rstrip("/")
        self._token_from: str | None = None if token is None else TOKEN_ENV  # where it came from, for a refusal
        found = found_token(self.url) if token is None else None  # a manager here that made its own, for this user
        if found is not None:
            token, self._token_from = found[0], str(found[1])
        headers = {} if token is None else {"authorization": f"Bearer {token}"}
        self._http = httpx.Client(base_url=f"{self.url}/api/v1", headers=headers, timeout=_TIMEOUT)

    # experiments

    def experiments(self) -> list[ExperimentState]:
        return [ExperimentState.model_validate(item) for item in self._json("GET", "/experiments")]

    def experiment(self, experiment_id: str) -> ExperimentState:
        return ExperimentState.model_validate(self._json("GET", _path("experiments", experiment_id)))

    def resolve(self, experiment_id: str | None) -> str:
        """The given experiment if the manager has it, else its newest one (as on Redis)."""
        if experiment_id is not None:
            return self.experiment(experiment_id).id
        listed = self._json("GET", "/experiments")
        if not listed:
            raise ManagerError(f"no experiment has been run on the manager at {self.url} yet")
        return str(listed[-1]["id"])

    def upload_code(self, archive: bytes) -> str:
        return str(self._json("PUT", "/code", content=archive)["codeId"])

    def create(self, config: dict[str, Any], code_id: str) -> str:
        return str(self._json("POST", "/experiments", json={"config": config, "codeId": code_id})["id"])

    def stop(self, experiment_id: str) -> None:
        self._json("POST", _path("experiments", experiment_id, "stop"))

    def resume(self, experiment_id: str) -> None:
        self._json("POST", _path("experiments", experiment_id, "resume"))

    def delete(self, experiment_id: str) -> int:
        return int(self._json("DELETE", _path("experiments", experiment_id))["deletedKeys"])

    # trials

    def trials(self, experiment_id: str) -> list[TrialJobDetail]:
        """Every trial, by sequence id, a page at a time."""
        trials: list[TrialJobDetail] = []
        while True:
            page = self.trial_page(experiment_id, offset=len(trials), limit=PAGE)
            trials += page
            if len(page) < PAGE:
                return trials

    def trial_page(
        self, experiment_id: str, offset: int = 0, limit: int = PAGE, sort: str = "sequence"
    ) -> list[TrialJobDetail]:
        params = {"offset": offset, "limit": limit, "sort": sort}
        page = self._json("GET", _path("experiments", experiment_id, "trials"), params=params)
        return [TrialJobDetail.model_validate(item) for item in page["items"]]

    def trial(self, experiment_id: str, trial_id: str) -> TrialJobDetail:
        return TrialJobDetail.model_validate(self._json("GET", _path("experiments", experiment_id, "trials", trial_id)))

    def metrics(self, experiment_id: str, trial_id: str) -> list[MetricRecord]:
        answer = self._json("GET", _path("experiments", experiment_id, "trials", trial_id, "metrics"))
        return [MetricRecord.model_validate(item) for item in answer["items"]]

    def cancel(self, experiment_id: str, trial_id: str) -> TrialJobDetail:
        answer = self._json("POST", _path("experiments", experiment_id, "trials", trial_id, "cancel"), json={})
        return TrialJobDetail.model_validate(answer)

    def output(self, experiment_id: str, trial_id: str, stream: OutputStream, offset: int) -> bytes:
        """The trial's output from `offset` on, as it is (empty when there is no more yet)."""
        path = _path("experiments", experiment_id, "trials", trial_id, "output")
        return self._call("GET", path, params={"stream": stream, "offset": offset}).content

    # the log

    def events(self, experiment_id: str, after: str) -> list[LogEntry]:
        """The next page of the log after `after` (empty at its end)."""
        page = self._json("GET", _path("experiments", experiment_id, "events"), params={"after": after, "limit": PAGE})
        return [log_entry(item) for item in page["items"]]

    def head(self, experiment_id: str) -> str:
        """The newest entry of the log now (0-0 for an empty one)."""
        page = self._json("GET", _path("experiments", experiment_id, "events"), params={"after": "0-0", "limit": 1})
        return str(page["head"])

    def follow(self, experiment_id: str, after: str, opened: Callable[[], None]) -> Iterator[LogEntry]:
        """Entries appended after `after`, as the manager sends them (Server-Sent Events), until the
        connection ends. `opened` is called once the manager has taken the stream up, before any entry comes:
        a follower that waits on a quiet log knows the manager answers."""
        path = _path("experiments", experiment_id, "events", "stream")
        timeout = httpx.Timeout(None, connect=_TIMEOUT.connect)
        with _reaching(self.url), self._http.stream("GET", path, params={"after": after}, timeout=timeout) as answer:
            if answer.status_code >= 400:
                answer.read()
                self._check(answer)
            opened()
            data: list[str] = []
            for line in answer.iter_lines():
                if line.startswith("data:"):
                    data.append(line[5:].strip())
                elif not line and data:
                    yield log_entry(json.loads("\n".join(data)))
                    data = []

    # requests

    def _json(self, method: str, path: str, **request: Any) -> Any:
        answer = self._call(method, path, **request)
        try:
            return answer.json()
        except ValueError:  # a web page, another server
            kind = answer.headers.get("content-type", "no content type")
            raise ManagerError(
                f"{self.url} answered {method} {answer.request.url.path} with no JSON ({kind}): is it a trialstream"
                " manager's URL, without a path?"
            ) from None

    def _call(self, method: str, path: str, **request: Any) -> httpx.Response:
        with _reaching(self.url):
            answer = self._http.request(method, path, **request)
        self._check(answer)
        return answer

    def _check(self, answer: httpx.Response) -> None:
        """One line for a refusal: the manager's own message where it gave one."""
        status = answer.status_code
        if status < 400:
            return
        if status == 401:
            if self._token_from is not None:
                raise ManagerError(
                    f"the manager at {self.url} refused the token in {self._token_from}: set {TOKEN_ENV} to the"
                    " manager's"
                )
            raise ManagerError(f"the manager at {self.url} requires a token: set {TOKEN_ENV}")
        asked = f"{answer.request.method} {answer.request.url.path}"
        message = (
            _message(answer.content)
            or f"the manager at {self.url} answered {asked} with {status} {answer.reason_phrase}"
        )
        raise (ManagerConfigError if status == 422 else ManagerError)(message)


def _path(*segments: str) -> str:
    """A path of the API, each segment (an experiment's or a trial's id) whole: a `?`, `#` or `%` in an id stays
    in it rather than reaching another route. A `/` (the server routes the path decoded), and `.` and `..` (a URL
    resolves them), make no id."""
    for segment in segments:
        if segment in ("", ".", "..") or "/" in segment:
            raise ManagerError(f"{segment!r} is no experiment or trial id")
    return "".join(f"/{quote(segment, safe='')}" for segment in segments)


@contextmanager
def _reaching(url: str) -> Iterator[None]:
    """A transport failure (refused, timed out, cut off) as one line naming the manager's URL."""
    try:
        yield
    except httpx.TransportError as error:
        raise ManagerUnreachable(f"cannot reach the manager at {url}: {error or type(error).__name__}") from None


def _message(body: bytes) -> str | None:
    """`{"error": ...}` as the manager answers, or the first of FastAPI's own validation errors."""
    try:
        answer = json.loads(body)
    except ValueError:
        return None
    if not isinstance(answer, dict):
        return None
    if isinstance(answer.get("error"), str):
        return str(answer["error"])
    detail = answer.get("detail")
    if isinstance(detail, list) and detail and isinstance(detail[0], dict):
        where = ".".join(str(part) for part in detail[0].get("loc", ()) if part not in ("body", "query"))
        return f"{where}: {detail[0].get('msg')}" if where else str(detail[0].get("msg"))
    return None


def log_entry(item: dict[str, Any]) -> LogEntry:
    """An entry as the API shows it (`describe(entry).json`), back as the entry: rendered as Redis's are."""
    if "event" in item:
        return StoredEvent(str(item["id"]), EVENT_ADAPTER.validate_python(item["event"]))
    return UnreadableEvent(str(item["id"]), dict(item.get("fields", {})), str(item.get("unreadable", "")))
