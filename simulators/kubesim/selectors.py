"""Label and field selectors with the grammar of `k8s.io/apimachinery/pkg/labels/selector.go`.

Label selector requirements are comma-joined: `a=b`, `a==b`, `a!=b`, `a in (x,y)`, `a notin (x)`, `a`, `!a`.
`!=` and `notin` also match objects without the label, as in the real parser. Field selectors support
`metadata.name`, `metadata.namespace` (and `status.phase` for pods) with `=`, `==`, `!=`.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from simulators.kubesim.errors import ApiError, bad_request

Matcher = Callable[[dict[str, Any]], bool]

_REQ = re.compile(
    r"""^\s*(?P<neg>!)?\s*(?P<key>[A-Za-z0-9._/-]+)\s*
        (?:(?P<op>==|=|!=)\s*(?P<val>[A-Za-z0-9._-]*)
          |\s+(?P<setop>in|notin)\s*\((?P<set>[^)]*)\)
        )?\s*$""",
    re.VERBOSE,
)


def _split(selector: str) -> list[str]:
    """Split on commas that are not inside parentheses."""
    parts, depth, current = [], 0, ""
    for ch in selector:
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append(current)
            current = ""
        else:
            current += ch
    parts.append(current)
    return [p for p in parts if p.strip()]


def parse_label_selector(selector: str | None) -> Matcher:
    """Compile a labelSelector query string into a predicate on label maps; 400 on bad syntax like the server."""
    if not selector:
        return lambda labels: True
    requirements: list[tuple[str, str, frozenset[str]]] = []  # (key, operator, values)
    for part in _split(selector):
        m = _REQ.match(part)
        if not m:
            raise bad_request(f"unable to parse requirement: {part!r}")
        key, neg, op, val, setop = m["key"], m["neg"], m["op"], m["val"], m["setop"]
        if neg and (op or setop):
            raise bad_request(f"unable to parse requirement: {part!r}")
        if neg:
            requirements.append((key, "!", frozenset()))
        elif op:
            requirements.append((key, "!=" if op == "!=" else "=", frozenset({val})))
        elif setop:
            values = frozenset(v.strip() for v in m["set"].split(",") if v.strip())
            requirements.append((key, "=" if setop == "in" else "!=", values))
        else:
            requirements.append((key, "exists", frozenset()))
    return lambda labels: all(_holds(labels, *requirement) for requirement in requirements)


def _holds(labels: dict[str, Any], key: str, operator: str, values: frozenset[str]) -> bool:
    if operator == "exists":
        return key in labels
    if operator == "!":
        return key not in labels
    if operator == "=":  # `=`, `==` and `in`
        return labels.get(key) in values
    return labels.get(key) not in values  # `!=` and `notin`: true without the label too


_FIELDS: dict[str, Callable[[dict[str, Any]], Any]] = {
    "metadata.name": lambda o: o.get("metadata", {}).get("name"),
    "metadata.namespace": lambda o: o.get("metadata", {}).get("namespace"),
    "status.phase": lambda o: (o.get("status") or {}).get("phase"),
    "spec.nodeName": lambda o: (o.get("spec") or {}).get("nodeName", ""),
}


def parse_field_selector(selector: str | None, plural: str) -> Matcher:
    """Compile a fieldSelector; unsupported fields are a 400 like `field label not supported: x`."""
    if not selector:
        return lambda obj: True
    checks: list[tuple[Callable[[dict[str, Any]], Any], bool, str]] = []  # (getter, negated, value)
    for part in _split(selector):
        m = re.match(r"^\s*([A-Za-z.]+)\s*(==|=|!=)\s*(.*?)\s*$", part)
        if not m:
            raise bad_request(f"invalid selector: '{selector}'; can't understand '{part}'")
        name, op, value = m.groups()
        getter = _FIELDS.get(name)
        if getter is None or (name in ("status.phase", "spec.nodeName") and plural != "pods"):
            raise ApiError(400, "BadRequest", f"field label not supported: {name}", {})
        checks.append((getter, op == "!=", value))
    return lambda obj: all(((getter(obj) or "") == value) != negated for getter, negated, value in checks)


class Selector:
    """A label selector and a field selector together, applied to whole objects."""

    def __init__(self, plural: str, label_selector: str | None = None, field_selector: str | None = None) -> None:
        self._labels = parse_label_selector(label_selector)
        self._fields = parse_field_selector(field_selector, plural)

    def matches(self, obj: dict[str, Any]) -> bool:
        return self._labels(obj.get("metadata", {}).get("labels") or {}) and self._fields(obj)
