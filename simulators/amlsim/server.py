"""The control plane's HTTPS front end: the ARM REST endpoints azure-ai-ml calls, plus the two that come
before them (the cloud's metadata, and a managed-identity token endpoint for DefaultAzureCredential).

Facts (Azure REST API specs, machinelearningservices; azure-identity's App Service managed identity):
- ARM errors are `{"error": {"code", "message"}}`; a missing resource is 404 `ResourceNotFound`, an unknown
  or expired bearer token 401 `InvalidAuthenticationToken` with a `WWW-Authenticate: Bearer` challenge.
- The token endpoint is `GET $IDENTITY_ENDPOINT?api-version=2019-08-01&resource=<audience>` with the
  `X-IDENTITY-HEADER` secret; it answers `access_token`, `expires_on` (epoch seconds), `resource`, `token_type`.
- Jobs: PUT creates (201) and answers the job with `status`; POST .../cancel answers 202 with a `Location` to
  poll; GET of an ended job keeps its status. A command job's `codeId` names a code version whose `codeUri`
  is a folder in a datastore.
"""

from __future__ import annotations

import json
import re
import secrets
import ssl
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qs, urlsplit

from simulators.httpserver import LoopbackServer, QuietHandler

if TYPE_CHECKING:
    from simulators.amlsim.workspace import SimulatedWorkspace

WORKSPACE = r"/subscriptions/(?P<sub>[^/]+)/resourceGroups/(?P<rg>[^/]+)/providers/Microsoft\.MachineLearningServices/workspaces/(?P<ws>[^/]+)"  # noqa: E501

ASSET = r"/(?P<kind>codes|environments)/(?P<name>[^/]+)"


class HttpError(Exception):
    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status, self.code, self.message = status, code, message


def not_found(what: str) -> HttpError:
    return HttpError(404, "ResourceNotFound", f"{what} was not found")


Route = tuple[str, re.Pattern[str], Callable[..., tuple[int, Any]]]


class ControlPlane:
    """Routes and authentication; the state is the workspace's."""

    def __init__(self, workspace: SimulatedWorkspace, cert: Path, key: Path) -> None:
        self.workspace = workspace
        self.identity_secret = secrets.token_hex(8)
        self.tokens: dict[str, float] = {}  # bearer token -> expiry (epoch s)
        self.requests: list[tuple[str, str]] = []  # (method, path) of every request, for the tests
        self.refuse_tokens = False  # the identity endpoint refuses (a credential that no longer works)
        self._server = LoopbackServer(_handler(self))
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.load_cert_chain(cert, key)
        self._server.socket = context.wrap_socket(self._server.socket, server_side=True)
        self.port = self._server.port
        ws = self.workspace
        self.routes: list[Route] = [
            ("GET", re.compile(r"/metadata/endpoints"), lambda r, m: (200, self.cloud_metadata())),
            ("GET", re.compile(r"/identity/token"), self.token),
            ("GET", re.compile(WORKSPACE + "$"), ws.get_workspace),
            ("GET", re.compile(WORKSPACE + "/datastores$"), ws.list_datastores),
            ("GET", re.compile(WORKSPACE + "/datastores/(?P<name>[^/]+)$"), ws.get_datastore),
            ("POST", re.compile(WORKSPACE + "/datastores/(?P<name>[^/]+)/listSecrets$"), ws.list_secrets),
            ("GET", re.compile(WORKSPACE + ASSET + "$"), ws.get_asset),
            ("PUT", re.compile(WORKSPACE + ASSET + "$"), ws.put_asset),
            ("GET", re.compile(WORKSPACE + ASSET + "/versions$"), ws.list_asset_versions),
            (
                "POST",
                re.compile(WORKSPACE + ASSET + "/versions/(?P<version>[^/]+)/startPendingUpload$"),
                ws.pending_upload,
            ),
            ("GET", re.compile(WORKSPACE + ASSET + "/versions/(?P<version>[^/]+)$"), ws.get_asset),
            ("PUT", re.compile(WORKSPACE + ASSET + "/versions/(?P<version>[^/]+)$"), ws.put_asset),
            ("GET", re.compile(WORKSPACE + "/computes/(?P<name>[^/]+)$"), ws.get_compute),
            ("GET", re.compile(WORKSPACE + "/jobs$"), ws.list_jobs),
            ("GET", re.compile(WORKSPACE + "/jobs/(?P<name>[^/]+)$"), ws.get_job),
            ("PUT", re.compile(WORKSPACE + "/jobs/(?P<name>[^/]+)$"), ws.put_job),
            ("POST", re.compile(WORKSPACE + "/jobs/(?P<name>[^/]+)/cancel$"), ws.cancel_job),
            ("GET", re.compile(r"/operations/cancel/(?P<name>[^/]+)$"), ws.cancel_operation),
        ]

    @property
    def url(self) -> str:
        return f"https://127.0.0.1:{self.port}"

    def start(self) -> None:
        self._server.start("amlsim-api")

    def stop(self) -> None:
        self._server.stop()

    def cloud_metadata(self) -> dict[str, Any]:
        """ARM's /metadata/endpoints for this cloud: the SDK takes its resource manager and storage suffix."""
        return {
            "name": "AmlSim",
            "portal": "https://portal.amlsim.test/",
            "resourceManager": f"{self.url}/",
            "authentication": {"loginEndpoint": f"{self.url}/", "audiences": [f"{self.url}/"]},
            "suffixes": {"storage": self.workspace.storage_suffix},
        }

    def token(self, request: Request, match: re.Match[str]) -> tuple[int, Any]:
        if request.headers.get("x-identity-header") != self.identity_secret or self.refuse_tokens:
            raise HttpError(401, "Unauthorized", "the identity header is missing or wrong")
        token = secrets.token_urlsafe(24)
        expires = time.time() + 3600
        self.tokens[token] = expires
        resource = request.query.get("resource", "")
        return 200, {
            "access_token": token,
            "expires_on": str(int(expires)),
            "resource": resource,
            "token_type": "Bearer",
        }

    def authenticate(self, request: Request) -> None:
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or self.tokens.get(token, 0) < time.time():
            raise HttpError(401, "InvalidAuthenticationToken", "The access token is invalid or has expired.")


