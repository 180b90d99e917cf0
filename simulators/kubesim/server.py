"""HTTPS front end: authentication, authorization, routing, and the JSON/streaming wire format.

Facts (kubernetes/kubernetes):
- Bearer token authentication failure is 401 `Unauthorized` (`staging/src/k8s.io/apiserver/pkg/endpoints/filters/
  authentication.go`); authorization (RBAC) runs before the resource handler, so a forbidden request gets 403 even
  for a resource that does not exist (`filters/authorization.go`).
- Watch responses (`staging/src/k8s.io/apiserver/pkg/endpoints/handlers/watch.go`) are chunked HTTP/1.1 with one
  JSON `{"type": ..., "object": ...}` per line; they end at timeoutSeconds by closing the stream cleanly. A too-old
  resourceVersion is answered with HTTP 200 and a single ERROR event carrying a 410 Expired Status.
  BOOKMARK objects carry only kind, apiVersion and metadata.resourceVersion.
- Create/update with fieldValidation (`handlers/create.go`, `handlers/rest.go` `fieldValidation`): Strict turns
  unknown/duplicate fields into 400 BadRequest `<Kind> in version "<v>" cannot be handled as a <Kind>: strict
  decoding error: unknown field "<path>"`, Warn (the default) adds `Warning: 299 - "unknown field \"<path>\""`
  headers, Ignore drops them silently.
- Create into a missing namespace: 404 `namespaces "<ns>" not found` (`plugin/pkg/admission/namespace/lifecycle`).
- ConfigMap total data over 1 MiB: 422 `ConfigMap "<n>" is invalid: []: Too long: must have at most 1048576 bytes`
  (`pkg/apis/core/validation/validation.go` ValidateConfigMap, core.MaxSecretSize).
- An update of a custom resource without metadata.resourceVersion is 422 `metadata.resourceVersion: Invalid value:
  0x0: must be specified for an update` (custom resources do not allow unconditional update).
- Pod logs (`pkg/registry/core/pod/strategy.go` LogLocation, `pkg/kubelet/kubelet_pods.go`): a pod not bound to a
  node is 400 `pod <name> does not have a host assigned`; a container not started yet is 400
  `container "<c>" in pod "<p>" is waiting to start: ContainerCreating`; an unknown container is 400
  `container <c> is not valid for pod <p>`; a pod with several containers and none named is 400
  `a container name must be specified for pod <p>, choose one of: [<names>]`.
- Custom resources reject strategic merge patch with 415 UnsupportedMediaType.
"""

from __future__ import annotations

import contextlib
import copy
import datetime as dt
import json
import re
import socket
import ssl
import threading
import time
import traceback
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qs, urlsplit

from simulators.httpserver import LoopbackServer, QuietHandler
from simulators.kubesim import errors, resources, schemas
from simulators.kubesim.errors import ApiError
from simulators.kubesim.resources import ResourceType
from simulators.kubesim.selectors import Selector
from simulators.kubesim.store import decode_continue, encode_continue

if TYPE_CHECKING:
    from simulators.kubesim.cluster import SimulatedCluster

CONFIGMAP_SCHEMA = schemas.obj(
    {
        "apiVersion": schemas.string(),
        "kind": schemas.string(),
        "metadata": schemas.obj(x_meta=True),
        "data": schemas.string_map(),
        "binaryData": schemas.string_map(),
        "immutable": schemas.boolean(),
    }
)
META_FIELDS = {
    "name",
    "generateName",
    "namespace",
    "labels",
    "annotations",
    "ownerReferences",
    "finalizers",
    "uid",
    "resourceVersion",
    "generation",
    "creationTimestamp",
    "deletionTimestamp",
    "deletionGracePeriodSeconds",
    "managedFields",
    "selfLink",
}
MAX_CONFIGMAP_BYTES = 1024 * 1024
CONFIGMAP_KEY = re.compile(r"^[-._a-zA-Z0-9]+$")


@dataclass
class Token:
    user: str
    namespaces: frozenset[str] | None


@dataclass
class Request:
    method: str
    path: str
    query: dict[str, str]
    headers: dict[str, str]
    body: bytes
    handler: Handler
    user: str = ""
    warnings: list[str] = field(default_factory=list)

    def json_body(self) -> Any:
        try:
            return json.loads(self.body or b"null")
        except ValueError as e:
            raise errors.bad_request(f"couldn't get version/kind; json parse error: {e}") from e

    def flag(self, name: str) -> bool:
        return self.query.get(name, "").lower() in ("true", "1")


