"""The part of JSON Schema that hpctrain's config checks use (`validate`): the runtime checks and the editor
schema read the same fragments, so they cannot disagree. No torch here."""

from __future__ import annotations

import math
import re
from typing import Any


def _type_ok(value: Any, name: str) -> bool:
    if name == "integer":
        return isinstance(value, int) and not isinstance(value, bool)
    if name == "number":  # finite: an infinite timeout is a hang with extra steps, NaN compares as nothing
        return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    return {
        "string": isinstance(value, str),
        "boolean": isinstance(value, bool),
        "null": value is None,
        "array": isinstance(value, (list, tuple)),
        "object": isinstance(value, dict),
    }[name]


def validate(value: Any, schema: dict[str, Any]) -> bool:
    """Whether `value` satisfies `schema` (the JSON Schema keywords used in KEYS)."""
    if "anyOf" in schema:
        return any(validate(value, option) for option in schema["anyOf"])
    if "const" in schema and value != schema["const"]:
        return False
    if "enum" in schema and not any(value == v and type(value) is type(v) for v in schema["enum"]):
        return False
    if "type" in schema:
        types = schema["type"] if isinstance(schema["type"], list) else [schema["type"]]
        if not any(_type_ok(value, t) for t in types):
            return False
    numeric = _type_ok(value, "number")
    if numeric and "minimum" in schema and value < schema["minimum"]:
        return False
    if numeric and "exclusiveMinimum" in schema and value <= schema["exclusiveMinimum"]:
        return False
    if numeric and "maximum" in schema and value > schema["maximum"]:
        return False
    if isinstance(value, str) and "pattern" in schema and not re.search(schema["pattern"], value):
        return False
    if isinstance(value, (list, tuple)):
        if len(value) < schema.get("minItems", 0):
            return False
        if "items" in schema and not all(validate(v, schema["items"]) for v in value):
            return False
    return True
