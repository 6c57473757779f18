"""The runtime's CUDA backend: the artifact's CuPy kernels on the stored arrays, on torch's current stream.

Not yet run on a GPU (docs/runtime.md says what that still needs). CuPy allocates through torch's caching
allocator (:func:`share_torch_allocator`), so that a decode step captured as a CUDA graph keeps its buffers.
Per layer, at load, the stored arrays are uploaded once as they are (``kernels.iebme_spmm.prepare_layer``,
``kernels.tiled_cbc_device.DeviceTiledCBC``).
Per call, tensors cross between torch and CuPy through DLPack (no copies) and every launch goes to torch's
current stream (a CuPy ``ExternalStream`` over it), so nothing is copied to the host inside a step:

* quantized activations (IE-BME W4A4 / W2A4): the activation rule of ``formats.arithmetic`` in one launch
  (``kernels/act_quant.cu``: outlier gather, quantization and padding), then ``spmm_iebme``; the 8-bit
  outlier side product is a float32 torch product of the codes (exact) added to the kernel's float16 main
  output, then rounded again (one more float16 rounding than the CPU
  reference: agreement to fp16 tolerance, not bit for bit);
* activation-sparse layers (Tiled-CBC): N = 1 is ``spmspv`` with the stored threshold; more rows are
  ``spmm`` for fp16 values and one ``spmspv`` per row without threshold for int codes (no int-code SpMM yet);
* IE-BME W4A16 (no kernel): the decoded weight in fp16, one cuBLAS GEMM through torch.

Without a CUDA device visible to torch and to CuPy, :func:`require_cuda` raises one ``UserError``.
"""

from __future__ import annotations

import numpy as np
import torch

from ...formats import iebme
from ...formats.arithmetic.activations import quantize_activations_torch
from ...formats.arithmetic.outlier_side import quantize_inputs_torch
from ...formats.arithmetic.weights import n_groups
from ..artifact.store import LayerRecord
from ..errors import UserError
from ..model.rebuild import layer_weight
from ..quantize.fake_quant import grouped_int_matmul
from .linear import LayerPlan, QuantizingOp


def cuda_problem() -> str | None:
    """Why the CUDA backend cannot run here, or None when it can."""
    if not torch.cuda.is_available():
        return "torch sees no CUDA device"
    from ...kernels import available

    if not available():
        return "CuPy is not installed or sees no CUDA device (pip install 'unionsparse[gpu]')"
    return None


_SHARED_ALLOCATOR = False


def share_torch_allocator() -> None:
    """Route CuPy's device allocations through torch's caching allocator (once per process).

    The kernels' launchers allocate outputs, padded inputs and workspaces with CuPy. Inside a CUDA-graph
    capture those must come from the graph's private memory pool, which only torch's allocator knows about:
    CuPy's own pool would hand the captured addresses to later, unrelated arrays. Through torch, an allocation
    on the capturing stream lands in the graph's pool and stays reserved for its replays."""
    global _SHARED_ALLOCATOR
    if _SHARED_ALLOCATOR:
        return
    import cupy as cp

    def malloc(size: int, device: int) -> int:
        return torch.cuda.caching_allocator_alloc(size, device, torch.cuda.current_stream(device))

    def free(ptr: int, _device: int) -> None:
        torch.cuda.caching_allocator_delete(ptr)

    cp.cuda.set_allocator(cp.cuda.PythonFunctionAllocator(malloc, free).malloc)
    _SHARED_ALLOCATOR = True


def require_cuda() -> None:
    """Raise one ``UserError`` unless the CUDA backend can run here."""
    why = cuda_problem()
    if why is not None:
        raise UserError(f"--device cuda: {why}; use --device cpu")