@dataclass(eq=False)
class Stream:
    """An open watch or log-follow response, which break_watches()/break_log_streams() can cut."""

    kind: str  # "watch" or "log"
    handler: Handler
    wake: Callable[[], None]
    broken: bool = False

    def cut(self) -> None:
        self.broken = True
        with contextlib.suppress(OSError):
            self.handler.connection.shutdown(socket.SHUT_RDWR)
        self.wake()


class Handler(QuietHandler):
    server: _HTTPServer

    def setup(self) -> None:
        super().setup()
        try:
            self.connection.settimeout(30)
            self.connection.do_handshake()
            self.connection.settimeout(None)
        except (OSError, ssl.SSLError):
            self.close_connection = True
            raise

    def _dispatch(self) -> None:
        self.server.api.dispatch(self)

    do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = _dispatch

    # ---- response helpers ----------------------------------------------------------------------------------
    def send_json(self, code: int, body: Any, headers: dict[str, str] | None = None) -> None:
        data = json.dumps(body, separators=(",", ":")).encode()
        self.answer(code, data, "application/json", {"Audit-Id": "kubesim", **(headers or {})})

    def start_chunked(self, content_type: str) -> None:
        self.send_response(200)
        self.send_header("Content-Type", content_type)
        self.send_header("Transfer-Encoding", "chunked")
        self.send_header("Cache-Control", "no-cache, private")
        self.end_headers()
        self.wfile.flush()
        self.close_connection = True

    def write_chunk(self, data: bytes) -> None:
        if data:
            self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
            self.wfile.flush()

    def end_chunked(self) -> None:
        self.wfile.write(b"0\r\n\r\n")
        self.wfile.flush()


class _HTTPServer(LoopbackServer):
    allow_reuse_address = True

    def __init__(self, api: ApiServer, context: ssl.SSLContext) -> None:
        self.api = api
        self.context = context
        super().__init__(Handler)

    def get_request(self) -> tuple[socket.socket, Any]:
        sock, addr = self.socket.accept()
        return self.context.wrap_socket(sock, server_side=True, do_handshake_on_connect=False), addr

    def handle_error(self, request: Any, client_address: Any) -> None:
        return  # broken connections are part of the game


def _first(query: dict[str, list[str]]) -> dict[str, str]:
    return {k: v[-1] for k, v in query.items()}


