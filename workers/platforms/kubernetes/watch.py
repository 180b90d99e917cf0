"""One watch per namespace and kind, shared by every attempt a worker follows there: taken up again from
where it was when the server ends it, and telling its trials UNKNOWN when it keeps failing."""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from kubernetes import watch as k8s_watch
from kubernetes.client.exceptions import ApiException

from workers.platforms.kubernetes.cluster import REQUEST_TIMEOUT, describe
from workers.platforms.kubernetes.pod_log import _interrupt

log = logging.getLogger(__name__)


WATCH_TIMEOUT_S = 240  # the server ends a watch after this; it is taken up again from where it was
UNKNOWN_AFTER_S = 5.0  # a watch failing this long makes its trials UNKNOWN (one broken stream does not)


class WatchedKind:
    """The objects of one kind in one namespace, kept current by one list-then-watch, shared by every
    attempt this process follows there. Bookmarks keep its resourceVersion fresh; a 410 Gone relists."""

    def __init__(self, name: str, list_call: Callable[..., Any], label_selector: str, index_label: str | None) -> None:
        self._list = list_call
        self._selector = label_selector
        self._index_label = index_label  # pods: grouped by the resource they belong to
        self._objects: dict[str, dict[str, Any]] = {}
        self._listeners: dict[str, set[Callable[[], None]]] = {}
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self.synced = threading.Event()
        self._failing: tuple[float, str] | None = None  # since when, and why, the watch cannot be kept
        self._response: Any = None
        self._thread = threading.Thread(target=self._run, name=f"watch-{name}", daemon=True)
        self._thread.start()

    def get(self, name: str) -> dict[str, Any] | None:
        with self._lock:
            return self._objects.get(name)

    def grouped(self, key: str) -> list[dict[str, Any]]:
        """The objects whose index label is `key` (a resource's pods)."""
        with self._lock:
            return [obj for obj in self._objects.values() if _labels(obj).get(self._index_label or "") == key]

    def trouble(self) -> str | None:
        """Why the cluster cannot be followed, once the watch has failed for UNKNOWN_AFTER_S."""
        failing = self._failing
        if failing is None or time.monotonic() - failing[0] < UNKNOWN_AFTER_S:
            return None
        return failing[1]

    def listen(self, key: str, callback: Callable[[], None]) -> None:
        with self._lock:
            self._listeners.setdefault(key, set()).add(callback)

    def forget(self, key: str, callback: Callable[[], None]) -> None:
        with self._lock:
            self._listeners.get(key, set()).discard(callback)
            if not self._listeners.get(key):
                self._listeners.pop(key, None)

    def close(self) -> None:
        self._closed.set()
        _interrupt(self._response)

    def _run(self) -> None:
        pause = 0.2
        version: str | None = None
        while not self._closed.is_set():
            try:
                if version is None:
                    version = self._relist()
                version = self._watch(version)
                pause = 0.2
            except ApiException as error:
                if error.status == 410:  # our resourceVersion is older than the server's history
                    version = None
                    continue
                log.warning("watch: %s", describe(error))
                self._fail(describe(error))
            except Exception as error:  # a broken connection: taken up again from the last version seen
                if self._closed.is_set():
                    return
                log.info("watch interrupted: %s", describe(error))
                self._fail(describe(error))
            self._closed.wait(pause)
            pause = min(pause * 2, 5.0)

    def _fail(self, reason: str) -> None:
        self._failing = (self._failing[0] if self._failing else time.monotonic(), reason)

    def _healthy(self) -> None:
        if self._failing is not None:
            self._failing = None
            for callback in self._all_listeners():
                callback()

    def _all_listeners(self) -> list[Callable[[], None]]:
        with self._lock:
            return [callback for callbacks in self._listeners.values() for callback in callbacks]

    def _relist(self) -> str:
        response = self._list(label_selector=self._selector, _preload_content=False, _request_timeout=REQUEST_TIMEOUT)
        listed = json.loads(response.data or b"{}")
        objects = {obj["metadata"]["name"]: obj for obj in listed.get("items") or []}
        with self._lock:
            changed = set(objects) ^ set(self._objects) | {
                name for name, obj in objects.items() if self._objects.get(name) != obj
            }
            self._objects = objects
        self.synced.set()
        self._healthy()
        for name in changed:
            self._notify(name, objects.get(name))
        return str(listed["metadata"]["resourceVersion"])

    def _watch(self, version: str) -> str:
        watcher = k8s_watch.Watch()
        stream = watcher.stream(
            self._list,
            label_selector=self._selector,
            resource_version=version,
            allow_watch_bookmarks=True,
            timeout_seconds=WATCH_TIMEOUT_S,
            _request_timeout=(REQUEST_TIMEOUT[0], WATCH_TIMEOUT_S + 30),
        )
        for event in stream:
            if self._closed.is_set():
                watcher.stop()
                break
            obj = event["raw_object"]
            version = str(obj["metadata"]["resourceVersion"])
            self._healthy()
            if event["type"] == "BOOKMARK":
                continue
            name = obj["metadata"]["name"]
            with self._lock:
                previous = self._objects.get(name)
                if event["type"] == "DELETED":
                    self._objects.pop(name, None)
                else:
                    self._objects[name] = obj
            self._notify(name, obj if event["type"] != "DELETED" else None, previous)
        return watcher.resource_version or version

    def _notify(self, name: str, obj: dict[str, Any] | None, previous: dict[str, Any] | None = None) -> None:
        keys = {name}
        if self._index_label:
            keys |= {_labels(o).get(self._index_label, "") for o in (obj, previous) if o is not None}
        with self._lock:
            callbacks = [callback for key in keys for callback in self._listeners.get(key, ())]
        for callback in callbacks:
            callback()


def _labels(obj: dict[str, Any]) -> dict[str, str]:
    return obj.get("metadata", {}).get("labels") or {}


def bound_call(call: Callable[..., Any], *args: str) -> Callable[..., Any]:
    """`call` with its positional arguments bound; keeps the docstring the client's Watch reads its return type from."""

    def bound(**kwargs: Any) -> Any:
        return call(*args, **kwargs)

    bound.__doc__ = call.__doc__
    return bound
