"""Layer encoding (quantize, reorder, encode) inline or on a Dask cluster, results written in layer order.

``--workers N`` starts a local ``dask.distributed`` cluster of N single-threaded worker processes;
``--scheduler ADDRESS`` connects to a running one. Whole layers are the unit of work: the main process
prunes a layer, scatters its weight to a worker and moves on; finished records come back and are written
to the zarr store strictly in submission order, so the artifact (and ``--resume``) is the same as a
single-process run. At most ``2 x workers`` layers are in flight, which bounds the memory they hold.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

import torch

from ..config import CompressConfig
from ..errors import UserError
from .encode import encode_layer

WORKER_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "NUMBA_NUM_THREADS": "1"}


def _encode_remote(name: str, w: torch.Tensor, cfg: CompressConfig):

    torch.set_num_threads(1)
    return encode_layer(name, w, cfg)


class LayerEncoder:
    """Encode layers and hand their stored attrs to ``on_attrs`` in the order they were submitted.

    ``write(record) -> attrs`` stores one encoded layer (runs in this process, in order).
    """

    def __init__(self, cfg: CompressConfig, write: Callable, on_attrs: Callable[[str, dict], None],
                 note: Callable[[str], None] | None = None):
        self.cfg = cfg
        self.write = write
        self.on_attrs = on_attrs
        self.client = None
        self.cluster = None
        self.reorder_progress: Callable[[int, int], None] | None = None  # inline runs only
        self.queue: deque = deque()  # (name, future, extra attrs) or (name, None, stored attrs)
        if cfg.workers is None and cfg.scheduler is None:
            return
        try:
            from dask.distributed import Client, LocalCluster
        except ImportError:  # pragma: no cover - dask is a declared dependency
            raise UserError("--workers/--scheduler: dask.distributed is not installed") from None
        if cfg.scheduler is not None:
            try:
                self.client = Client(cfg.scheduler, timeout="5s")
            except (OSError, TimeoutError, ValueError) as e:
                raise UserError(f"--scheduler: cannot connect to {cfg.scheduler} ({e})") from None
        else:
            self.cluster = LocalCluster(n_workers=cfg.workers, threads_per_worker=1, processes=True,
                                        dashboard_address=":0", env=WORKER_ENV, silence_logs=40)
            self.client = Client(self.cluster)
        n = len(self.client.scheduler_info().get("workers", {})) or 1
        self.max_pending = 2 * n
        if note:
            note(f"dask: encoding on {n} worker(s) at {self.client.scheduler.address}")

    @property
    def distributed(self) -> bool:
        return self.client is not None

    def done(self, name: str, attrs: dict) -> None:
        """A layer already in the store (``--resume``): keeps its place in the order."""
        self.queue.append((name, None, attrs))
        self._drain(self._limit())

    def submit(self, name: str, w: torch.Tensor, cfg: CompressConfig, extra_attrs: dict | None = None) -> None:
        """Encode one layer; ``extra_attrs`` (e.g. the dynamic-pruning threshold) join its stored attrs."""
        if self.client is None:

            rec = encode_layer(name, w, cfg, progress=self.reorder_progress)
            rec.attrs.update(extra_attrs or {})
            self.on_attrs(name, self.write(rec))
            return
        data = self.client.scatter(w, direct=False)
        fut = self.client.submit(_encode_remote, name, data, cfg, pure=False)
        self.queue.append((name, fut, extra_attrs or {}))
        self._drain(self._limit())

    def _limit(self) -> int:
        return self.max_pending if self.client is not None else 0

    def _drain(self, keep: int) -> None:
        while len(self.queue) > keep:
            name, fut, attrs = self.queue.popleft()
            if fut is not None:  # attrs holds the extra attrs of a submitted layer
                rec = fut.result()
                fut.release()
                rec.attrs.update(attrs)
                attrs = self.write(rec)
            self.on_attrs(name, attrs)

    def finish(self) -> None:
        """Wait for every layer in flight and write them, in order."""
        self._drain(0)

    def close(self) -> None:
        for _, fut, _ in self.queue:
            if fut is not None:
                fut.cancel()
        self.queue.clear()
        if self.client is not None:
            self.client.close()
        if self.cluster is not None:
            self.cluster.close()
        self.client = self.cluster = None
