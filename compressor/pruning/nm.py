"""N:M patterns (``--nm 2:4``: keep N of every M consecutive inputs of a row), parsed in one place.

Imports nothing heavy: the configuration checks parse ``--nm`` before torch is loaded.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..errors import UserError


def parse_nm(nm: str | Sequence[int] | None) -> tuple[int, int] | None:
    """``"2:4"`` (or ``"2x4"``, or ``(2, 4)``) -> ``(N, M)``; None stays None. UserError names ``--nm``."""
    if nm is None:
        return None
    if isinstance(nm, str):
        try:
            n, m = (int(p) for p in nm.replace("x", ":").split(":"))
        except ValueError:
            raise UserError(f"--nm: expected N:M such as 2:4, got {nm!r}") from None
    else:
        n, m = (int(v) for v in nm)
    if not (0 < n < m):
        raise UserError(f"--nm: N:M needs 0 < N < M, got {n}:{m}")
    return n, m
