"""OpenPAI's job protocol v2, checked as its REST server checks it (src/rest-server/src/config/v2/protocol.js
and middlewares/v2/protocol.js): the parts of the schema a job submission uses, with its refusals."""

from __future__ import annotations

import re
from typing import Any

_NAME = re.compile(r"^[a-zA-Z0-9_-]+$")
_ROLE = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_]*$")
_TOP_KEYS = {
    "protocolVersion", "name", "type", "version", "contributor", "description", "prerequisites", "parameters",
    "secrets", "jobRetryCount", "taskRoles", "deployments", "defaults", "extras",
}  # fmt: skip
_ROLE_KEYS = {
    "protocolVersion", "instances", "completion", "taskRetryCount", "prerequisites", "dockerImage", "data",
    "output", "script", "extraContainerOptions", "resourcePerInstance", "commands",
}  # fmt: skip
_RESOURCE_KEYS = {"cpu", "memoryMB", "gpu", "ports"}


class ProtocolError(ValueError):
    """OpenPAI's InvalidProtocolError (400), with its message."""


def _integer(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def validate(job: Any) -> dict[str, Any]:
    """The job if OpenPAI would take it; ProtocolError naming the first thing it refuses."""
    if not isinstance(job, dict):
        raise ProtocolError("should be object")
    for key in ("protocolVersion", "name", "type", "taskRoles"):
        if key not in job:
            raise ProtocolError(f"should have required property '{key}'")
    extra = sorted(set(job) - _TOP_KEYS)
    if extra:
        raise ProtocolError(f"should NOT have additional properties ({extra[0]})")
    if job["protocolVersion"] not in (2, "2"):
        raise ProtocolError(".protocolVersion should be equal to one of the allowed values")
    if not isinstance(job["name"], str) or not _NAME.match(job["name"]) or len(job["name"]) > 255:
        raise ProtocolError('.name should match pattern "^[a-zA-Z0-9_-]+$"')
    if job["type"] != "job":
        raise ProtocolError(".type should be equal to one of the allowed values")
    if "jobRetryCount" in job and not (_integer(job["jobRetryCount"]) and job["jobRetryCount"] >= 0):
        raise ProtocolError(".jobRetryCount should be >= 0")
    images: set[str] = set()
    prerequisites = job.get("prerequisites", [])
    if not isinstance(prerequisites, list):
        raise ProtocolError(".prerequisites should be array")
    for index, item in enumerate(prerequisites):
        if not isinstance(item, dict) or "name" not in item or "type" not in item:
            raise ProtocolError(f".prerequisites[{index}] should have required property 'name'")
        if item["type"] == "dockerimage":
            if "uri" not in item:
                raise ProtocolError(f".prerequisites[{index}] should have required property 'uri'")
            if item["name"] in images:
                raise ProtocolError(f"Duplicate dockerimage prerequisites {item['name']}.")
            images.add(item["name"])
    roles = job["taskRoles"]
    if not isinstance(roles, dict) or not roles:
        raise ProtocolError(".taskRoles should NOT have fewer than 1 properties")
    for name, role in roles.items():
        where = f".taskRoles['{name}']"
        if not _ROLE.match(str(name)):
            raise ProtocolError(f".taskRoles should NOT have additional properties ({name})")
        if not isinstance(role, dict):
            raise ProtocolError(f"{where} should be object")
        for key in ("dockerImage", "resourcePerInstance", "commands"):
            if key not in role:
                raise ProtocolError(f"{where} should have required property '{key}'")
        extra = sorted(set(role) - _ROLE_KEYS)
        if extra:
            raise ProtocolError(f"{where} should NOT have additional properties ({extra[0]})")
        if "instances" in role and not (_integer(role["instances"]) and role["instances"] >= 1):
            raise ProtocolError(f"{where}.instances should be >= 1")
        resources = role["resourcePerInstance"]
        if not isinstance(resources, dict):
            raise ProtocolError(f"{where}.resourcePerInstance should be object")
        for key in ("cpu", "memoryMB", "gpu"):
            if key not in resources:
                raise ProtocolError(f"{where}.resourcePerInstance should have required property '{key}'")
            if not _integer(resources[key]):
                raise ProtocolError(f"{where}.resourcePerInstance.{key} should be integer")
        extra = sorted(set(resources) - _RESOURCE_KEYS)
        if extra:
            raise ProtocolError(f"{where}.resourcePerInstance should NOT have additional properties ({extra[0]})")
        commands = role["commands"]
        if not isinstance(commands, list) or not commands or not all(isinstance(c, str) for c in commands):
            raise ProtocolError(f"{where}.commands should NOT have fewer than 1 items")
        if role["dockerImage"] not in images:
            raise ProtocolError(f"Prerequisite {role['dockerImage']} does not exist.")
    return job
