"""TOML values as text, for the files this project writes (specs, device descriptions); tomllib reads them back."""
from __future__ import annotations

import json
import numbers
from typing import Any


def toml_value(value: Any) -> str:
    """`value` in TOML: true / false, a number (numpy's too), a basic string (JSON's escapes are TOML's; DEL escaped
    as TOML requires, a lone surrogate replaced), an array, or an inline table for a dict."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, numbers.Integral):
        return str(int(value))
    if isinstance(value, numbers.Real):
        return repr(float(value))
    if isinstance(value, str):
        text = value.encode("utf-8", "replace").decode("utf-8")  # a lone surrogate cannot be written as UTF-8
        return json.dumps(text, ensure_ascii=False).replace("\x7f", "\\u007f")
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{key} = {toml_value(item)}" for key, item in value.items()) + " }"
    raise TypeError(f"no TOML form for {value!r}")
