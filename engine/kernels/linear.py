"""`rill_linear` (csrc/linear.c): every linear of a float32 model in C, on weights rearranged once
into panels of 16 output features.

Measured against oneDNN's packed linear (engine/model/linears.py): 1.2-2.7x on decode steps (1-64
rows: they mostly stream the weights, which this does at 12-20 GB/s against oneDNN's 5-12),
0.9-1.3x on prefill chunks; SmolLM2's 576 x 49152 output head at one row 7.4 ms against 12.7.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from engine.kernels.build import checked_kernel
from engine.kernels.pages import empty_huge


PANEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # what the panels may hold: 16-bit weights kept as they are
QUANTIZE_KINDS = {"q8_0": (0, 34), "q4_0": (1, 18), "q4_1": (2, 20)}  # rill_quantize_rows: kind -> (its number, block bytes)


def panel_slots(dtype: torch.dtype) -> torch.Tensor:
    """Where output j of a panel sits among each input's 16 values: in order, or for bfloat16
    interleaved 0, 8, 1, 9, ... (csrc/linear.c widens a pair of outputs from one 32-bit lane)."""
    j = torch.arange(16)
    return j % 8 * 2 + j // 8 if dtype == torch.bfloat16 else j


def panels_of(weight: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[out, in] -> [ceil(out / 16), in, 16] in `dtype`: panel p holds the weights of outputs
    16p..16p+15, at `panel_slots(dtype)` (a 16-bit weight of the same dtype is copied bit for bit)."""
    out_features, in_features = weight.shape
    full, rest = divmod(out_features, 16)
    panels = torch.zeros(full + (rest > 0), in_features, 16, dtype=dtype)
    panels[:full] = weight[:full * 16].view(full, 16, in_features).transpose(1, 2)
    if rest:
        panels[full, :, :rest] = weight[full * 16:].t()
    slotted = torch.empty_like(panels)
    slotted[..., panel_slots(dtype)] = panels
    return slotted


def padded_bias(bias: torch.Tensor | None, num_panels: int, out_features: int) -> torch.Tensor | None:
    """A bias [out] as the panel kernels read it: float32 [num_panels * 16], zero past `out_features`."""
    if bias is None:
        return None
    padded = torch.zeros(num_panels * 16, dtype=torch.float32)
    padded[:out_features] = bias.detach().float()
    return padded


def call_panel_kernel(fn, threads: int, x: torch.Tensor, panels: torch.Tensor, bias: torch.Tensor | None,
                      out_features: int, *extra) -> tuple[torch.Tensor, object]:
    """y = x w^T + b through a C kernel of the form fn(x, x_row, panels, bias, y, rows, out, in,
    threads, *extra) (csrc/linear.c, csrc/qlinear.c); returns y [rows, out] and what fn returned."""
    if x.dtype != torch.float32 or x.device.type != "cpu":
        raise TypeError(f"the C linear takes float32 CPU tensors; given {x.dtype} on {x.device}")
    if x.stride(-1) != 1:
        x = x.contiguous()
    rows = x.shape[0]
    y = torch.empty(rows, out_features, dtype=torch.float32)
    status = fn(x.data_ptr(), x.stride(0), panels.data_ptr(), None if bias is None else bias.data_ptr(),
                y.data_ptr(), rows, out_features, x.shape[1], threads, *extra)
    return y, status