class ApiServer:
    """Routes requests to the store and the kubelet, enforcing auth and the apiserver's request semantics."""

    def __init__(self, cluster: SimulatedCluster, cert: Path, key: Path) -> None:
        self.cluster = cluster
        self.tokens: dict[str, Token] = {}
        self.requests: Counter[str] = Counter()
        self.streams: set[Stream] = set()
        self.errors: list[str] = []
        self._streams_lock = threading.Lock()
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(str(cert), str(key))
        self.httpd = _HTTPServer(self, context)
        self.port = self.httpd.port

    def start(self) -> None:
        self.httpd.start("kubesim-apiserver", poll_interval=0.05)

    def stop(self) -> None:
        self.cut_streams(None)
        self.httpd.stop()

    def cut_streams(self, kind: str | None) -> int:
        with self._streams_lock:
            chosen = [s for s in self.streams if kind is None or s.kind == kind]
        for s in chosen:
            s.cut()
        return len(chosen)

    def _track(self, stream: Stream) -> None:
        with self._streams_lock:
            self.streams.add(stream)

    def _untrack(self, stream: Stream) -> None:
        with self._streams_lock:
            self.streams.discard(stream)

    # ---- entry ------------------------------------------------------------------------------------------------
    def dispatch(self, handler: Handler) -> None:
        parts = urlsplit(handler.path)
        body = handler.read_body()
        req = Request(
            method=handler.command,
            path=parts.path.rstrip("/") or "/",
            query=_first(parse_qs(parts.query, keep_blank_values=True)),
            headers={k.lower(): v for k, v in handler.headers.items()},
            body=body,
            handler=handler,
        )
        try:
            self._authenticate(req)
            self._route(req)
        except ApiError as e:
            handler.send_json(e.code, e.status(), e.headers)
        except (BrokenPipeError, ConnectionResetError, ssl.SSLError, OSError):
            handler.close_connection = True
        except Exception as e:  # a bug here must be visible, as a 500 like the real server's panics
            self.errors.append(traceback.format_exc())
            with contextlib.suppress(Exception):
                handler.send_json(500, ApiError(500, "InternalError", f"Internal error occurred: {e}").status())

    def _authenticate(self, req: Request) -> Token:
        auth = req.headers.get("authorization", "")
        token = self.tokens.get(auth[7:].strip()) if auth.lower().startswith("bearer ") else None
        if token is None:
            raise errors.unauthorized()
        req.user = token.user
        return token

    def _token(self, req: Request) -> Token:
        auth = req.headers.get("authorization", "")
        return self.tokens[auth[7:].strip()]

    def _authorize(
        self, req: Request, verb: str, rt_plural: str, group: str, namespace: str, name: str, subresource: str = ""
    ) -> None:
        token = self._token(req)
        if token.namespaces is None or (namespace and namespace in token.namespaces):
            return
        raise errors.forbidden(token.user, verb, rt_plural, subresource, group, namespace, name)

    # ---- routing ----------------------------------------------------------------------------------------------
    def _route(self, req: Request) -> None:
        p = req.path
        h = req.handler
        registry = self.cluster.registry
        if req.method == "GET" and p == "/version":
            self.requests["get version"] += 1
            return h.send_json(200, resources.version_info())
        if req.method == "GET" and p == "/api":
            self.requests["get discovery"] += 1
            return h.send_json(200, resources.api_versions(f"127.0.0.1:{self.port}"))
        if req.method == "GET" and p == "/api/v1":
            self.requests["get discovery"] += 1
            return h.send_json(200, resources.resource_list("v1", list(resources.CORE)))
        if req.method == "GET" and p == "/apis":
            self.requests["get discovery"] += 1
            return h.send_json(200, resources.api_group_list(registry))
        m = re.fullmatch(r"/apis/([^/]+)/([^/]+)", p)
        if req.method == "GET" and m:
            self.requests["get discovery"] += 1
            gv = f"{m[1]}/{m[2]}"
            found = registry.group_versions().get(gv)
            if found is None:
                raise errors.resource_not_found()
            return h.send_json(200, resources.resource_list(gv, found))
        if p == "/apis/authorization.k8s.io/v1/selfsubjectaccessreviews":
            if req.method != "POST":
                raise errors.method_not_allowed()
            self.requests["create selfsubjectaccessreviews"] += 1
            return self._access_review(req)
        m = re.fullmatch(r"/api/v1/namespaces(?:/([^/]+))?", p)
        if m:
            return self._namespaces(req, m[1])
        m = re.fullmatch(r"/api/v1(?:/namespaces/([^/]+))?/([^/]+)(?:/([^/]+))?(?:/([^/]+))?", p)
        group = version = ""
        if m:
            ns, plural, name, sub = m[1], m[2], m[3], m[4]
            version = "v1"
        else:
            m = re.fullmatch(r"/apis/([^/]+)/([^/]+)(?:/namespaces/([^/]+))?/([^/]+)(?:/([^/]+))?(?:/([^/]+))?", p)
            if not m:
                raise errors.resource_not_found()
            group, version, ns, plural, name, sub = m[1], m[2], m[3], m[4], m[5], m[6]
        verb = self._verb(req, name, sub)
        self._authorize(req, verb, plural, group, ns or "", name or "", sub or "")
        rt = registry.lookup(group, version, plural)
        if rt is None or not rt.namespaced:
            raise errors.resource_not_found()
        if sub and sub not in rt.subresources:
            raise errors.resource_not_found()
        label = f"{verb} {plural}" + (f"/{sub}" if sub else "")
        if sub == "log" and req.flag("follow"):
            label = "follow pods/log"
        self.requests[label] += 1
        if sub == "log":
            return self._pod_log(req, ns or "", name or "")
        if verb in ("list", "watch"):
            return self._list_or_watch(req, rt, ns, verb == "watch")
        if verb == "get":
            return h.send_json(200, self._external(rt, self.cluster.store.must_get(rt, ns or "", name or "")))
        if verb == "create":
            return self._create(req, rt, ns or "")
        if verb == "update":
            return self._update(req, rt, ns or "", name or "", sub)
        if verb == "patch":
            return self._patch(req, rt, ns or "", name or "", sub)
        if verb == "delete":
            return self._delete(req, rt, ns or "", name or "")
        if verb == "deletecollection":
            return self._delete_collection(req, rt, ns or "")
        raise errors.method_not_allowed()

    @staticmethod
    def _verb(req: Request, name: str | None, sub: str | None) -> str:
        m = req.method
        if m == "GET":
            if name:
                return "get"
            return "watch" if req.flag("watch") else "list"
        if m == "POST":
            if name:
                raise errors.method_not_allowed()
            return "create"
        if m == "PUT":
            return "update"
        if m == "PATCH":
            return "patch"
        if m == "DELETE":
            return "delete" if name else "deletecollection"
        raise errors.method_not_allowed()

    # ---- namespaces / access reviews -------------------------------------------------------------------------
    def _namespaces(self, req: Request, name: str | None) -> None:
        store = self.cluster.store
        if req.method != "GET":
            raise errors.method_not_allowed()
        if name:
            self._authorize(req, "get", "namespaces", "", name, name)
            self.requests["get namespaces"] += 1
            return req.handler.send_json(200, store.must_get(resources.NAMESPACES, "", name))
        self._authorize(req, "list", "namespaces", "", "", "")
        self.requests["list namespaces"] += 1
        items, rv = store.list(resources.NAMESPACES, None)
        return req.handler.send_json(
            200,
            {
                "kind": "NamespaceList",
                "apiVersion": "v1",
                "metadata": {"resourceVersion": str(rv)},
                "items": [self._strip_type(i) for i in items],
            },
        )

    def _access_review(self, req: Request) -> None:
        body = req.json_body() or {}
        attrs = ((body.get("spec") or {}).get("resourceAttributes")) or {}
        token = self._token(req)
        ns = attrs.get("namespace", "")
        allowed = token.namespaces is None or (bool(ns) and ns in token.namespaces)
        status: dict[str, Any] = {"allowed": allowed}
        if allowed:
            status["reason"] = (
                f'RBAC: allowed by ClusterRoleBinding "kubesim" of ClusterRole "edit" to User "{token.user}"'
            )
        req.handler.send_json(
            201,
            {
                "kind": "SelfSubjectAccessReview",
                "apiVersion": "authorization.k8s.io/v1",
                "metadata": {"creationTimestamp": None},
                "spec": body.get("spec") or {},
                "status": status,
            },
        )

    # ---- object rendering ------------------------------------------------------------------------------------
    @staticmethod
    def _strip_type(obj: dict[str, Any]) -> dict[str, Any]:
        obj = dict(obj)
        obj.pop("kind", None)
        obj.pop("apiVersion", None)
        return obj

    @staticmethod
    def _external(rt: ResourceType, obj: dict[str, Any]) -> dict[str, Any]:
        obj["apiVersion"], obj["kind"] = rt.api_version, rt.kind
        return obj

    # ---- list / watch ----------------------------------------------------------------------------------------
    def _list_or_watch(self, req: Request, rt: ResourceType, ns: str | None, watch: bool) -> None:
        selector = Selector(rt.plural, req.query.get("labelSelector"), req.query.get("fieldSelector"))
        if watch:
            return self._watch(req, rt, ns, selector)
        items, rv = self.cluster.store.list(rt, ns, selector)
        meta: dict[str, Any] = {"resourceVersion": str(rv)}
        limit = int(req.query.get("limit") or 0)
        if req.query.get("continue"):
            rv, after = decode_continue(req.query["continue"])
            meta["resourceVersion"] = str(rv)
            items = [i for i in items if (i["metadata"].get("namespace", ""), i["metadata"]["name"]) > after]
        if limit and len(items) > limit:
            last = items[limit - 1]["metadata"]
            meta["continue"] = encode_continue(rv, (last.get("namespace", ""), last["name"]))
            meta["remainingItemCount"] = len(items) - limit
            items = items[:limit]
        if not rt.custom:
            items = [self._strip_type(i) for i in items]
        req.handler.send_json(
            200, {"kind": rt.list_kind, "apiVersion": rt.api_version, "metadata": meta, "items": items}
        )

    def _watch(self, req: Request, rt: ResourceType, ns: str | None, selector: Selector) -> None:
        store = self.cluster.store
        h = req.handler
        raw_rv = req.query.get("resourceVersion", "")
        try:
            rv = int(raw_rv) if raw_rv else None
        except ValueError as e:
            raise errors.bad_request(f"invalid resource version: {raw_rv}") from e
        timeout = float(req.query["timeoutSeconds"]) if req.query.get("timeoutSeconds") else None
        bookmarks = req.flag("allowWatchBookmarks")
        interval = self.cluster.bookmark_interval_s
        try:
            watcher = store.watch(rt, ns, selector, rv)
        except ApiError as e:
            h.start_chunked("application/json")
            h.write_chunk(json.dumps({"type": "ERROR", "object": e.status()}).encode() + b"\n")
            h.end_chunked()
            return
        stream = Stream("watch", h, watcher.close)
        self._track(stream)
        deadline = time.monotonic() + timeout if timeout is not None else None
        next_bookmark = time.monotonic() + interval
        try:
            h.start_chunked("application/json")
            while True:
                now = time.monotonic()
                if deadline is not None and now >= deadline:
                    break
                wait = min(x for x in (deadline, next_bookmark if bookmarks else None, now + 3600) if x is not None)
                try:
                    item = watcher.events.get(timeout=max(0.0, wait - now))
                except Exception:  # queue.Empty
                    item = ()  # type: ignore[assignment]
                if stream.broken:
                    return
                if item is None:
                    break
                if item == ():
                    if bookmarks and time.monotonic() >= next_bookmark:
                        with store.lock:
                            idle = watcher.events.empty()
                            current = store.resource_version
                        if idle:
                            mark = {
                                "kind": rt.kind,
                                "apiVersion": rt.api_version,
                                "metadata": {"resourceVersion": str(current), "creationTimestamp": None},
                            }
                            h.write_chunk(json.dumps({"type": "BOOKMARK", "object": mark}).encode() + b"\n")
                        next_bookmark = time.monotonic() + interval
                    continue
                type_, obj = item
                h.write_chunk(json.dumps({"type": type_, "object": obj}, separators=(",", ":")).encode() + b"\n")
            if not stream.broken:
                h.end_chunked()
        except (OSError, ssl.SSLError):
            h.close_connection = True
        finally:
            store.unwatch(watcher)
            self._untrack(stream)

    # ---- create / update / patch ------------------------------------------------------------------------------
    def _admit(self, req: Request, rt: ResourceType, ns: str, body: Any, *, creating: bool) -> dict[str, Any]:
        """Decode, prune/validate against the schema, check metadata; returns the cleaned object."""
        if not isinstance(body, dict):
            raise errors.bad_request(f"Object 'Kind' is missing in '{req.body[:200].decode(errors='replace')}'")
        api_version, kind = body.get("apiVersion"), body.get("kind")
        if rt.custom and not kind:
            raise errors.bad_request(f"Object 'Kind' is missing in '{req.body[:200].decode(errors='replace')}'")
        if api_version and api_version != rt.api_version:
            raise errors.bad_request(
                f"the API version in the data ({api_version}) does not match the expected API version "
                f"({rt.api_version})"
            )
        if kind and kind != rt.kind:
            raise errors.bad_request(f"the kind in the data ({kind}) does not match the expected kind ({rt.kind})")
        md = body.get("metadata") or {}
        if not isinstance(md, dict):
            raise errors.bad_request("metadata must be an object")
        schema = schemas.SCHEMAS.get(rt.plural) or (CONFIGMAP_SCHEMA if rt.plural == "configmaps" else None)
        unknown = [f"metadata.{k}" for k in md if k not in META_FIELDS]
        outcome = schemas.validate(schema, body) if schema is not None else schemas.Outcome(copy.deepcopy(body))
        unknown += outcome.unknown
        mode = req.query.get("fieldValidation", "Warn")
        if mode not in ("Strict", "Warn", "Ignore"):
            raise errors.bad_request(
                f'fieldValidation parameter unsupported: {mode}. Supported values are "Ignore", "Warn", "Strict"'
            )
        if unknown and mode == "Strict":
            listed = ", ".join(f'unknown field "{u}"' for u in unknown)
            raise errors.bad_request(
                f'{rt.kind} in version "{rt.version}" cannot be handled as a {rt.kind}: strict decoding error: {listed}'
            )
        if unknown and mode == "Warn":
            req.warnings += [f'unknown field "{u}"' for u in unknown]
        obj: dict[str, Any] = outcome.value
        obj["metadata"] = {k: copy.deepcopy(v) for k, v in md.items() if k in META_FIELDS}
        meta = obj["metadata"]
        if meta.get("namespace") and meta["namespace"] != ns:
            raise errors.bad_request(
                "the namespace of the provided object does not match the namespace sent on the request"
            )
        meta["namespace"] = ns
        if creating and not meta.get("name") and meta.get("generateName"):
            import secrets

            alphabet = "bcdfghjklmnpqrstvwxz2456789"
            meta["name"] = meta["generateName"] + "".join(secrets.choice(alphabet) for _ in range(5))
        if creating and self.cluster.store.get(resources.NAMESPACES, "", ns) is None:
            raise errors.not_found("namespaces", "", ns)
        causes = list(schemas.name_errors(meta.get("name", "")))
        causes += schemas.label_errors(meta.get("labels"))
        causes += schemas.annotation_errors(meta.get("annotations"))
        fc_name = rt.plural == "frameworks" and meta.get("name") and not re.fullmatch(schemas.FC_NAME, meta["name"])
        if fc_name:
            causes.append(
                errors.invalid("metadata.name", meta["name"], f"metadata.name in body should match '{schemas.FC_NAME}'")
            )
        causes += outcome.errors
        if rt.plural == "configmaps":
            causes += self._configmap_errors(obj)
        if causes:
            raise errors.invalid_object(rt.kind, rt.group, meta.get("name", ""), causes)
        self.cluster.admission_webhooks(rt, obj)
        return obj

    @staticmethod
    def _configmap_errors(obj: dict[str, Any]) -> list[errors.FieldError]:
        out: list[errors.FieldError] = []
        total = 0
        for part in ("data", "binaryData"):
            for key, value in (obj.get(part) or {}).items():
                if not CONFIGMAP_KEY.match(key) or len(key) > 253:
                    out.append(
                        errors.invalid(
                            f"{part}[{key}]",
                            key,
                            "a valid config key must consist of "
                            "alphanumeric characters, '-', '_' or '.' (e.g. 'key.name',  or "
                            "'KEY_NAME',  or 'key-name', regex used for validation is "
                            "'[-._a-zA-Z0-9]+')",
                        )
                    )
                total += len(value.encode()) if part == "data" else len(value) * 3 // 4
        if total > MAX_CONFIGMAP_BYTES:
            out.append(errors.too_long("[]", MAX_CONFIGMAP_BYTES))
        return out

    def _warn_headers(self, req: Request) -> dict[str, str]:
        if not req.warnings:
            return {}
        return {"Warning": ", ".join('299 - "' + w.replace('"', '\\"') + '"' for w in req.warnings)}

    def _create(self, req: Request, rt: ResourceType, ns: str) -> None:
        obj = self._admit(req, rt, ns, req.json_body(), creating=True)
        if rt.plural == "pods":
            created = self.cluster.create_pod(obj)
        else:
            obj.pop("status", None)
            created = self.cluster.store.create(rt, obj)
        req.handler.send_json(201, self._external(rt, created), self._warn_headers(req))

    def _update(self, req: Request, rt: ResourceType, ns: str, name: str, sub: str | None) -> None:
        body = req.json_body()
        obj = self._admit(req, rt, ns, body, creating=False)
        if obj["metadata"].get("name") != name:
            raise errors.bad_request(
                "the name of the object ({}) does not match the name on the URL ({})".format(
                    obj["metadata"].get("name"), name
                )
            )
        rv = obj["metadata"].get("resourceVersion")
        if not rv and rt.custom:
            raise errors.invalid_object(
                rt.kind,
                rt.group,
                name,
                [
                    errors.FieldError(
                        "FieldValueInvalid",
                        "metadata.resourceVersion",
                        "Invalid value: 0x0: must be specified for an update",
                    )
                ],
            )
        updated = self._write(rt, ns, name, obj, sub, rv)
        req.handler.send_json(200, self._external(rt, updated), self._warn_headers(req))

    def _write(
        self, rt: ResourceType, ns: str, name: str, new: dict[str, Any], sub: str | None, rv: str | None
    ) -> dict[str, Any]:
        def replace(cur: dict[str, Any]) -> dict[str, Any]:
            merged = copy.deepcopy(new)
            md = merged.setdefault("metadata", {})
            for keep in ("uid", "creationTimestamp", "generation", "deletionTimestamp", "deletionGracePeriodSeconds"):
                if keep in cur["metadata"]:
                    md[keep] = cur["metadata"][keep]
            if sub != "status" and not rt.status_subresource and "status" not in new and "status" in cur:
                merged["status"] = cur["status"]
            return merged

        return self.cluster.store.update(rt, ns, name, replace, subresource=sub or None, expect_rv=rv or None)

    def _patch(self, req: Request, rt: ResourceType, ns: str, name: str, sub: str | None) -> None:
        ctype = req.headers.get("content-type", "").split(";")[0].strip()
        patch = req.json_body()
        current = self.cluster.store.must_get(rt, ns, name)
        if ctype == "application/merge-patch+json" or (
            ctype == "application/strategic-merge-patch+json" and not rt.custom
        ):
            patched = merge_patch(current, patch)
        elif ctype == "application/json-patch+json":
            patched = json_patch(current, patch)
        else:
            raise errors.unsupported_media_type(ctype)
        rv = patched.get("metadata", {}).get("resourceVersion")
        expect = rv if rv != current["metadata"]["resourceVersion"] and rv else None
        obj = self._admit(req, rt, ns, patched, creating=False)
        updated = self._write(rt, ns, name, obj, sub, expect)
        req.handler.send_json(200, self._external(rt, updated), self._warn_headers(req))

    # ---- delete ---------------------------------------------------------------------------------------------
    def _delete_options(self, req: Request) -> dict[str, Any]:
        body = req.json_body() if req.body else None
        opts: dict[str, Any] = dict(body) if isinstance(body, dict) else {}
        if "propagationPolicy" in req.query:
            opts["propagationPolicy"] = req.query["propagationPolicy"]
        if "gracePeriodSeconds" in req.query:
            opts["gracePeriodSeconds"] = int(req.query["gracePeriodSeconds"])
        if "orphanDependents" in req.query:
            opts["orphanDependents"] = req.query["orphanDependents"].lower() == "true"
        policy = opts.get("propagationPolicy")
        if policy is None and opts.get("orphanDependents") is not None:
            policy = "Orphan" if opts["orphanDependents"] else "Background"
        if policy not in (None, "Background", "Foreground", "Orphan"):
            raise errors.invalid_object(
                "DeleteOptions",
                "",
                "",
                [errors.not_supported("propagationPolicy", policy, ["Foreground", "Background", "Orphan", "nil"])],
            )
        opts["propagationPolicy"] = policy
        return opts

    def _delete(self, req: Request, rt: ResourceType, ns: str, name: str) -> None:
        opts = self._delete_options(req)
        pre = opts.get("preconditions") or {}
        obj, removed = self.cluster.store.delete(
            rt,
            ns,
            name,
            propagation=opts["propagationPolicy"],
            grace_period=opts.get("gracePeriodSeconds"),
            precondition_uid=pre.get("uid"),
            precondition_rv=pre.get("resourceVersion"),
        )
        if rt.plural == "configmaps" and removed:
            body = {
                "kind": "Status",
                "apiVersion": "v1",
                "metadata": {},
                "status": "Success",
                "details": {"name": name, "kind": rt.plural, "uid": obj["metadata"]["uid"]},
            }
            return req.handler.send_json(200, body)
        req.handler.send_json(200, self._external(rt, obj))

    def _delete_collection(self, req: Request, rt: ResourceType, ns: str) -> None:
        opts = self._delete_options(req)
        selector = Selector(rt.plural, req.query.get("labelSelector"), req.query.get("fieldSelector"))
        items, _ = self.cluster.store.list(rt, ns, selector)
        deleted = []
        for item in items:
            try:
                obj, _ = self.cluster.store.delete(
                    rt,
                    ns,
                    item["metadata"]["name"],
                    propagation=opts["propagationPolicy"],
                    grace_period=opts.get("gracePeriodSeconds"),
                )
                deleted.append(obj)
            except ApiError:
                continue
        _, rv = self.cluster.store.list(rt, ns, selector)
        req.handler.send_json(
            200,
            {
                "kind": rt.list_kind,
                "apiVersion": rt.api_version,
                "metadata": {"resourceVersion": str(rv)},
                "items": deleted,
            },
        )

    # ---- pod logs ---------------------------------------------------------------------------------------------
    def _pod_log(self, req: Request, ns: str, name: str) -> None:
        pod = self.cluster.store.must_get(resources.PODS, ns, name)
        containers = [c["name"] for c in pod["spec"].get("containers") or []]
        container = req.query.get("container") or ""
        if not container:
            if len(containers) != 1:
                raise errors.bad_request(
                    f"a container name must be specified for pod {name}, choose one of: [{' '.join(containers)}]"
                )
            container = containers[0]
        elif container not in containers:
            raise errors.bad_request(f"container {container} is not valid for pod {name}")
        if not pod["spec"].get("nodeName"):
            raise errors.bad_request(f"pod {name} does not have a host assigned")
        log = self.cluster.kubelet.container_log(pod, container, previous=req.flag("previous"))
        since_ns = None
        if req.query.get("sinceSeconds"):
            since_ns = time.time_ns() - int(req.query["sinceSeconds"]) * 1_000_000_000
        if req.query.get("sinceTime"):
            try:
                t = dt.datetime.fromisoformat(req.query["sinceTime"].replace("Z", "+00:00"))
            except ValueError as e:
                raise errors.bad_request(f'parsing time "{req.query["sinceTime"]}": {e}') from e
            since_ns = int(t.timestamp()) * 1_000_000_000
        tail = int(req.query["tailLines"]) if req.query.get("tailLines") else None
        limit = int(req.query["limitBytes"]) if req.query.get("limitBytes") else None
        timestamps = req.flag("timestamps")
        follow = req.flag("follow")
        which = req.query.get("stream") or "All"
        if which not in ("All", "Stdout", "Stderr"):
            raise errors.invalid_object(
                "PodLogOptions", "", "", [errors.not_supported("stream", which, ["All", "Stderr", "Stdout"])]
            )
        if which != "All" and tail is not None:
            raise errors.invalid_object(
                "PodLogOptions",
                "",
                "",
                [
                    errors.forbidden_field(
                        "tailLines", "`tailLines` and specific `stream` are mutually exclusive for now"
                    )
                ],
            )
        wanted = {"All": None, "Stdout": "stdout", "Stderr": "stderr"}[which]
        h = req.handler
        stream = Stream("log", h, log.wake)
        self._track(stream)
        sent = 0
        try:
            h.start_chunked("text/plain")
            cursor, lines = log.select(since_ns, tail)
            while True:
                for line in lines:
                    if wanted is not None and line.stream != wanted:
                        continue
                    data = (format_ts(line.ts_ns) + " " if timestamps else "").encode() + line.data
                    if limit is not None and sent + len(data) > limit:
                        h.write_chunk(data[: limit - sent])
                        h.end_chunked()
                        return
                    h.write_chunk(data)
                    sent += len(data)
                if not follow:
                    break
                cursor, lines, done = log.wait_after(cursor, lambda: stream.broken)
                if stream.broken:
                    return
                if done and not lines:
                    break
            h.end_chunked()
        except (OSError, ssl.SSLError):
            h.close_connection = True
        finally:
            self._untrack(stream)


