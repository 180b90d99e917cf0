"""Kubernetes `Status` errors, shaped like the real apiserver's so `kubernetes.client.ApiException` carries them.

Facts (kubernetes/kubernetes `staging/src/k8s.io/apimachinery/pkg/api/errors/errors.go`):
- NotFound: `<resource>[.<group>] "<name>" not found`, reason NotFound, 404, details {name, group, kind=<resource>}.
- AlreadyExists: `<resource>[.<group>] "<name>" already exists`, 409.
- Invalid: `<Kind>[.<group>] "<name>" is invalid: <cause>` (several causes: `[c1, c2]`), 422, details.causes
  [{reason, message, field}] where message is the field error's body (e.g. `Required value`).
- Conflict: `Operation cannot be fulfilled on <resource>[.<group>] "<name>": <why>`, 409.
- Forbidden (RBAC, `plugin/pkg/auth/authorizer/rbac`): `<resource>[.<group>] ["<name>" ]is forbidden: User "<u>"
  cannot <verb> resource "<resource>[/<sub>]" in API group "<group>" in the namespace "<ns>"`, 403.
- Expired (watch from a compacted resourceVersion, `storage/cacher`): `too old resource version: <rv> (<oldest>)`,
  reason Expired, 410, sent as an ERROR watch event.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class FieldError:
    """One field error, as `k8s.io/apimachinery/pkg/util/validation/field.Error` renders it."""

    reason: str  # FieldValueRequired, FieldValueInvalid, FieldValueNotSupported, FieldValueTypeInvalid, ...
    field: str
    body: str  # e.g. 'Required value' or 'Invalid value: "x": must be ...'

    def __str__(self) -> str:
        return f"{self.field}: {self.body}"


def quote(value: Any) -> str:
    """Go's %q-ish rendering used in field error bodies: strings quoted, numbers bare."""
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    if isinstance(value, int | float):
        return str(value)
    return '"' + type(value).__name__ + '"'


def required(path: str, detail: str = "") -> FieldError:
    return FieldError("FieldValueRequired", path, "Required value" + (f": {detail}" if detail else ""))


def invalid(path: str, value: Any, detail: str) -> FieldError:
    return FieldError("FieldValueInvalid", path, f"Invalid value: {quote(value)}: {detail}")


def type_invalid(path: str, value: Any, detail: str) -> FieldError:
    return FieldError("FieldValueTypeInvalid", path, f"Invalid value: {quote(value)}: {detail}")


def not_supported(path: str, value: Any, allowed: list[Any]) -> FieldError:
    values = ", ".join(quote(v) for v in allowed)
    return FieldError("FieldValueNotSupported", path, f"Unsupported value: {quote(value)}: supported values: {values}")


def too_long(path: str, limit: int) -> FieldError:
    return FieldError("FieldValueTooLong", path, f"Too long: must have at most {limit} bytes")


def not_found_field(path: str, value: Any) -> FieldError:
    return FieldError("FieldValueNotFound", path, f"Not found: {quote(value)}")


def duplicate(path: str, value: Any) -> FieldError:
    return FieldError("FieldValueDuplicate", path, f"Duplicate value: {quote(value)}")


def forbidden_field(path: str, detail: str) -> FieldError:
    return FieldError("FieldValueForbidden", path, f"Forbidden: {detail}")


@dataclass
class ApiError(Exception):
    """An error the server answers with a `Status` body."""

    code: int
    reason: str
    message: str
    details: dict[str, Any] = field(default_factory=dict)
    headers: dict[str, str] = field(default_factory=dict)

    def __str__(self) -> str:
        return f"{self.code} {self.reason}: {self.message}"

    def status(self) -> dict[str, Any]:
        body: dict[str, Any] = {
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": self.message,
            "reason": self.reason,
            "code": self.code,
        }
        if self.details:
            body["details"] = self.details
        return body


def qualified(resource: str, group: str) -> str:
    return f"{resource}.{group}" if group else resource


def _details(name: str | None, group: str, kind: str) -> dict[str, Any]:
    details: dict[str, Any] = {}
    if name:
        details["name"] = name
    if group:
        details["group"] = group
    details["kind"] = kind
    return details


def not_found(resource: str, group: str, name: str) -> ApiError:
    return ApiError(
        404, "NotFound", f'{qualified(resource, group)} "{name}" not found', _details(name, group, resource)
    )


def resource_not_found() -> ApiError:
    """What an apiserver answers for a path no installed API serves (`util/notfoundhandler`)."""
    return ApiError(404, "NotFound", "the server could not find the requested resource", {})


def already_exists(resource: str, group: str, name: str) -> ApiError:
    return ApiError(
        409, "AlreadyExists", f'{qualified(resource, group)} "{name}" already exists', _details(name, group, resource)
    )


def conflict(resource: str, group: str, name: str, why: str) -> ApiError:
    return ApiError(
        409,
        "Conflict",
        f'Operation cannot be fulfilled on {qualified(resource, group)} "{name}": {why}',
        _details(name, group, resource),
    )


def invalid_object(kind: str, group: str, name: str, causes: list[FieldError]) -> ApiError:
    rendered = [str(c) for c in causes]
    joined = rendered[0] if len(rendered) == 1 else "[" + ", ".join(rendered) + "]"
    details = _details(name, group, kind)
    details["causes"] = [{"reason": c.reason, "message": c.body, "field": c.field} for c in causes]
    return ApiError(422, "Invalid", f'{qualified(kind, group)} "{name}" is invalid: {joined}', details)


def bad_request(message: str) -> ApiError:
    return ApiError(400, "BadRequest", message, {})


def unauthorized() -> ApiError:
    return ApiError(401, "Unauthorized", "Unauthorized", {})


def forbidden(user: str, verb: str, resource: str, subresource: str, group: str, namespace: str, name: str) -> ApiError:
    target = qualified(resource, group) + (f' "{name}"' if name else "")
    full = resource + (f"/{subresource}" if subresource else "")
    scope = f'in the namespace "{namespace}"' if namespace else "at the cluster scope"
    message = f'{target} is forbidden: User "{user}" cannot {verb} resource "{full}" in API group "{group}" {scope}'
    return ApiError(403, "Forbidden", message, _details(name or None, group, resource))


def expired(rv: int, oldest: int) -> ApiError:
    return ApiError(410, "Expired", f"too old resource version: {rv} ({oldest})", {})


def method_not_allowed() -> ApiError:
    return ApiError(405, "MethodNotAllowed", "the server does not allow this method on the requested resource", {})


def unsupported_media_type(content_type: str) -> ApiError:
    return ApiError(
        415,
        "UnsupportedMediaType",
        f"the body of the request was in an unknown format ({content_type}) - accepted media types include: "
        "application/json-patch+json, application/merge-patch+json, application/apply-patch+yaml",
        {},
    )


def webhook_denied(webhook: str, message: str) -> ApiError:
    """controller-runtime `admission.Denied(err.Error())` (403 Forbidden) as the apiserver relays it."""
    return ApiError(403, "Forbidden", f'admission webhook "{webhook}" denied the request: {message}', {})