class Request:
    def __init__(self, method: str, path: str, query: dict[str, str], headers: dict[str, str], body: bytes) -> None:
        self.method, self.path, self.query, self.headers, self.body = method, path, query, headers, body

    def json(self) -> Any:
        try:
            return json.loads(self.body or b"null")
        except ValueError as error:
            raise HttpError(400, "BadRequest", f"the body is not JSON: {error}") from None


def _handler(plane: ControlPlane) -> type[QuietHandler]:
    class Handler(QuietHandler):  # quiet: the tests read `plane.requests`
        def _serve(self) -> None:
            parts = urlsplit(self.path)
            body = self.read_body()
            query = {key: values[0] for key, values in parse_qs(parts.query).items()}
            headers = {key.lower(): value for key, value in self.headers.items()}
            request = Request(self.command, parts.path, query, headers, body)
            plane.requests.append((self.command, parts.path))
            extra: dict[str, str] = {}
            try:
                for method, pattern, action in plane.routes:
                    match = pattern.match(parts.path)
                    if match and method == self.command:
                        if not parts.path.startswith(("/metadata/", "/identity/")):
                            plane.authenticate(request)
                        status, answer = action(request, match)
                        if isinstance(answer, tuple):
                            answer, extra = answer
                        break
                else:
                    raise HttpError(404, "NoRoute", f"the simulator does not serve {self.command} {parts.path}")
            except HttpError as error:
                status, answer = error.status, {"error": {"code": error.code, "message": error.message}}
                if error.status == 401:
                    extra = {"WWW-Authenticate": 'Bearer authorization_uri="https://login.amlsim.test/"'}
            except Exception as error:  # a simulator bug: told to the client, and to the test's log
                traceback.print_exc()
                status, answer = 500, {"error": {"code": "InternalServerError", "message": repr(error)}}
            self.answer(status, b"" if answer is None else json.dumps(answer).encode(), headers=extra)

        do_GET = do_PUT = do_POST = do_DELETE = do_PATCH = _serve

    return Handler
