"""TOML values as text, for the files this project writes (specs, device descriptions); tomllib reads them back."""
from __future__ import annotations

import json
from typing import Any


def toml_value(value: Any) -> str:
    """`value` in TOML: true / false, a number, a basic string (JSON's escapes are TOML's, control characters
    included), an array, or an inline table for a dict."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{key} = {toml_value(item)}" for key, item in value.items()) + " }"
    raise TypeError(f"no TOML form for {value!r}")