def format_ts(ts_ns: int) -> str:
    """RFC3339Nano with 9 fixed digits, as the kubelet writes log timestamps (RFC3339NanoFixed)."""
    secs, nanos = divmod(ts_ns, 1_000_000_000)
    return dt.datetime.fromtimestamp(secs, dt.UTC).strftime("%Y-%m-%dT%H:%M:%S") + f".{nanos:09d}Z"


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = copy.deepcopy(target) if isinstance(target, dict) else {}
    for k, v in patch.items():
        if v is None:
            result.pop(k, None)
        else:
            result[k] = merge_patch(result.get(k), v)
    return result


def json_patch(target: Any, ops: Any) -> Any:
    """RFC 6902 JSON patch (add, remove, replace, test, copy, move)."""
    doc = copy.deepcopy(target)
    if not isinstance(ops, list):
        raise errors.bad_request("json: cannot unmarshal object into Go value of type jsonpatch.Patch")

    def parse(pointer: str) -> list[str]:
        return [p.replace("~1", "/").replace("~0", "~") for p in pointer.split("/")[1:]]

    def walk(path: list[str]) -> tuple[Any, str]:
        node = doc
        for part in path[:-1]:
            node = node[int(part)] if isinstance(node, list) else node[part]
        return node, path[-1]

    for op in ops:
        try:
            kind, path = op["op"], parse(op["path"])
            parent, last = walk(path)
            if kind == "test":
                value = parent[int(last)] if isinstance(parent, list) else parent[last]
                if value != op["value"]:
                    raise errors.ApiError(
                        422, "Invalid", "the server rejected our request due to an error in our request", {}
                    )
            elif kind == "remove":
                del parent[int(last) if isinstance(parent, list) else last]
            elif kind in ("add", "replace", "copy", "move"):
                if kind in ("copy", "move"):
                    src_parent, src_last = walk(parse(op["from"]))
                    value = src_parent[int(src_last)] if isinstance(src_parent, list) else src_parent[src_last]
                    if kind == "move":
                        del src_parent[int(src_last) if isinstance(src_parent, list) else src_last]
                else:
                    value = op["value"]
                if isinstance(parent, list):
                    idx = len(parent) if last == "-" else int(last)
                    if kind == "replace":
                        parent[idx] = value
                    else:
                        parent.insert(idx, value)
                else:
                    if kind == "replace" and last not in parent:
                        raise KeyError(last)
                    parent[last] = copy.deepcopy(value)
        except (KeyError, IndexError, ValueError, TypeError) as e:
            raise errors.ApiError(
                422, "Invalid", f"the server rejected our request due to an error in our request: {e}", {}
            ) from e
    return doc
