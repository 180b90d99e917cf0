"""NNI's own web UI, served from the installed `nni` package (`nni_node/static`), never copied here.

The router is mounted at the root (the default experiment; on nnictl's port of an experiment, that one) and
at `/nni/{experiment_id}` (that one): NNI's UI derives its API base from the page's path
(`<prefix>/api/v1/nni`), so each experiment is a prefix. As
NNI's Express server does: a file of the build if there is one, else `index.html` (the UI's own routes
`/oview`, `/detail`, `/experiment`); `/logs/<file>` are the experiment's `<working directory>/log/` files.
`UrlPrefix` is NNI's `--url-prefix`: everything under `/<prefix>`, a 404 outside it; `url_prefix_problem`
says why a prefix cannot work (the UI reads its prefix back from the page's path).
"""

from __future__ import annotations

import importlib.util
import re
from functools import cache
from pathlib import Path
from typing import Annotated

from fastapi import APIRouter, Depends, Request
from fastapi.responses import FileResponse, JSONResponse, PlainTextResponse, Response
from starlette.types import ASGIApp, Receive, Scope, Send

from manager.api.native import Host
from manager.api.nni import nni_experiment
from manager.nnictl import PINNED_EXPERIMENT

INSTALL_HINT = (
    "NNI's web UI is not installed here: `pip install nni==3.0` in the manager's environment, then restart it."
)
MANAGER_LOGS = ("dispatcher.log", "nnimanager.log")  # what the UI's log panel asks for; may not exist (yet)

router = APIRouter(tags=["web UI"], include_in_schema=False)


@cache
def static_root() -> Path | None:
    """`nni_node/static` of the installed `nni` package (found without importing it), or None."""
    spec = importlib.util.find_spec("nni_node")
    if spec is None or not spec.submodule_search_locations:
        return None
    root = Path(next(iter(spec.submodule_search_locations))) / "static"
    return root.resolve() if (root / "index.html").is_file() else None


def _experiment_if_named(request: Request) -> str | None:
    """Under `/nni/<id>`, that experiment, which must exist (404 otherwise); at the root, no check."""
    return nni_experiment(request) if "experiment_id" in request.path_params else None


@router.get("/logs/{name:path}")
def manager_log(experiment_id: Annotated[str, Depends(nni_experiment)], name: str, host: Host) -> Response:
    """A file of the experiment's `log/` directory (dispatcher.log), as text; never a path outside it."""
    base = (Path(host.service(experiment_id).experiment_view().working_directory) / "log").resolve()
    target = (base / name).resolve()
    if target.is_relative_to(base) and target != base and target.is_file():
        return FileResponse(
            target, media_type="text/plain; charset=utf-8", headers={"x-content-type-options": "nosniff"}
        )
    if name in MANAGER_LOGS:  # not written (yet): an empty log, not the UI's spinner forever
        return PlainTextResponse("")
    return PlainTextResponse(f"no log {name}", status_code=404)


@router.get("/{path:path}")
def web_ui(path: str, request: Request, _experiment: Annotated[str | None, Depends(_experiment_if_named)]) -> Response:
    """A file of NNI's build, else `index.html` (NNI's fallback: the UI routes itself). On nnictl's port of an
    experiment, which serves that one alone at its root, another's path is no page."""
    if path.startswith("api/") and not path.startswith("api/v1/nni/"):
        return JSONResponse({"error": f"no such endpoint: /{path}"}, status_code=404)
    pinned = request.scope.get(PINNED_EXPERIMENT)
    if pinned is not None and path.startswith("nni/"):
        return JSONResponse({"error": f"this port serves experiment {pinned} alone, at its root"}, status_code=404)
    root = static_root()
    if root is None:
        return PlainTextResponse(INSTALL_HINT, status_code=503)
    target = (root / path).resolve()
    if path and target.is_relative_to(root) and target.is_file():
        return FileResponse(target)
    return FileResponse(root / "index.html", media_type="text/html; charset=utf-8")


UI_ROUTES = ("/oview", "/detail", "/experiment")  # the UI's pages: it takes its prefix to be the path before one
_PREFIX_SEGMENT = re.compile(r"[A-Za-z0-9._~!$&'()*+,;=:@-]+")  # what a path keeps as it is (no %-escapes)


def url_prefix_problem(prefix: str) -> str | None:
    """Why NNI's web UI cannot work under `prefix` (given without its outer slashes), or None. The routes
    take any prefix; the UI finds its own from `location.pathname` as NNI's `getPrefix` does: cut the
    first occurrence of its page's route (`.replace`), and any path holding `experiment` is its All
    experiments page."""
    segments = prefix.split("/")
    if not all(_PREFIX_SEGMENT.fullmatch(segment) and segment not in (".", "..") for segment in segments):
        return (
            "path segments of ASCII letters, digits and -._~!$&'()*+,;=:@ only, none empty, '.' or '..' "
            "(a browser rewrites or escapes anything else in the page's path)"
        )
    if "experiment" in prefix:
        return "NNI's web UI takes any path containing 'experiment' for its All experiments page"
    for route in UI_ROUTES:
        if ("/" + prefix + route).replace(route, "", 1) != "/" + prefix:
            return f"NNI's web UI finds its prefix by cutting the first {route!r} out of the page's path"
    return None


class UrlPrefix:
    """NNI's `--url-prefix P`: a request under `/P` goes on with `/P` as its `root_path` (its `path` whole,
    as ASGI has it: the routes match what follows the root path); any other path is a 404 saying so, as
    NNI answers (`Outside prefix "/P"`)."""

    def __init__(self, app: ASGIApp, prefix: str) -> None:
        self.app = app
        self.prefix = "/" + prefix.strip("/")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        path: str = scope["path"]
        if path == self.prefix or path.startswith(self.prefix + "/"):
            await self.app({**scope, "root_path": scope.get("root_path", "") + self.prefix}, receive, send)
            return
        await PlainTextResponse(f'Outside prefix "{self.prefix}"', status_code=404)(scope, receive, send)
