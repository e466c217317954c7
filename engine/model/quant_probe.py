"""The block kernels' start-up probe: `rill_qlinear`, `rill_qlinear_i8` and `rill_repack`
(engine/kernels/qlinear.py) against torch and numpy on small cases of every kind before the engine
uses them (`quant_kernel`); on a mismatch or without a compiler the weights stay float32."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from engine.kernels.build import checked_kernel
from engine.kernels.qlinear import KINDS, SUPER_KINDS, QuantKernel
from engine.model.gguf_blocks import (GGUF_BLOCKS, GGUF_TYPES, blocks_of_gguf, dequantize, held_kind,
                                      random_gguf_blocks)
from engine.model.panels import panels_of_blocks
from engine.model.quant import QuantLinear
from engine.model.quantize import quantize_blocks


def quantize_activations(x: torch.Tensor) -> torch.Tensor:
    """x [rows, in] -> the float32 values csrc/qlinear_i8.c computes with: each block of 32 inputs
    rounded to int8 steps of max |x| / 127 (the reference of the int8-activation kernel)."""
    blocks = x.float().reshape(x.shape[0], -1, 32)
    d = blocks.abs().amax(dim=-1, keepdim=True) / 127.0
    inverse = torch.where(d != 0, 1.0 / d, torch.zeros_like(d))
    return (torch.round(blocks * inverse).clamp(-127, 127) * d).reshape(x.shape)


def quant_agrees(kernel: QuantKernel) -> bool:
    """The kernels against F.linear on the de-quantized weight, for each kind: 1 to 13 rows (the
    row-by-row path and the tiles of 6 with every partial one), 16, 17 and 35 (AMX's tiles of up to
    16 rows), a partial panel, bias or none;
    the int8-activation kernel against F.linear of the rounded activations (`quantize_activations`);
    `repack` against numpy's panels for every GGUF type, rows reordered or not, both layouts; the
    super-block kinds (q4_k, q6_ks) from Q4_K's and Q6_K's raw rows, the same rows."""
    gen = torch.Generator().manual_seed(0)
    weight, bias = torch.randn(21, 64, generator=gen), torch.randn(21, generator=gen)
    wide = torch.randn(35, 70, generator=gen)
    for kind in (kind for kind in KINDS if kind not in SUPER_KINDS):  # super-blocks: from GGUF only (below)
        q, d, m = quantize_blocks(weight, kind)
        reference = dequantize(q, d, m, kind)
        for b, int8 in ((bias, False), (None, False), (bias, True), (None, True)):
            layer = QuantLinear(q, d, m, kind, b, kernel, int8)
            for rows in (*range(1, 14), 16, 17, 35):  # AMX tiles where the CPU has them (2-6 rows, 16+)
                x = wide[:rows, :64].contiguous()
                expected = torch.nn.functional.linear(quantize_activations(x) if int8 else x, reference, b)
                if not torch.allclose(layer(x), expected, atol=1e-4, rtol=1e-4):
                    return False
    order = np.array([5, 0, 17, 3, 3, 20, 9, 1, 11, 2, 8, 4, 6, 7, 10, 12, 13])  # a partial panel, a row twice
    for ggml_type in GGUF_TYPES:
        raw = random_gguf_blocks(ggml_type, 21, GGUF_BLOCKS[ggml_type][0], seed=1)
        for rows, int8 in ((None, False), (order, False), (None, True), (order, True)):
            expected = panels_of_blocks(*blocks_of_gguf(raw, ggml_type, rows), int8)
            kind = held_kind(ggml_type, int8)
            if not torch.equal(kernel.repack(raw, ggml_type, kind, GGUF_BLOCKS[ggml_type][0], rows, int8), expected):
                return False
    for ggml_type in ("q4_k", "q6_k"):  # the super-block kinds' kernels: two super-blocks a row
        raw = random_gguf_blocks(ggml_type, 21, 512, seed=2)
        layer, reference = QuantLinear.from_gguf(raw, ggml_type, bias, kernel), dequantize(*blocks_of_gguf(raw, ggml_type))
        for rows in (*range(1, 14), 16, 17, 35):  # AMX tiles where the CPU has them (2-6 rows, 16+)
            x = torch.randn(rows, 512, generator=gen)
            if not torch.allclose(layer(x), torch.nn.functional.linear(x, reference, bias), atol=1e-4, rtol=1e-4):
                return False
    return True


def quant_kernel(cache_dir: Path) -> QuantKernel | None:
    """The compiled block-quantized linear, or None (with the reason logged) when it cannot be used here."""
    return checked_kernel(QuantKernel, quant_agrees, cache_dir, "quantized linears", "F.linear", "float32 weights")
