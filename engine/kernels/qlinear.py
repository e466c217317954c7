"""`rill_qlinear` and `rill_qlinear_i8` (csrc/qlinear.c, csrc/qlinear_i8.c): linears over GGUF's
Q8_0, Q4_0 and Q4_1 blocks, with float32 or int8 activations. The blocks' layout and the modules
that hold them are in engine/model/quant.py."""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from engine.kernels.build import checked_kernel
from engine.kernels.linear import call_panel_kernel

KINDS = {"q8_0": 0, "q4_0": 1, "q4_1": 2}  # the kernels' `kind` argument


class QuantKernel:
    """`rill_qlinear` (float32 activations) and `rill_qlinear_i8` (int8) from the compiled library."""

    def __init__(self, library: ctypes.CDLL, path: Path):
        self.path = path
        self._fns = library.rill_qlinear, library.rill_qlinear_i8
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        for fn in self._fns:
            fn.argtypes = [ptr, i64, ptr, ptr, ptr, i64, i64, i64, ctypes.c_int, ctypes.c_int]
            fn.restype = ctypes.c_int
        self.threads = torch.get_num_threads()
        library.rill_qlinear_vector_bits.restype = ctypes.c_int
        bits = library.rill_qlinear_vector_bits()  # fixed when the library was built for this CPU
        self.isa = {512: "AVX-512", 256: "AVX2"}.get(bits, "generic vectors")

    def __call__(self, x: torch.Tensor, panels: torch.Tensor, bias: torch.Tensor | None, out_features: int,
                 kind: str, int8: bool = False) -> torch.Tensor:
        y, status = call_panel_kernel(self._fns[int8], self.threads, x, panels, bias, out_features, KINDS[kind])
        if status != 0:
            raise MemoryError(f"the quantized C linear could not allocate its buffers for {x.shape[0]} rows")
        return y


def _quant_agrees(kernel: QuantKernel) -> bool:
    """The kernels against F.linear on the de-quantized weight, for each kind: 1 to 13 rows (the
    row-by-row path and the tiles of 6 with every partial one), a partial panel, bias or none;
    the int8-activation kernel against F.linear of the rounded activations (`quantize_activations`)."""
    from engine.model.quant import QuantLinear, dequantize, quantize_activations, quantize_blocks

    gen = torch.Generator().manual_seed(0)
    weight, bias = torch.randn(21, 64, generator=gen), torch.randn(21, generator=gen)
    wide = torch.randn(13, 70, generator=gen)
    for kind in KINDS:
        q, d, m = quantize_blocks(weight, kind)
        reference = dequantize(q, d, m, kind)
        for b, int8 in ((bias, False), (None, False), (bias, True), (None, True)):
            layer = QuantLinear(q, d, m, kind, b, kernel, int8)
            for rows in range(1, 14):
                x = wide[:rows, :64].contiguous()
                expected = torch.nn.functional.linear(quantize_activations(x) if int8 else x, reference, b)
                if not torch.allclose(layer(x), expected, atol=1e-4, rtol=1e-4):
                    return False
    return True


def quant_kernel(cache_dir: Path) -> QuantKernel | None:
    """The compiled block-quantized linear, or None (with the reason logged) when it cannot be used here."""
    return checked_kernel(QuantKernel, _quant_agrees, cache_dir, "quantized linears", "F.linear", "float32 weights")
