"""nnictl against trialstream: each experiment this manager runs gets an entry in nnictl's registry and
a loopback port of its own that answers NNI's REST API and web UI for that experiment alone, as NNI's
manager answers on the port `nnictl create` prints.

nnictl finds an experiment's server by the registry's `port` and always asks
`http://localhost:<port>/api/v1/nni` with no prefix, so one manager port cannot tell two experiments
apart: hence one small listener per experiment (a second uvicorn server on the same application, in
a thread), which pins its requests to the experiment. `pid` is the experiment's own process
(manager/experiment_process.py), alive while the manager keeps the experiment open (running, or ended DONE or
ERROR, as NNI's manager stays up for it): `nnictl stop` sends it SIGTERM, which stops that experiment alone, and
once it has ended the entry is STOPPED, as nnictl itself marks an entry whose pid is gone.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from dataclasses import dataclass

import uvicorn
from starlette.types import ASGIApp, Receive, Scope, Send

from manager.host import ManagerHost
from manager.nnictl_registry import NnictlRegistry
from schemas.nni_rest import experiment_metadata

log = logging.getLogger(__name__)

# ASGI scope key: the experiment every request of a connection is about. nnictl reaches an experiment at
# `localhost:<port>` with no prefix: the per-experiment listeners below set it, NNI's API (manager.api.nni)
# reads it.
PINNED_EXPERIMENT = "trialstream.experiment"
_NNI_STATUS = {"RUNNING": "RUNNING", "DONE": "DONE", "STOPPED": "STOPPED", "ERROR": "ERROR"}


class PinnedExperiment:
    """Every request through this wrapper is about one experiment."""

    def __init__(self, app: ASGIApp, experiment_id: str) -> None:
        self.app = app
        self.experiment_id = experiment_id

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] in ("http", "websocket"):
            scope = {**scope, PINNED_EXPERIMENT: self.experiment_id}
        await self.app(scope, receive, send)


@dataclass
class _Listener:
    server: uvicorn.Server
    thread: threading.Thread
    port: int


class NnictlBridge:
    def __init__(self, host: ManagerHost, app: ASGIApp, registry: NnictlRegistry | None = None) -> None:
        self.host = host
        self.app = app
        self.registry = registry or NnictlRegistry()
        self._listeners: dict[str, _Listener] = {}
        self._lock = threading.Lock()  # experiment_changed and close, whole: one registry write at a time, in order
        self._closed = False
        host.on_change.append(self.experiment_changed)

    def experiment_changed(self, experiment_id: str) -> None:
        """A hosted experiment started (register it, with its own port), its runner ended (its status), or
        its process ended (STOPPED).

        All of it under the lock, its view read there too: the call for the start (the API's thread) and the
        one for the end (the runner's) can come together, and the first one's RUNNING, written last, would
        otherwise stand over the DONE in the registry."""
        with self._lock:
            if self._closed:  # the manager is going: close() marked every entry STOPPED
                return
            view = self.host.service(experiment_id).experiment_view()
            pid = self.host.process_id(experiment_id)
            if pid is None:
                self.registry.update(experiment_id, "STOPPED", view.end_time or _now_ms())
                return
            listener = self._listeners.get(experiment_id)
            if listener is None:
                listener = self._listeners[experiment_id] = self._listen(experiment_id)
            running = experiment_id in self.host.hosted() and view.status == "RUNNING"
            if not running:
                self.registry.update(experiment_id, _NNI_STATUS[view.status], view.end_time)
                return
            submitted = self.host.service(experiment_id).views.total()
            entry = experiment_metadata(view, submitted, port=listener.port, pid=pid, prefix_url=None, now_ms=_now_ms())
            self.registry.register(entry)

    def close(self) -> None:
        """The manager is going: every entry it kept is STOPPED (nothing answers on its port any more)."""
        with self._lock:
            self._closed = True
            listeners = dict(self._listeners)
            self._listeners.clear()
            for listener in listeners.values():
                listener.server.should_exit = True
            for experiment_id, listener in listeners.items():
                listener.thread.join(5)
                try:  # one entry the registry refuses leaves the others STOPPED all the same
                    view = self.host.service(experiment_id).experiment_view()
                    self.registry.update(experiment_id, "STOPPED", view.end_time or _now_ms())
                except Exception:
                    log.exception(
                        "experiment %s: nnictl's registry not updated",
                        experiment_id,
                        extra={"experiment": experiment_id},
                    )

    def _listen(self, experiment_id: str) -> _Listener:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        config = uvicorn.Config(
            PinnedExperiment(self.app, experiment_id), log_config=None, access_log=False, lifespan="off"
        )
        server = uvicorn.Server(config)
        thread = threading.Thread(
            target=server.run, kwargs={"sockets": [sock]}, name=f"nnictl-{experiment_id}", daemon=True
        )
        thread.start()
        log.info(
            "experiment %s answers nnictl, and serves NNI's web UI, on http://127.0.0.1:%d",
            experiment_id,
            sock.getsockname()[1],
        )
        return _Listener(server, thread, sock.getsockname()[1])


def _now_ms() -> int:
    return int(time.time() * 1000)
