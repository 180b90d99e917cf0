"""The ASGI application: routers, and what guards every request (Host and Origin, token, body size, CORS,
errors).

The guards are plain ASGI middleware, in front of FastAPI: a refused request costs no routing, and a
streamed answer (100,000 trials) passes through untouched. `build_api` makes the routes; `guarded` is
what the main port serves (Host and Origin, CORS, the token, the body limit); `nnictl_api` is what
nnictl's per-experiment loopback ports serve (Host and Origin as on a port with no token, the body limit,
the token for all but NNI's REST API: nnictl sends none). Behind the guards on both, `Revalidations`
answers the web UI's revalidations of an unchanged listing without routing them.
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import json
import re
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, NamedTuple
from urllib.parse import quote, unquote_to_bytes

import anyio.to_thread
import redis
from fastapi import FastAPI, Request
from fastapi.exception_handlers import http_exception_handler, request_validation_exception_handler
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError
from starlette.exceptions import HTTPException
from starlette.requests import cookie_parser
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from core import keys
from core.code_archive import MAX_ARCHIVE_BYTES
from core.event_store import EXPERIMENT_ID, ExperimentArchived, InvalidExperimentId
from core.keys import ViewKeys
from core.registry import UnknownPlatform
from manager.api import listings, native, nni, observability, timeline, webui
from manager.archive.moves import ArchiveError
from manager.archive.segments import CorruptArchive
from manager.archive.stores import ArchiveStoreError
from manager.experiments import ExperimentNotFound, ExperimentRunning
from manager.host import ExperimentNotRunning, ManagerHost
from manager.nnictl import PINNED_EXPERIMENT
from manager.runner import RunnerError
from manager.search_space import NestedTooDeep, NotJson
from manager.training_service import MissingClusterMetadata, TrialNotFound
from schemas.config import ConfigError

TOKEN_COOKIE = "trialstream_token"
OPEN_PATHS = frozenset({"/api/v1/health", "/login"})  # a health check reveals nothing; login takes the token
# NNI's web app manifest, a public file of NNI's build: index.html links it with no `crossorigin`, so a browser
# fetches it without the cookie, and a refusal would be an error in the console of every page
OPEN_UI_FILE = re.compile(r"/(?:nni/[^/]+/)?manifest\.json")
MAX_BODY_BYTES = 4 * 1024 * 1024


@dataclass(frozen=True)
class ApiOptions:
    token: str | None = field(default=None, repr=False)
    cors_origins: tuple[str, ...] = ()
    allowed_hosts: tuple[str, ...] = ()  # names answered besides loopback ones (a reverse proxy's), and their pages
    max_body_bytes: int = MAX_BODY_BYTES
    max_upload_bytes: int = MAX_ARCHIVE_BYTES  # the largest code archive the CLI makes (NNI's limits, gzipped)


_ERRORS: dict[type[Exception], int] = {
    ExperimentNotFound: 404,
    TrialNotFound: 404,
    ConfigError: 422,
    InvalidExperimentId: 422,
    UnknownPlatform: 422,
    ExperimentRunning: 409,
    ExperimentNotRunning: 409,
    RunnerError: 409,
    MissingClusterMetadata: 409,
    native.ClusterMetadataOfTheConfig: 409,
    ExperimentArchived: 409,
    ArchiveError: 409,
    ArchiveStoreError: 503,  # the archive an archived experiment is read from does not answer
    CorruptArchive: 503,
    NestedTooDeep: 422,  # a customized trial's parameters, a trial's new form
    NotJson: 422,  # a trial's new form
    UnicodeEncodeError: 422,  # a lone surrogate in a request's text (a search space, a form) reaching Redis
}


def build_api(host: ManagerHost, options: ApiOptions) -> FastAPI:
    """The routes, with no guard in front: serve it through `guarded`."""
    api = _api(host, options)
    api.include_router(native.router)
    api.include_router(observability.router(host))
    api.include_router(nni.trial_output_router)
    api.include_router(timeline.router)
    api.include_router(nni.router, prefix="/api/v1/nni")
    api.include_router(nni.router, prefix="/nni/{experiment_id}/api/v1/nni")
    api.include_router(webui.router, prefix="/nni/{experiment_id}")
    api.include_router(webui.router)  # last: its fallback answers every other GET, as NNI's server does
    return api


def nnictl_api(host: ManagerHost, options: ApiOptions) -> ASGIApp:
    """What nnictl's per-experiment 127.0.0.1 ports serve, as NNI's manager serves its port: NNI's REST API
    and its web UI (which a user opens at the port nnictl lists), for that experiment alone. NNI's REST API
    takes no token there (nnictl sends none), so the port follows the Host and Origin rule of a port with no
    token (nnictl sends `Host: localhost:<port>` and no Origin); the web UI's pages and logs take the token
    the main port asks for (its cookie, sent to every port of the host, or `/login` here). Nothing else of the
    manager is reachable there."""
    api = _api(host, options)
    api.include_router(nni.router, prefix="/api/v1/nni")
    api.include_router(webui.router)  # last: its fallback answers every other GET, as NNI's server does
    app = body_limited(revalidated(api), options)
    if options.token is not None:
        app = TokenGuard(app, options.token, open_prefix="/api/v1/nni/")
    return NotFramed(HostOriginGuard(app, loopback_only=True, allowed_hosts=options.allowed_hosts))


def body_limited(api: ASGIApp, options: ApiOptions) -> ASGIApp:
    return BodyLimit(api, options.max_body_bytes, options.max_upload_bytes)


def revalidated(api: FastAPI) -> ASGIApp:
    """The routes, with a web UI's revalidations of an unchanged listing answered in front of them."""
    host: ManagerHost = api.state.host
    return Revalidations(api, host.client)