class LinearKernel:
    """`rill_linear` / `rill_linear16` from the compiled library: x [rows, in] times the panels of a
    weight, float32, bfloat16 or float16 (widened exactly as they are read)."""

    def __init__(self, library: ctypes.CDLL, path: Path):
        self.path = path
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        self._fn, self._fn16 = library.rill_linear, library.rill_linear16
        self._fn.argtypes = [ptr, i64, ptr, ptr, ptr, i64, i64, i64, ctypes.c_int]
        self._fn16.argtypes = [ptr, i64, ptr, ptr, ptr, i64, i64, i64, ctypes.c_int, ctypes.c_int]
        self._pack16 = library.rill_pack16
        self._pack16.argtypes = [ptr, i64, i64, ptr, ptr, ctypes.c_int, ctypes.c_int]
        self._fn.restype = self._fn16.restype = self._pack16.restype = None
        self._quantize = library.rill_quantize_rows
        self._quantize.argtypes = [ptr, i64, i64, ctypes.c_int, ctypes.c_int, ptr, ctypes.c_int]
        self._quantize.restype = ctypes.c_int
        self.threads = torch.get_num_threads()

    def panels16(self, weight: torch.Tensor, order: torch.Tensor | None = None) -> torch.Tensor:
        """`panels_of` for a 16-bit weight [out, in] (e.g. a view of a mapped file), in C: rows in
        `order` (int64 row numbers) or as they are."""
        if weight.dtype not in (torch.bfloat16, torch.float16) or weight.dim() != 2 or weight.stride(-1) != 1:
            raise TypeError(f"panels16 takes a 2-d bfloat16/float16 weight with contiguous rows; given {weight.dtype}, "
                            f"{tuple(weight.shape)}")
        if weight.stride(0) != weight.shape[1]:
            weight = weight.contiguous()
        out_features = weight.shape[0] if order is None else len(order)
        panels = empty_huge(((out_features + 15) // 16, weight.shape[1], 16), weight.dtype)
        order = None if order is None else order.to(torch.int64).contiguous()
        self._pack16(weight.data_ptr(), out_features, weight.shape[1], None if order is None else order.data_ptr(),
                     panels.data_ptr(), self.threads, int(weight.dtype == torch.bfloat16))
        return panels

    def quantize(self, weight: torch.Tensor, kind: str) -> np.ndarray:
        """A float32/bfloat16/float16 weight [out, in] (in a multiple of 32; e.g. a view of a mapped
        file) -> ggml's blocks of `kind` (QUANTIZE_KINDS) as a GGUF file holds them, uint8 [out, row
        bytes], rounded as quantize.py's `quantize_blocks` rounds; row by row, no float32 copy."""
        if kind not in QUANTIZE_KINDS or weight.dim() != 2 or weight.shape[1] % 32 \
                or weight.dtype not in PANEL_DTYPES:
            raise ValueError(f"quantize takes a 2-d float32/bfloat16/float16 weight of a width that is a multiple "
                             f"of 32 into {', '.join(QUANTIZE_KINDS)}; given {weight.dtype} {tuple(weight.shape)}, "
                             f"{kind!r}")
        weight = weight.contiguous()
        out_features, in_features = weight.shape
        raw = np.empty((out_features, in_features // 32 * QUANTIZE_KINDS[kind][1]), dtype=np.uint8)
        self._quantize(weight.data_ptr(), out_features, in_features, PANEL_DTYPES.index(weight.dtype),
                       QUANTIZE_KINDS[kind][0], raw.ctypes.data, self.threads)
        return raw

    def __call__(self, x: torch.Tensor, panels: torch.Tensor, bias: torch.Tensor | None,
                 out_features: int) -> torch.Tensor:
        """x: [rows, in] float32 (rows may be strided); panels from `panels_of`; bias padded like them."""
        if panels.dtype == torch.float32:
            return call_panel_kernel(self._fn, self.threads, x, panels, bias, out_features)[0]
        return call_panel_kernel(self._fn16, self.threads, x, panels, bias, out_features,
                                 int(panels.dtype == torch.float16))[0]


def _linear_agrees(kernel: LinearKernel) -> bool:
    """The kernel against F.linear: 1 to 13 rows (tiles of 6 and every partial one), a width that
    is no multiple of 8, a partial panel, with and without bias, rows with a stride; float32 panels
    and 16-bit ones against the float32 weight they widen to; and 7 and 13 rows over 301 inputs (a
    batch of a few rows takes the inputs a stretch at a time, the last one partial)."""
    gen = torch.Generator().manual_seed(0)
    bias = torch.randn(21, generator=gen)
    wide = torch.randn(13, 310, generator=gen)
    for dtype in PANEL_DTYPES:
        for width, row_counts in ((37, range(1, 14)), (301, (7, 13))):
            weight = torch.randn(21, width, generator=gen).to(dtype)
            panels = panels_of(weight, dtype)
            for b in (bias, None):
                padded = padded_bias(b, panels.shape[0], 21)
                for rows in row_counts:
                    x = wide[:rows, :width]
                    want = F.linear(x, weight.float(), b)
                    # float32 sums in another order than F.linear's: the rounding grows with the width
                    if not torch.allclose(kernel(x, panels, padded, 21), want, atol=1e-5 * width / 37, rtol=1e-5):
                        return False
        if dtype != torch.float32:  # the C packer: as panels_of, rows as they are and in an order
            order = torch.randperm(21, generator=gen)
            if not (torch.equal(kernel.panels16(weight), panels)
                    and torch.equal(kernel.panels16(weight, order), panels_of(weight[order], dtype))):
                return False
    return True


def linear_kernel(cache_dir: Path) -> LinearKernel | None:
    """The compiled linear, or None (with the reason logged) when it cannot be used here."""
    return checked_kernel(LinearKernel, _linear_agrees, cache_dir, "linears", "F.linear", "oneDNN")
