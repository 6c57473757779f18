"""Device-resident Tiled-CBC layer for the CuPy kernels (upload once, launch many times).

CuPy is imported lazily, so this module (and the references) import on machines without a GPU.
``DeviceTiledCBC(m, w_scales, group_size)`` uploads the four stored arrays as they are (no re-encoding)
plus, for b-bit codes, the group scales transposed to [ngroups, Mp] so that one 16-byte load gives a
lane the scales of its 8 rows. ``encode_on_device`` builds the same arrays from a CuPy fp16 matrix (or
int8 codes) on the GPU (used by the benchmark, whose largest shapes would take minutes to encode on the CPU).
"""

from __future__ import annotations

import numpy as np

from ..formats.bitpack import pack_codes
from ..formats.tiled_cbc import TiledCBCMatrix
from .errors import KernelError
from .loader import require_cupy

TILE = (256, 16)


class DeviceTiledCBC:
    """The stored arrays of one Tiled-CBC layer in GPU memory, plus kernel workspaces."""

    def __init__(self, m: TiledCBCMatrix | None = None, w_scales=None, group_size: int | None = None, *,
                 arrays: dict | None = None):
        cp = require_cupy()
        if m is not None:
            g = m.geometry
            arrays = dict(shape=g.shape, bits=g.bits, bitmap=m.bitmap, colinfo=m.colinfo,
                          tile_offset=m.tile_offset, values=m.values)
            if tuple(g.tile) != TILE:
                raise KernelError(f"the GPU kernels are built for GTiles {TILE}, this layer has {g.tile}")
        assert arrays is not None
        self.shape = tuple(int(v) for v in arrays["shape"])
        self.bits = arrays["bits"]
        M, K = self.shape
        self.grid = (-(-M // TILE[0]), -(-K // TILE[1]))
        self.Mp = self.grid[0] * TILE[0]
        self.bitmap = cp.asarray(arrays["bitmap"], dtype=cp.uint64)
        self.colinfo = cp.asarray(arrays["colinfo"], dtype=cp.uint32)
        self.tile_offset = cp.asarray(arrays["tile_offset"], dtype=cp.uint32)
        vals = cp.asarray(arrays["values"])
        self.values_u8 = vals.view(cp.uint8) if vals.dtype != cp.uint8 else vals
        self.values_u16 = vals.view(cp.uint16) if self.bits is None else None
        self._tile_offset_host = cp.asnumpy(self.tile_offset).astype(np.int64)
        self.group_size = None
        self.scales_t = None
        if self.bits is not None:
            if w_scales is None or group_size is None:
                raise KernelError(f"a {self.bits}-bit layer needs w_scales and group_size")
            gs = int(group_size)
            ng = -(-K // gs)
            s = cp.asarray(w_scales, dtype=cp.float16)
            if s.shape != (M, ng):
                raise KernelError(f"w_scales must be [{M}, {ng}], got {tuple(s.shape)}")
            if gs % TILE[1] and gs < K:
                raise KernelError(f"the GPU kernels need group_size % {TILE[1]} == 0 (or one group), got {gs}")
            st = cp.zeros((ng, self.Mp), dtype=cp.float16)
            st[:, :M] = s.T
            self.scales_t = st.view(cp.uint16)
            self.group_size = gs
        self._partial: dict[int, object] = {}
        self.tickets = cp.zeros(self.grid[0], dtype=cp.uint32)
        self.dummy = cp.zeros(8, dtype=cp.uint16)

    def partial(self, splits: int):
        cp = require_cupy()
        if splits not in self._partial:
            self._partial[splits] = cp.empty(splits * self.Mp, dtype=cp.float32)
        return self._partial[splits]

    def max_window_bytes(self, gk: int) -> int:
        """Largest byte size of the values of gk consecutive GTiles of one GTile row (16-aligned; cached)."""
        cache = self.__dict__.setdefault("_window_bytes", {})
        if gk not in cache:
            cache[gk] = self._max_window_bytes(gk)
        return cache[gk]

    def _max_window_bytes(self, gk: int) -> int:
        gr, gc = self.grid
        t = self._tile_offset_host
        best = 0
        for r in range(gr):
            row = t[r * gc : r * gc + gc + 1]
            starts = row[:-1:gk]
            ends = row[np.minimum(np.arange(0, gc, gk) + gk, gc)]
            best = max(best, int((ends - starts).max()))
        return max(16, best * (2 if self.bits is None else 1))

    def spmm_tickets(self, n: int):
        """Zeroed split-K tickets of the SpMM (one per output tile; the kernel leaves them zeroed)."""
        cp = require_cupy()
        if getattr(self, "_spmm_tickets", None) is None or self._spmm_tickets.size < n:
            self._spmm_tickets = cp.zeros(n, dtype=cp.uint32)
        return self._spmm_tickets

    def max_gtile_value_bytes(self) -> int:
        """Largest byte size of one GTile's values (multiple of 16): the spMspV v2 slot size."""
        if not hasattr(self, "_max_gtile"):
            d = np.diff(self._tile_offset_host)
            vb = 16 if self.bits is None else int(self.bits)
            self._max_gtile = int(d.max(initial=0)) * vb // 8
        return self._max_gtile

    def nbytes(self) -> int:
        """Bytes of the stored arrays (what a kernel could have to read)."""
        n = self.bitmap.nbytes + self.colinfo.nbytes + self.tile_offset.nbytes + self.values_u8.nbytes
        return int(n + (0 if self.scales_t is None else self.scales_t.nbytes))


def encode_on_device(W, bits=None):
    """Tiled-CBC arrays (dict, CuPy) of a CuPy matrix W [M, K], float16 values or (``bits`` 4 or 2) int8
    codes of a signed b-bit quantizer: the same bytes as ``tiled_cbc.encode`` (benchmarks of large layers)."""
    cp = require_cupy()
    if bits is not None:
        if int(bits) not in (4, 2) or W.dtype != cp.int8:
            raise KernelError(f"integer codes need int8 W and bits 4 or 2, got {W.dtype} and {bits}")
        bits = int(bits)
    elif W.dtype != cp.float16:
        raise KernelError(f"W must be float16 (or int8 codes with bits), got {W.dtype}")
    align = 8 if bits is None else 128 // bits  # values per 16 bytes: each column run is padded to it
    M, K = W.shape
    gr, gc = -(-M // TILE[0]), -(-K // TILE[1])
    Mp, Kp = gr * TILE[0], gc * TILE[1]
    if (Mp, Kp) != (M, K):
        Wp = cp.zeros((Mp, Kp), dtype=W.dtype)
        Wp[:M, :K] = W
    else:
        Wp = W
    cols = Wp.reshape(gr, TILE[0], gc, TILE[1]).transpose(0, 2, 3, 1).reshape(-1, TILE[0])
    nz = cols != 0
    shifts = cp.arange(64, dtype=cp.uint64)
    bitmap = cp.zeros((cols.shape[0], 4), dtype=cp.uint64)
    for w in range(4):  # one word at a time keeps the temporaries at 8 bytes x a quarter of the matrix
        bitmap[:, w] = (nz[:, 64 * w : 64 * w + 64].astype(cp.uint64) << shifts).sum(axis=1, dtype=cp.uint64)
    counts = nz.sum(axis=1, dtype=cp.int64)
    padded = (counts + align - 1) // align * align
    starts = cp.zeros(counts.size + 1, dtype=cp.int64)
    cp.cumsum(padded, out=starts[1:])
    tile_offset = starts[:: TILE[1]]
    in_tile = starts[:-1] - cp.repeat(tile_offset[:-1], TILE[1])
    colinfo = ((in_tile << 16) | counts).astype(cp.uint32)
    values = cp.zeros(int(starts[-1]), dtype=W.dtype)
    rank = cp.cumsum(nz, axis=1, dtype=cp.int32) - 1
    dest = starts[:-1, None] + rank
    values[dest[nz]] = cols[nz]
    del rank, dest, nz, cols
    if bits is not None:
        values = pack_codes(values, bits, xp=cp)
    return dict(shape=(M, K), bits=bits, bitmap=bitmap.ravel(), colinfo=colinfo,
                tile_offset=tile_offset.astype(cp.uint32), values=values)