class CudaOp(QuantizingOp):
    """``x2 [N, K] -> float16 [N, M]`` of one stored layer through the artifact's GPU kernels.

    ``act_quant`` (class default, or per instance): "kernel" quantizes IE-BME inputs in one launch
    (``kernels/act_quant.cu``), "torch" with the formats' torch functions (the same values, about ten launches).
    ``side_kernel``: the outlier side product in one launch (``kernels/outlier_side.cu``) or as torch's grouped
    products (the same bits, about five launches per side group).
    """

    act_quant = "kernel"
    side_kernel = "kernel"  # the 8-bit outlier side product: "kernel" (kernels/outlier_side.cu) or "torch"

    def __init__(self, rec: LayerRecord, plan: LayerPlan, device: torch.device | str | None = None) -> None:
        super().__init__()
        require_cuda()
        share_torch_allocator()
        import cupy as cp

        self.plan = plan
        self.device = torch.device(device or "cuda")
        self.kind = "dense"
        gs = rec.attrs.get("group_size")
        with cp.cuda.Device(self.device.index or 0):
            if plan.act_bits != 16:
                self._init_iebme(rec, int(gs))
            elif plan.sparse_inputs:
                from ...kernels.tiled_cbc_device import DeviceTiledCBC

                try:
                    self.dev = DeviceTiledCBC(rec.encoding, rec.scales, gs)
                except ValueError as e:
                    raise UserError(f"layer {rec.name}: {e}") from None
                self.kind = "spmspv"
            else:  # IE-BME W4A16 has no kernel: decoded fp16 weight, cuBLAS
                self.register_buffer("weight", torch.from_numpy(layer_weight(rec)).half().to(self.device))

    def _init_iebme(self, rec: LayerRecord, group_size: int) -> None:
        from ...kernels.iebme_spmm import prepare_layer

        if rec.format != iebme.NAME:
            raise UserError(f"layer {rec.name}: no GPU kernel computes {rec.format} with quantized activations; "
                            "use --device cpu")
        try:
            self.layer = prepare_layer(rec.encoding, rec.scales, group_size)
        except ValueError as e:
            raise UserError(f"layer {rec.name}: {e}") from None
        self.kind = "iebme"
        self.act = dict(rec.attrs["activations"])
        k = self.plan.shape[1]
        self.act_group = min(int(self.act["group_size"]), k)
        side = rec.outliers
        if side is not None:
            n = side.channels.size
            self.side_group = int(self.act.get("outlier_group_size") or min(group_size, n))
            self.register_buffer("perm", torch.from_numpy(side.perm.astype(np.int64)).to(self.device))
            self.register_buffer("perm32", self.perm.to(torch.int32))
            self.register_buffer("side_codes", torch.from_numpy(side.codes).float().to(self.device))
            codes_i8 = torch.from_numpy(side.codes).to(torch.int8).contiguous()
            self.register_buffer("side_codes_i8", codes_i8.to(self.device))  # for kernels/outlier_side.cu
            s = torch.from_numpy(side.scales.astype(np.float32)).expand(-1, n_groups(n, self.side_group))
            self.register_buffer("side_scales", s.contiguous().to(self.device))
        else:
            self.perm = None

    def input_rule(self):
        if self.kind != "iebme":
            return None
        from ...kernels.norm_quant import InputRule

        n_side = 0 if self.perm is None else self.side_codes.shape[1]
        return InputRule(self.plan.act_bits, self.act_group, float(self.act.get("clip", 1.0)), self.layer.tc * 64,
                         None if self.perm is None else self.perm32, n_side, int(self.act.get("outlier_bits", 8)),
                         self.side_group if n_side else None, float(self.act.get("outlier_clip", 1.0)))

    def _stream(self):
        import cupy as cp

        return cp.cuda.ExternalStream(torch.cuda.current_stream(self.device).cuda_stream)

    def forward(self, x2: torch.Tensor) -> torch.Tensor:
        import cupy as cp

        if self.kind == "dense":
            return torch.nn.functional.linear(x2.half(), self.weight)
        with cp.cuda.Device(self.device.index or 0), self._stream():
            if self.kind == "iebme":
                return self._iebme(x2 if x2.dtype in (torch.float16, torch.float32) else x2.float(), cp)
            return self._tiled_cbc(x2.half().contiguous(), cp)

    def _iebme(self, x: torch.Tensor, cp) -> torch.Tensor:
        from ...kernels.iebme_spmm import spmm_iebme

        def main(xq, sx) -> torch.Tensor:
            return torch.from_dlpack(spmm_iebme(self.layer, xq, sx, poison=False))  # no NaN fill launch

        n_side = 0 if self.perm is None else self.side_codes.shape[1]
        offered = self.take(x)
        if offered is not None:  # quantized by the op that produced x (kernels/norm_quant.cu)
            xq, sx, oq, osx = offered
            y = main(cp.from_dlpack(xq), cp.from_dlpack(sx))
            if not n_side:
                return y
        elif self.act_quant == "kernel":  # one launch: gather, quantize, pad (kernels/act_quant.cu)
            from ...kernels.act_quant import quantize_inputs

            xq, sx, oq, osx = quantize_inputs(
                cp.from_dlpack(x.contiguous()), self.plan.act_bits, self.act_group, float(self.act.get("clip", 1.0)),
                self.layer.tc * 64, None if self.perm is None else cp.from_dlpack(self.perm32), n_side,
                int(self.act.get("outlier_bits", 8)), self.side_group if n_side else None,
                float(self.act.get("outlier_clip", 1.0)))
            y = main(xq, sx)
            if not n_side:
                return y
            oq, osx = torch.from_dlpack(oq), torch.from_dlpack(osx)
        else:  # the formats' torch functions: about ten launches per layer
            xf = x.float()
            if not n_side:
                xq, sx = quantize_activations_torch(xf, self.plan.act_bits, self.act_group,
                                                    float(self.act.get("clip", 1.0)))
                return main(cp.from_dlpack(xq.contiguous()), cp.from_dlpack(sx.float().contiguous()))
            xq, sx, oq, osx = quantize_inputs_torch(xf, self.perm, n_side, self.act)
            y = main(cp.from_dlpack(xq.contiguous()), cp.from_dlpack(sx.float().contiguous()))
        if self.side_kernel == "kernel":  # one launch (kernels/outlier_side.cu), the same arithmetic
            from ...kernels.outlier_side import side_product

            return side_product(y, oq.contiguous(), osx.float().contiguous(), self.side_codes_i8, self.side_scales,
                                self.side_group)
        return grouped_int_matmul(oq, osx, self.side_codes, self.side_scales, self.side_group, out=y.float()).half()

    def _tiled_cbc(self, xh: torch.Tensor, cp) -> torch.Tensor:
        from ...kernels.tiled_cbc_spmm import spmm
        from ...kernels.tiled_cbc_spmspv import spmspv

        if xh.shape[0] == 1:  # decode: spMspV with the stored threshold
            return torch.from_dlpack(spmspv(self.dev, cp.from_dlpack(xh[0]), self.plan.tau))[None]
        if self.dev.bits is None:  # prefill: the SpMM, every input active
            return torch.from_dlpack(spmm(self.dev, cp.from_dlpack(xh)))
        rows = [torch.from_dlpack(spmspv(self.dev, cp.from_dlpack(xh[i]), None)) for i in range(xh.shape[0])]
        return torch.stack(rows)