API_THREADS = 8
"""Threads running the plain (sync) handlers at once, where Starlette's default is 40. A handler is a few
Redis round trips and some Python: more threads than this only contend for the GIL, and the experiments'
runners, threads of the same process that refill their slots, then wait behind 40 web UIs' polls.
SSE followers, which block for long, read on threads of their own (native.SSE_THREADS)."""


@asynccontextmanager
async def _few_threads(api: FastAPI) -> AsyncIterator[None]:
    anyio.to_thread.current_default_thread_limiter().total_tokens = API_THREADS
    yield


def _api(host: ManagerHost, options: ApiOptions) -> FastAPI:
    api = FastAPI(
        lifespan=_few_threads,
        title="trialstream manager",
        version="1",
        description="trialstream's API; NNI's REST API is under /api/v1/nni (and /nni/<experiment>/api/v1/nni).",
    )
    api.state.host = host
    api.state.options = options
    api.state.listings = listings.ListingCache()
    api.state.timelines = timeline.Timelines()
    for error_type, status in _ERRORS.items():
        api.add_exception_handler(error_type, _handler(status))
    api.add_exception_handler(RequestValidationError, _invalid_request)
    api.add_exception_handler(HTTPException, _http_error)
    return api


async def _invalid_request(request: Request, error: Exception) -> JSONResponse:
    """A malformed request: NNI's `{"error": ...}` on NNI's API (its UI shows `error`), FastAPI's detail elsewhere."""
    assert isinstance(error, RequestValidationError)
    if "/api/v1/nni/" not in route_path(request.scope):
        return await request_validation_exception_handler(request, error)
    first = error.errors()[0]
    where = ".".join(str(part) for part in first.get("loc", ()))
    return JSONResponse({"error": f"{where}: {first.get('msg', 'invalid')}"}, status_code=400)


async def _http_error(request: Request, error: Exception) -> Response:
    """Starlette's own refusals (a wrong method's 405): NNI's `{"error"}` on NNI's API, else FastAPI's."""
    assert isinstance(error, HTTPException)
    if "/api/v1/nni/" not in route_path(request.scope):
        return await http_exception_handler(request, error)
    return JSONResponse({"error": error.detail}, status_code=error.status_code, headers=error.headers)


def guarded(api: FastAPI, options: ApiOptions) -> ASGIApp:
    """The API as the main port serves it. Host and Origin are checked first; then CORS: a browser's
    preflight never carries the token, so it is answered before the token is asked for, and a 401 still
    says which origin may read it. Every guard is in front of `Revalidations`: a 304 is refused as any answer."""
    app = body_limited(revalidated(api), options)
    if options.token is not None:
        app = TokenGuard(app, options.token)
    if options.cors_origins:
        app = CORSMiddleware(app, allow_origins=list(options.cors_origins), allow_methods=["*"], allow_headers=["*"])
    return NotFramed(
        HostOriginGuard(
            app,
            loopback_only=options.token is None,
            allowed_hosts=options.allowed_hosts,
            allowed_origins=options.cors_origins,
        )
    )


