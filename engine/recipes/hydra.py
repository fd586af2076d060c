"""Hydra's override grammar, written the way Hydra reads it back (tests parse every override with Hydra).

Strings stay unquoted where Hydra would read the same string back, dict keys (which cannot be quoted)
escape their specials with a backslash: that is how the glob `{*}` survives in `apply_modules`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Override:
    """One Hydra override; `prefix` is '', '+' (add a key absent from verl's schema) or '++'."""

    key: str
    value: Any
    prefix: str = ""

    @property
    def text(self) -> str:
        return f"{self.prefix}{self.key}={hydra_value(self.value, top=True)}"


_SAFE_UNQUOTED = re.compile(r"[A-Za-z0-9_/\-+.@]+")
_NON_STRING = re.compile(
    r"(?i)(true|false|null|[-+]?(\d[\d_]*)?(\.\d*)?(e[-+]?\d+)?|[-+]?inf|nan)",
)
_QUOTE_ESCAPE = re.compile(r"(\\*)('|$)")
_KEY_CHARS = re.compile(r"[A-Za-z0-9_/\-+.$%*@?|\\()\[\]{}:=, \t]+")
_KEY_SPECIAL = re.compile(r"([\\()\[\]{}:=, \t])")


def escape_key(key: str) -> str:
    """Dict keys cannot be quoted in Hydra: glob braces and other specials are backslash-escaped."""
    if not _KEY_CHARS.fullmatch(key) or _NON_STRING.fullmatch(key):
        raise ValueError(f"dict key {key!r} cannot be written in Hydra's grammar (it would not read back)")
    return _KEY_SPECIAL.sub(r"\\\1", key)


def _quote(text: str) -> str:
    """Hydra quoted string: backslashes are literal except in a run before a quote or the end."""
    body = _QUOTE_ESCAPE.sub(lambda m: m.group(1) * 2 + ("\\'" if m.group(2) else ""), text)
    return f"'{body}'"


def _string(text: str, top: bool) -> str:
    """Unquoted when Hydra would read it back as the same string, quoted otherwise."""
    plain = _SAFE_UNQUOTED.fullmatch(text) and not _NON_STRING.fullmatch(text)
    if plain and not (not top and text.startswith(("+", "-"))):
        return text
    return _quote(text)


def hydra_value(value: Any, top: bool = False) -> str:
    if isinstance(value, bool):
        return "True" if value else "False"
    if value is None:
        return "null"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        return _string(value, top)
    if isinstance(value, list | tuple):
        return "[" + ",".join(hydra_value(item) for item in value) + "]"
    if isinstance(value, dict):
        items = (f"{escape_key(str(k))}:{hydra_value(v)}" for k, v in value.items())
        return "{" + ",".join(items) + "}"
    raise TypeError(f"cannot express {type(value).__name__} as a Hydra value")
