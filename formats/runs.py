"""Index arithmetic shared by the encoders: where each element of consecutive runs lands."""

from __future__ import annotations

import numpy as np


def run_positions(starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Positions ``starts[i] + j`` for j < counts[i], concatenated over i (int64, vectorised).

    The encoders emit the nonzeros (or active positions) of each run in order; this gives the
    destination of every emitted element without a cumulative sum over the whole dense matrix.
    """
    counts = np.asarray(counts, dtype=np.int64)
    starts = np.asarray(starts, dtype=np.int64)
    total = int(counts.sum())
    before = np.zeros(counts.size, dtype=np.int64)
    np.cumsum(counts[:-1], out=before[1:])
    return np.arange(total, dtype=np.int64) + np.repeat(starts - before, counts)