class NotFramed:
    """Every answer says no page may frame it: a site's page framing the web UI (its buttons kill trials and
    stop experiments) would have its clicks sent with the UI's own origin, or its cookie. An answer with a CSP of
    its own (the timeline's) keeps it, and it says the same."""

    def __init__(self, app: ASGIApp) -> None:
        self._app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self._app(scope, receive, send)
            return

        async def marked(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", []))
                headers.append((b"x-frame-options", b"DENY"))
                if not any(name.lower() == b"content-security-policy" for name, _ in headers):
                    headers.append((b"content-security-policy", b"frame-ancestors 'none'"))
                message = {**message, "headers": headers}
            await send(message)

        await self._app(scope, receive, marked)


def served_under(app: ASGIApp, url_prefix: str) -> ASGIApp:
    """The application as the main port serves it: under NNI's optional `--url-prefix`. (nnictl's
    per-experiment ports serve it without: nnictl never applies the prefix.)"""
    return webui.UrlPrefix(app, url_prefix) if url_prefix else app


def route_path(scope: Scope) -> str:
    """The request's path below the `--url-prefix`: as ASGI has it, `path` is the whole path and `root_path`
    the prefix it is served under (webui.UrlPrefix)."""
    path: str = scope["path"]
    root: str = scope.get("root_path", "")
    return (path[len(root) :] or "/") if root and path.startswith(root) else path


def _handler(status: int) -> Any:
    async def handle(request: Request, error: Exception) -> JSONResponse:
        message = str(error) if not isinstance(error, ValidationError) else error.errors()[0]["msg"]
        return JSONResponse({"error": message}, status_code=status)

    return handle


class HostOriginGuard:
    """What a web page the user opens must not do: reach the manager by rebinding its own name to this
    machine's address (DNS rebinding), or send requests from another site (CSRF, websocket hijacking).

    Host: a port with no token (the main port without one, and always nnictl's ports) answers only to
    loopback names (`localhost`, `*.localhost`, 127.0.0.0/8, `[::1]`, any port) and `--allowed-host`
    names: a rebinding page's requests carry its own name, which no other check can tell from ours.
    With a token any Host is answered: a rebinding page has neither the header nor the cookie, which
    its browser keeps for our name.

    Origin: a request that carries one (browsers send it on every cross-origin request, every write and
    every websocket) is answered only when it is this manager's own origin (the host and port of its
    Host), a `--cors-origin`, or of an `--allowed-host` name. With a token too: the cookie is SameSite=Strict,
    but a page of the same site (another port of localhost, a sibling subdomain) still gets it sent, and
    clients that send the token themselves (scripts, nnictl, NNI's client) send no Origin at all."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        loopback_only: bool,
        allowed_hosts: tuple[str, ...] = (),
        allowed_origins: tuple[str, ...] = (),
    ) -> None:
        self.app = app
        self.loopback_only = loopback_only
        self.allowed_hosts = frozenset(_host_name(name) for name in allowed_hosts)
        self.allowed_origins = frozenset(allowed_origins)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        problem = self._problem(scope.get("headers", []))
        if problem is not None:
            await _refuse(scope, send, 403, problem)
            return
        await self.app(scope, receive, send)

    def _problem(self, headers: list[tuple[bytes, bytes]]) -> str | None:
        hosts = [value.decode("latin-1") for name, value in headers if name == b"host"]
        origins = [value.decode("latin-1") for name, value in headers if name == b"origin"]
        if len(hosts) > 1 or len(origins) > 1:
            return "more than one Host or Origin header"
        host = _authority(hosts[0]) if hosts else None  # no Host at all (HTTP/1.0): no browser's request
        if hosts and host is None:
            return f"Host {hosts[0][:100]!r} is not a host name or address"
        if self.loopback_only and host is not None and not self._trusted_name(host.name):
            return (
                f"Host {hosts[0][:100]!r} refused: with no token, only loopback names (localhost, 127.0.0.1, "
                "[::1]) and --allowed-host names are answered, so that no web page can reach this manager by "
                "rebinding its own name to this machine; open it as http://localhost:<port>, or start it with "
                "--allowed-host NAME"
            )
        if origins and not self._trusted_origin(origins[0], host):
            return (
                f"Origin {origins[0][:100]!r} refused: only pages of this manager's own address (or a "
                "--cors-origin of its main port) may send it requests"
            )
        return None

    def _trusted_name(self, name: str) -> bool:
        return name in self.allowed_hosts or _is_loopback_name(name)

    def _trusted_origin(self, origin: str, host: _Authority | None) -> bool:
        if origin in self.allowed_origins or "*" in self.allowed_origins:  # `--cors-origin '*'` needs a token
            return True
        match = _ORIGIN.fullmatch(origin)  # `null` (a sandboxed or local page) never matches
        authority = _authority(match["authority"]) if match is not None else None
        if match is None or authority is None:
            return False
        if authority.name in self.allowed_hosts:
            return True
        if host is None or authority.name != host.name:
            return False
        default_port = _DEFAULT_PORTS.get(match["scheme"].lower())  # a Host without a port: the page's scheme's
        return (authority.port or default_port) == (host.port or default_port)


_AUTHORITY = re.compile(r"(?:\[(?P<ipv6>[0-9A-Fa-f:.]+)\]|(?P<name>[A-Za-z0-9._-]+))(?::(?P<port>[0-9]{1,5}))?")
_ORIGIN = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*)://(?P<authority>[^/?#@]+)")
_DEFAULT_PORTS = {"http": 80, "https": 443}


class _Authority(NamedTuple):
    name: str  # lower-case, without IPv6 brackets or the root's trailing dot
    port: int | None


def _authority(text: str) -> _Authority | None:
    """`host[:port]` of a Host header or an origin: the host name, lower-case, and the port if given; None
    if it is no such thing (a user part, a path, an unbracketed IPv6 address)."""
    match = _AUTHORITY.fullmatch(text)
    if match is None:
        return None
    port = int(match["port"]) if match["port"] else None
    return _Authority(_host_name(match["ipv6"] or match["name"]), port)


def allowed_host_problem(name: str) -> str | None:
    """Why `name` cannot be an `--allowed-host`, or None."""
    authority = _authority(name)
    if authority is None or authority.port is not None:
        return "a host name or address without a port (proxy.example, 10.0.0.5, [fd00::5])"
    return None


def _host_name(name: str) -> str:
    """A host name as compared: lower-case, without IPv6 brackets or the root's trailing dot."""
    return name.strip("[]").lower().removesuffix(".")


def _is_loopback_name(name: str) -> bool:
    """`localhost`, a name under `.localhost` (RFC 6761: browsers resolve it to loopback themselves), or
    an address of 127.0.0.0/8 or ::1 (an IPv4-mapped one too)."""
    if name == "localhost" or name.endswith(".localhost"):
        return True
    try:
        address = ipaddress.ip_address(name)
    except ValueError:
        return False
    mapped = address.ipv4_mapped if isinstance(address, ipaddress.IPv6Address) else None
    return address.is_loopback or (mapped is not None and mapped.is_loopback)


class TokenGuard:
    """Every request but a health check carries the token: `Authorization: Bearer <token>`, or the
    cookie `/login?token=...` sets, since a browser opening NNI's web UI cannot send a header.
    Compared in constant time. Paths under `open_prefix` take none (NNI's REST API on nnictl's ports)."""

    def __init__(self, app: ASGIApp, token: str, open_prefix: str | None = None) -> None:
        self.app = app
        self.token = token.encode()
        self.open_prefix = open_prefix

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        path = route_path(scope)
        if path.endswith("/login"):
            await self._login(scope, send)
            return
        if OPEN_UI_FILE.fullmatch(path):  # the same file under every experiment: no answer tells if one exists
            manifest = scope.get("root_path", "") + "/manifest.json"
            await self.app({**scope, "path": manifest, "raw_path": manifest.encode()}, receive, send)
            return
        if path in OPEN_PATHS or self._open(path) or self._presented(scope):
            await self.app(scope, receive, send)
            return
        await _refuse(scope, send, 401, "a bearer token is required", ((b"www-authenticate", b"Bearer"),))

    def _open(self, path: str) -> bool:
        return self.open_prefix is not None and path.startswith(self.open_prefix)

    def _presented(self, scope: Scope) -> bool:
        headers = dict(scope.get("headers", []))
        authorization = headers.get(b"authorization", b"")
        scheme, _, credential = authorization.partition(b" ")
        if scheme.lower() == b"bearer" and hmac.compare_digest(credential.strip(), self.token):
            return True
        # Starlette's lenient parser: http.cookies drops the whole header for one malformed cookie of another app's
        presented = cookie_parser(headers.get(b"cookie", b"").decode("latin-1")).get(TOKEN_COOKIE)
        return presented is not None and hmac.compare_digest(presented.encode("latin-1"), self.token)

    async def _login(self, scope: Scope, send: Send) -> None:
        """Set the token cookie and go to the web UI: a user opens `<manager>/login?token=...` once."""
        token = _query_parameter(scope.get("query_string", b""), b"token")
        if not hmac.compare_digest(token, self.token):
            await _refuse(scope, send, 401, "wrong token")
            return
        target = scope["path"][: -len("login")] + "oview"  # the whole path: under any url prefix
        # a path of this host, whatever the request's: `//evil.example/login` must not send the browser to
        # `//evil.example/oview` (nor `/\evil.example`, nor `/%09/evil.example`, which browsers read the same)
        target = "/" + quote(target, safe="/;:@!$&'()*+,=-._~").lstrip("/")
        cookie = f"{TOKEN_COOKIE}={token.decode()}; HttpOnly; SameSite=Strict; Path=/"
        await send(
            {
                "type": "http.response.start",
                "status": 303,
                "headers": [(b"location", target.encode()), (b"set-cookie", cookie.encode())],
            }
        )
        await send({"type": "http.response.body", "body": b""})


def _query_parameter(query_string: bytes, name: bytes) -> bytes:
    """A query parameter's value, percent-decoded only: a `+` stays a `+` (a base64 token has them)."""
    for pair in query_string.split(b"&"):
        key, _, value = pair.partition(b"=")
        if unquote_to_bytes(key) == name:
            return unquote_to_bytes(value)
    return b""


class BodyLimit:
    """Refuse a request body over the limit (413), whether or not it says its length up front. Code
    uploads (`PUT .../code`) have a limit of their own."""

    def __init__(self, app: ASGIApp, limit: int, upload_limit: int) -> None:
        self.app = app
        self.limit = limit
        self.upload_limit = upload_limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.upload_limit if scope["path"].rstrip("/").endswith("/api/v1/code") else self.limit
        declared = dict(scope.get("headers", [])).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            await _send_json(send, 413, {"error": f"request body over {limit} bytes"})
            return
        received = 0
        refused = False

        async def limited() -> Message:
            """The body as it arrives; past the limit, the 413 is sent here and the app is told the
            client left (raising instead lets FastAPI's body parsing turn it into a 400)."""
            nonlocal received, refused
            if refused:
                return {"type": "http.disconnect"}
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    refused = True
                    await _send_json(send, 413, {"error": f"request body over {limit} bytes"})
                    return {"type": "http.disconnect"}
            return message

        async def unless_refused(message: Message) -> None:
            if not refused:  # the app's answer to a body it never got whole is not sent
                await send(message)

        try:
            await self.app(scope, limited, unless_refused)
        except Exception:
            if not refused:
                raise  # a refused body's aftermath (a client-disconnect error) is no error of the app's


async def _refuse(
    scope: Scope, send: Send, status: int, error: str, headers: tuple[tuple[bytes, bytes], ...] = ()
) -> None:
    """A guard's refusal: `{"error": ...}` with the status, or, to a websocket, a close before it was
    accepted (the server answers its handshake 403)."""
    if scope["type"] == "websocket":
        await send({"type": "websocket.close", "code": 1008})
        return
    await _send_json(send, status, {"error": error}, headers)


async def _send_json(
    send: Send, status: int, body: dict[str, str], headers: tuple[tuple[bytes, bytes], ...] = ()
) -> None:
    payload = json.dumps(body).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(payload)).encode()),
                *headers,
            ],
        }
    )
    await send({"type": "http.response.body", "body": payload})


