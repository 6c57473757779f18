"""Progress bars (rich) for long stages, silent when quiet or in JSON mode."""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

log = logging.getLogger("unionsparse")


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever ``sys.stderr`` is at emit time (so captured stderr in tests works too)."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, _value) -> None:
        pass


def configure_logging(level: str) -> None:
    """``--log-level``: the ``unionsparse`` loggers to stderr at ``level`` (other libraries untouched)."""
    log.setLevel(level.upper())
    if not any(isinstance(h, _StderrHandler) for h in log.handlers):
        h = _StderrHandler()
        h.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        log.addHandler(h)


class Reporter:
    """Stage progress on stderr. ``quiet`` silences bars and notes (errors still print).

    Notes and finished stages also go to the ``unionsparse`` logger (INFO), so ``--log-level info``
    gives a plain line per stage where bars do not render (CI logs, ``--quiet``, ``--json``).
    """

    def __init__(self, quiet: bool = False):
        self.quiet = quiet
        self.console = Console(stderr=True, quiet=quiet, soft_wrap=True)
        self._progress: Progress | None = None

    def __enter__(self) -> Reporter:
        if not self.quiet:
            self._progress = Progress(
                TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                TimeElapsedColumn(), TextColumn("eta"), TimeRemainingColumn(),
                console=self.console, transient=not sys.stderr.isatty(),
            )
        return self

    def __exit__(self, *exc) -> None:
        if self._progress is not None and self._progress.live.is_started:
            self._progress.stop()
        self._progress = None

    def note(self, msg: str) -> None:
        log.info(msg)
        if not self.quiet:
            self.console.print(msg, highlight=False)

    @contextmanager
    def stage(self, description: str, total: int | None) -> Iterator[StageHandle]:
        """A bar for one stage (``total`` None: a pulsing bar for a stage of unknown length). The bars start with
        the first stage: a run that fails its checks before any prints its one line and nothing else."""
        if self._progress is not None and not self._progress.live.is_started:
            self._progress.start()
        handle = StageHandle(self._progress, description, total)
        try:
            yield handle
        finally:
            handle.close()


class StageHandle:
    def __init__(self, progress: Progress | None, description: str, total: int | None):
        self._p = progress
        self._id = progress.add_task(description, total=total) if progress is not None else None
        self._desc, self._total, self._done, self._t0 = description, total, 0, time.perf_counter()

    def advance(self, n: int = 1) -> None:
        self._done += n
        if self._p is not None:
            self._p.advance(self._id, n)

    def update(self, completed: int, total: int | None = None) -> None:
        self._done, self._total = completed, total if total is not None else self._total
        if self._p is not None:
            self._p.update(self._id, completed=completed, total=total)

    def close(self) -> None:
        if self._t0 is not None:
            secs = time.perf_counter() - self._t0
            if self._total is not None:
                log.info("%s: %d/%d in %.1f s", self._desc, self._done, self._total, secs)
            else:  # a stage of unknown length: no "0/None"
                log.info("%s%s in %.1f s", self._desc, f": {self._done}" if self._done else "", secs)
            self._t0 = None
        if self._p is not None:
            self._p.remove_task(self._id)
            self._p = None
