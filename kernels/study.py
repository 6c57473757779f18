"""Study builds: kernel variants that the studies in ``benchmarks/`` time beside the shipped build.

A study may compile a kernel from another revision of its ``.cu`` file (same launch ABI) or with extra macros
(IE-BME: ``IEBME_TMA=0`` cp.async rings on sm_90 too, ``IEBME_TRACE=1`` per-CTA timestamps). The product never
sets a build (``tests/test_kernels_iebme.py`` checks that only ``benchmarks/`` and tests call :func:`use_build`);
the launchers only read :func:`build`, and their compile caches are keyed by it, so a study's kernels never
stand in for the shipped ones.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass


@dataclass(frozen=True)
class Build:
    """How to compile one kernel: ``source`` the path of another revision of its .cu ("": the shipped file);
    ``defines`` extra ``-D`` macros as (name, value) pairs, in the order they are passed."""

    source: str = ""
    defines: tuple[tuple[str, int], ...] = ()

    def define(self, name: str, default: int) -> int:
        """The value this build gives macro ``name`` (``default``: the .cu's own, where it sets none)."""
        return dict(self.defines).get(name, default)

    def options(self) -> tuple[str, ...]:
        """The NVRTC options of ``defines``."""
        return tuple(f"-D{k}={int(v)}" for k, v in self.defines)


SHIPPED = Build()
_builds: dict[str, Build] = {}


def build(kernel: str) -> Build:
    """The build in force for ``kernel`` (the .cu file's stem, e.g. ``iebme_spmm``); ``SHIPPED`` unless a study
    set another."""
    return _builds.get(kernel, SHIPPED)


def use_build(kernel: str, new: Build | None) -> Build:
    """Put ``new`` in force for ``kernel`` (None: the shipped build); returns the build it replaced. Studies
    only."""
    old = build(kernel)
    if new is None or new == SHIPPED:
        _builds.pop(kernel, None)
    else:
        _builds[kernel] = new
    return old


@contextmanager
def building(kernel: str, new: Build | None) -> Iterator[Build]:
    """``use_build`` for the duration of a ``with`` block."""
    old = use_build(kernel, new)
    try:
        yield build(kernel)
    finally:
        use_build(kernel, old)
