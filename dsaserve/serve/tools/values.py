"""Argument values written as text by the model → JSON values, by the tool's parameter schema."""

from __future__ import annotations

import ast
import json
from typing import Any

_JSON_TYPES: tuple[tuple[type, str], ...] = (
    (bool, "boolean"), (int, "integer"), (float, "number"), (str, "string"), (list, "array"),
    (tuple, "array"), (dict, "object"), (type(None), "null"))


def _json_type(value: Any) -> str:
    return next((name for t, name in _JSON_TYPES if isinstance(value, t)), "")


def coerce(raw: str, types: set[str]) -> Any:
    """A parameter's value from its text (vLLM's GLM and DSML parsers: a string parameter is the
    text as written; any other is read as JSON, then as a Python literal (`True`, `None`), and
    stays the text where neither reads). A value of a type the schema does not allow stays the
    text when the schema allows a string:

        coerce("42", {"integer"}) → 42        coerce("42", {"string"}) → "42"
        coerce("[1, 2]", set())   → [1, 2]    coerce("hello", {"integer"}) → "hello"
        coerce("True", {"boolean"}) → True    coerce("null", {"string", "null"}) → None
        coerce("1e999", {"number"}) → "1e999" (no JSON number)
    """
    if types and types <= {"string"}:
        return raw
    text = raw.strip()
    try:
        value = json.loads(text)
    except ValueError:
        try:
            value = ast.literal_eval(text)
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            return raw
    try:  # sets, bytes, complex numbers, NaN and infinities: no JSON value, the text stays
        json.dumps(value, allow_nan=False)
    except (ValueError, TypeError):
        return raw
    kind = _json_type(value)
    allowed = kind in types or (kind == "integer" and "number" in types)
    if "string" in types and not allowed:
        return raw
    return value


def schema_types(schema: dict[str, Any]) -> set[str]:
    """The types a parameter's JSON schema allows: `type` (a name or a list), or those of its
    `anyOf` / `oneOf` branches; an enum of strings is a string."""
    t = schema.get("type")
    if isinstance(t, str):
        return {t}
    if isinstance(t, list):
        return {x for x in t if isinstance(x, str)}
    types: set[str] = set()
    for key in ("anyOf", "oneOf"):
        branches = schema.get(key)
        for branch in branches if isinstance(branches, list) else []:
            if isinstance(branch, dict):
                types |= schema_types(branch)
    enum = schema.get("enum")
    if not types and enum and isinstance(enum, list) and all(isinstance(v, str) for v in enum):
        types.add("string")
    return types


def arguments_json(arguments: dict[str, Any]) -> str:
    return json.dumps(arguments, ensure_ascii=False)
