"""`rill_qlinear` and `rill_qlinear_i8` (csrc/qlinear.c, csrc/qlinear_i8.c): linears over GGUF's
blocks (the kinds Q8_0, Q4_0, Q4_1, Q5_1, Q6_K, Q4_K and Q6_KS, of csrc/blocks.h, hold every type of
engine/model/gguf_blocks.py's GGUF_TYPES), with float32 or int8 activations; `rill_repack`
(csrc/repack.c): a GGUF tensor's raw rows straight into those panels. The panels' layout is
engine/model/panels.py's, the modules that hold them engine/model/quant.py's, and the probe that
checks this binding before it is used engine/model/quant_probe.py's."""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

import numpy as np
import torch

from engine.kernels.linear import call_panel_kernel
from engine.kernels.pages import empty_huge

KINDS = {"q8_0": 0, "q4_0": 1, "q4_1": 2, "q5_1": 3, "q6_k": 4, "q4_k": 5, "q6_ks": 6}  # the kernels' `kind` argument
SUPER_KINDS = {"q4_k": "q4_1", "q6_ks": "q6_k"}  # the super-block kinds, and the kind of their products
INT8_KIND = 16  # rill_lin's kind of blocks with int8 activations: INT8_KIND + KINDS[kind] (csrc/blocks.h)
# bytes of a panel per block (32 inputs of 16 outputs) of each kind, the same in both layouts
# (csrc/blocks.h; q4_k, q6_ks: a super-block's floats over its 8 blocks, float32 activations only)
BLOCK_BYTES = {"q8_0": 32 * 16 + 64, "q4_0": 32 * 8 + 64, "q4_1": 32 * 8 + 128, "q5_1": 32 * 8 + 64 + 128,
               "q6_k": 32 * 8 + 128 + 128, "q4_k": 32 * 8 + 32 + 16, "q6_ks": 32 * 16 + 32 + 8}
# ggml's numbers of the GGUF types rill_repack reads (ggml.h)
GGML_TYPE_NUMBERS = {"q4_0": 2, "q4_1": 3, "q5_0": 6, "q5_1": 7, "q8_0": 8, "q3_k": 11, "q4_k": 12, "q5_k": 13,
                     "q6_k": 14, "iq4_nl": 20, "iq4_xs": 23}


class QuantKernel:
    """`rill_qlinear` (float32 activations) and `rill_qlinear_i8` (int8) from the compiled library, and
    `rill_repack` (`repack`: a GGUF tensor's rows into their panels)."""

    def __init__(self, library: ctypes.CDLL, path: Path):
        self.path = path
        self._fns = library.rill_qlinear, library.rill_qlinear_i8
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        for fn in self._fns:
            fn.argtypes = [ptr, i64, ptr, ptr, ptr, i64, i64, i64, ctypes.c_int, ctypes.c_int]
            fn.restype = ctypes.c_int
        self._repack = library.rill_repack
        self._repack.argtypes = [ptr, i64, ptr, i64, i64, ctypes.c_int, ctypes.c_int, ptr, ctypes.c_int]
        self._repack.restype = ctypes.c_int
        self.threads = torch.get_num_threads()
        library.rill_qlinear_vector_bits.restype = ctypes.c_int
        bits = library.rill_qlinear_vector_bits()  # fixed when the library was built for this CPU
        self.isa = {512: "AVX-512", 256: "AVX2"}.get(bits, "generic vectors")
        library.rill_qlinear_few_rows.restype = ctypes.c_int
        self.few_rows = library.rill_qlinear_few_rows()  # up to this many rows widen the weights in registers
        library.rill_qlinear_widen_rows.restype = ctypes.c_int
        self.widen_rows = library.rill_qlinear_widen_rows()  # ... once per tile of few_rows (more: de-quantized)
        # AMX tiles (csrc/qlinear_amx.c) from amx_rows rows, where this build has them and Linux lends them
        self._amx_rows, self._amx_ready = library.rill_qlinear_amx_rows, library.rill_qlinear_amx_ready
        self._amx_rows.argtypes, self._amx_rows.restype, self._amx_ready.restype = [ctypes.c_int], ctypes.c_int, ctypes.c_int
        built_rows = self._amx_rows(-1)  # 0: built without the tiles
        self.amx_rows = built_rows if built_rows > 0 and self._amx_ready() else 0
        wanted = os.environ.get("RILL_AMX_ROWS", "").strip()  # from how many rows (0: never), for A/B runs
        if wanted:
            if not wanted.isdigit():
                raise ValueError(f"RILL_AMX_ROWS must be a number of rows (0: no AMX tiles); given {wanted!r}")
            if self.amx_rows:
                self.amx_rows = int(wanted)
                self._amx_rows(self.amx_rows)
        if self.amx_rows:  # each kind from where its tiles beat the float32 kernel (csrc/qlinear_amx.c)
            self.isa += (", AMX tiles (Q8_0 2-6 rows and 16+, Q4 3-6 and 16+, Q6_K 16+)" if self.amx_rows == 1
                         else f", AMX tiles from {self.amx_rows} rows")

    def __call__(self, x: torch.Tensor, panels: torch.Tensor, bias: torch.Tensor | None, out_features: int,
                 kind: str, int8: bool = False) -> torch.Tensor:
        y, status = call_panel_kernel(self._fns[int8], self.threads, x, panels, bias, out_features, KINDS[kind])
        if status != 0:
            raise MemoryError(f"the quantized C linear could not allocate its buffers for {x.shape[0]} rows")
        return y

    def repack(self, raw: np.ndarray, ggml_type: str, kind: str, in_features: int, order: np.ndarray | None = None,
               int8: bool = False) -> torch.Tensor:
        """A GGUF tensor's raw blocks (uint8 [rows, row bytes], e.g. the file's memory map) of
        `ggml_type` -> the panels of `kind` that engine/model/panels.py's panels_of_blocks makes from
        its reader's blocks, byte for byte; output r is the file's row order[r] (None: row r)."""
        raw = np.ascontiguousarray(raw)  # a memory map's rows stay where they are
        if int8 and kind in SUPER_KINDS:
            raise ValueError(f"{kind} blocks are for float32 activations; with int8 see held_kind")
        if order is not None:
            order = np.ascontiguousarray(order, dtype=np.int64)
            if order.ndim != 1 or len(order) == 0 or order.min() < 0 or order.max() >= raw.shape[0]:
                raise ValueError(f"order must list rows of the tensor (0 to {raw.shape[0] - 1}); given {order!r}")
        out = raw.shape[0] if order is None else len(order)
        panels = empty_huge((-(-out // 16), in_features // 32 * BLOCK_BYTES[kind]), torch.uint8)
        status = self._repack(raw.ctypes.data, raw.shape[1], None if order is None else order.ctypes.data, out,
                              in_features, GGML_TYPE_NUMBERS[ggml_type], int(int8), panels.data_ptr(), self.threads)
        if status != 0:
            raise ValueError(f"rill_repack does not read {ggml_type} rows of {raw.shape[1]} bytes as "
                             f"{in_features} inputs")
        return panels