# The listings an ETag covers whole, asked with no query: what NNI's web UI polls. (A query is validated by the
# route, which a 304 here would skip; `/metric-data-range` with ids FastAPI takes as ints.)
_LISTING = re.compile(
    r"(?:/nni/(?P<experiment>[^/]+))?/api/v1/nni/"
    r"(?:trial-jobs|metric-data|metric-data-latest/?|export-data|metric-data-range/[0-9]{1,9}/[0-9]{1,9})"
)
_ETAG = re.compile(rb'"[0-9]{1,20}-[0-9]{1,20}"')  # a position, as `listings.etag` writes it


class _Reads(NamedTuple):
    """Whose reads share a batch: one experiment's, on one event loop."""

    loop: asyncio.AbstractEventLoop
    experiment_id: str


class Revalidations:
    """ASGI, between the guards and the routes: a revalidation (`If-None-Match`) of an NNI listing whose
    experiment's views are still at the ETag's position is answered 304 here, without routing; anything
    else (a changed position, an unknown or archived experiment, a failed read) goes on to the route, which
    answers as it always has.

    The read is exact: each revalidation waits for a read sent after it arrived. Reads of one experiment go
    one at a time; those that arrive while one is in flight share the next (`_waiting`), so 50 pollers cost
    a read per round trip of Redis, not one each. Kept per event loop: nnictl's ports share one application,
    each port served by a loop of its own."""

    def __init__(self, app: ASGIApp, client: redis.Redis) -> None:
        self.app = app
        self.client = client
        self._waiting: dict[_Reads, asyncio.Future[str | None]] = {}  # the read not sent yet
        self._reading: dict[_Reads, asyncio.Future[str | None]] = {}  # the read in flight
        self._tasks: set[asyncio.Task[None]] = set()  # the reads' tasks, kept until done (asyncio holds weak refs)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "GET" and not scope.get("query_string"):
            etag = _if_none_match(scope)
            experiment_id = _listed_experiment(scope) if etag is not None else None
            if etag is not None and experiment_id is not None and await self._position(experiment_id) == etag:
                headers = [(b"etag", listings.etag(etag).encode()), (b"cache-control", b"no-cache")]
                await send({"type": "http.response.start", "status": 304, "headers": headers})
                await send({"type": "http.response.body", "body": b""})
                return
        await self.app(scope, receive, send)

    async def _position(self, experiment_id: str) -> str | None:
        """The views' position read after this call began; None where the route must answer."""
        loop = asyncio.get_running_loop()
        reads = _Reads(loop, experiment_id)
        batch = self._waiting.get(reads)
        if batch is None:
            batch = self._waiting[reads] = loop.create_future()
            task = loop.create_task(self._read(reads, batch))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        return await asyncio.shield(batch)  # a client that leaves does not cancel the read the others wait for

    async def _read(self, reads: _Reads, batch: asyncio.Future[str | None]) -> None:
        before = self._reading.get(reads)
        if before is not None:
            await asyncio.wait([before])
        del self._waiting[reads]  # from here on, who arrives waits for the next read
        self._reading[reads] = batch
        try:
            batch.set_result(await anyio.to_thread.run_sync(self._read_position, reads.experiment_id))
        except Exception:  # Redis unreachable, say: the route answers, and tells
            batch.set_result(None)
        finally:
            if self._reading.get(reads) is batch:
                del self._reading[reads]

    def _read_position(self, experiment_id: str) -> str | None:
        """The experiment's views' position, in one round trip; None for an experiment the route must resolve
        (unknown: a 404; archived: read from its archive)."""
        with self.client.pipeline(transaction=False) as pipe:
            pipe.zscore(keys.EXPERIMENTS, experiment_id)
            pipe.hexists(keys.ARCHIVED, experiment_id)
            pipe.hget(ViewKeys(experiment_id).position, "position")
            known, archived, position = pipe.execute()
        if known is None or archived:
            return None
        return str(position or "0-0")


def _if_none_match(scope: Scope) -> str | None:
    """The position a request's `If-None-Match` names, if it is one (a single ETag, as a browser sends it)."""
    values: list[bytes] = [value for name, value in scope.get("headers", []) if name == b"if-none-match"]
    if len(values) != 1 or not _ETAG.fullmatch(values[0]):
        return None
    return values[0][1:-1].decode()


def _listed_experiment(scope: Scope) -> str | None:
    """The experiment of a listing the path names (or the connection is pinned to); None for any other path,
    and for a listing of the newest experiment, which the route resolves."""
    match = _LISTING.fullmatch(route_path(scope))
    if match is None:
        return None
    named = match["experiment"]
    if named is None:
        pinned = scope.get(PINNED_EXPERIMENT)
        return str(pinned) if pinned is not None else None
    return named if EXPERIMENT_ID.fullmatch(named) else None
