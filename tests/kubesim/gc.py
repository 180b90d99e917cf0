"""The garbage collector: cascading deletion through metadata.ownerReferences.

Facts (kubernetes/kubernetes `pkg/controller/garbagecollector/garbagecollector.go`): an object whose owners are
all gone is deleted (background); an owner deleting with the `orphan` finalizer has its ownerReference removed
from every dependent before the finalizer is dropped; an owner deleting with the `foregroundDeletion` finalizer
has its dependents deleted and keeps existing (with deletionTimestamp) until they are gone.
"""

from __future__ import annotations

import contextlib
from typing import Any

from tests.kubesim.controller import Controller
from tests.kubesim.errors import ApiError
from tests.kubesim.store import Event, Store


class GarbageCollector(Controller):
    name = "garbage-collector"

    def __init__(self, store: Store) -> None:
        super().__init__()
        self.store = store
        store.subscribe(self._on_event)

    def _on_event(self, ev: Event) -> None:
        if (
            ev.type == "DELETED"
            or ev.obj["metadata"].get("deletionTimestamp")
            or ev.obj["metadata"].get("ownerReferences")
        ):
            self.queue.add("scan")

    def reconcile(self, key: Any) -> None:
        objects = list(self.store.all_objects())
        uids = {o["metadata"]["uid"] for _, o in objects}
        dependents: dict[str, list[tuple[Any, dict[str, Any]]]] = {}
        for rt, o in objects:
            for ref in o["metadata"].get("ownerReferences") or []:
                dependents.setdefault(ref.get("uid", ""), []).append((rt, o))
        for rt, o in objects:
            md = o["metadata"]
            ns = md.get("namespace", "")
            finalizers = md.get("finalizers") or []
            if md.get("deletionTimestamp") and "orphan" in finalizers:
                for drt, d in dependents.get(md["uid"], []):
                    self._drop_owner(drt, d, md["uid"])
                self.store.remove_finalizer(rt, ns, md["name"], "orphan")
            elif md.get("deletionTimestamp") and "foregroundDeletion" in finalizers:
                remaining = dependents.get(md["uid"], [])
                for drt, d in remaining:
                    if not d["metadata"].get("deletionTimestamp"):
                        self._delete(drt, d, "Foreground")
                if not remaining:
                    self.store.remove_finalizer(rt, ns, md["name"], "foregroundDeletion")
            refs = md.get("ownerReferences") or []
            if refs and not md.get("deletionTimestamp") and all(r.get("uid") not in uids for r in refs):
                self._delete(rt, o, "Background")

    def _drop_owner(self, rt: Any, obj: dict[str, Any], owner_uid: str) -> None:
        def drop(o: dict[str, Any]) -> None:
            refs = [r for r in o["metadata"].get("ownerReferences") or [] if r.get("uid") != owner_uid]
            if refs:
                o["metadata"]["ownerReferences"] = refs
            else:
                o["metadata"].pop("ownerReferences", None)

        with contextlib.suppress(ApiError):
            self.store.update(
                rt,
                obj["metadata"].get("namespace", ""),
                obj["metadata"]["name"],
                drop,
                expect_uid=obj["metadata"]["uid"],
            )

    def _delete(self, rt: Any, obj: dict[str, Any], propagation: str) -> None:
        with contextlib.suppress(ApiError):
            self.store.delete(
                rt,
                obj["metadata"].get("namespace", ""),
                obj["metadata"]["name"],
                propagation=propagation,
                precondition_uid=obj["metadata"]["uid"],
            )
