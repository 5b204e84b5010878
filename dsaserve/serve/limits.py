"""What the server refuses before a request reaches the engine: text that is not valid Unicode.

Pure checks, each naming the offending field, so a hostile or careless body is a 4xx and never an
exception inside the tokenizer or the engine (where it would be a 500, or fail a shared step).
"""

from __future__ import annotations

from typing import Any


def _has_lone_surrogate(text: str) -> bool:
    # JSON's "\ud800" decodes to a str that UTF-8 cannot encode; the tokenizer (Rust) rejects it.
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def find_lone_surrogate(value: Any, where: str = "body") -> str | None:
    """The path of the first string (key or value) in a decoded JSON body holding a lone surrogate,
    e.g. `messages[0].content`, or None."""
    if isinstance(value, str):
        return where if _has_lone_surrogate(value) else None
    if isinstance(value, dict):
        for key, item in value.items():
            name = str(key)
            if _has_lone_surrogate(name):
                return f"a key in {where}"
            path = name if where == "body" else f"{where}.{name}"
            if (found := find_lone_surrogate(item, path)) is not None:
                return found
    elif isinstance(value, list):
        for i, item in enumerate(value):
            if (found := find_lone_surrogate(item, f"{where}[{i}]")) is not None:
                return found
    return None
