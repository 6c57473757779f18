"""Text from an artifact or a file name, made safe to print: control and format characters shown as escapes."""

from __future__ import annotations

import unicodedata


def _unsafe(c: str) -> bool:
    return unicodedata.category(c)[0] in "CZ" and c != " "  # controls, format (bidi), separators but space


def has_control(text: str) -> bool:
    """True when ``text`` holds a control, format or line/paragraph separator character."""
    return any(_unsafe(c) for c in text)


def printable(text: object) -> str:
    """``str(text)`` with every control/format character written as a Python escape (ESC -> ``\\x1b``)."""
    s = str(text)
    if not has_control(s):
        return s
    return "".join(c.encode("unicode_escape", "backslashreplace").decode("ascii") if _unsafe(c) else c for c in s)
