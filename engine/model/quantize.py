"""Quantizing at load (`--quantize`): a float model's linears rounded to blocks as ggml rounds them
(`quantize_blocks`: the kernels' kinds; engine/model/kquant.py: ggml's K types) and held as
`QuantLinear`s, or with `dequantized` the float weights those blocks stand for (the reference)."""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from engine.kernels.qlinear import KINDS, QuantKernel
from engine.model.gguf_blocks import blocks_of_gguf, dequantize
from engine.model.quant import QuantLinear


def quantize_blocks(weight: torch.Tensor, kind: str) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """A float weight [out, in] (in a multiple of 32) -> q, d, m as `unpack_raw` gives them, with
    ggml's rounding rules: Q8_0 d = max|w| / 127; Q4_0 d = (the w of largest magnitude) / -8;
    Q4_1 (Q5_1) d = (max - min) / 15 (31), m = min. Scales are rounded to float16 as in a GGUF file;
    "q6_k" (its float32 scale per 16 weights: max |w| / 31) is a plain rounding for the checks."""
    out, inputs = weight.shape
    w = weight.detach().float().numpy().reshape(out, inputs // 32, 32)

    def half(values: np.ndarray) -> np.ndarray:
        return values.astype(np.float16).astype(np.float32)

    def inverse(d: np.ndarray) -> np.ndarray:
        return np.divide(1.0, d, out=np.zeros_like(d), where=d != 0)

    if kind == "q8_0":
        d = np.abs(w).max(axis=-1) / 127.0
        q = np.clip(np.round(w * inverse(d)[..., None]), -127, 127).astype(np.int8)
        return q, half(d), None
    if kind == "q4_0":
        pick = np.take_along_axis(w, np.abs(w).argmax(axis=-1)[..., None], axis=-1)[..., 0]
        d = pick / -8.0
        q = np.clip(np.floor(w * inverse(d)[..., None] + 8.5), 0, 15).astype(np.uint8)
        return q, half(d), None
    if kind in ("q4_1", "q5_1"):
        top = 15 if kind == "q4_1" else 31
        low, high = w.min(axis=-1), w.max(axis=-1)
        d = (high - low) / top
        q = np.clip(np.floor((w - low[..., None]) * inverse(d)[..., None] + 0.5), 0, top).astype(np.uint8)
        return q, half(d), half(low)
    if kind == "q6_k":  # per 16 weights: d = max |w| / 31 (a plain rounding, not llama.cpp's search)
        halves = w.reshape(out, inputs // 32, 2, 16)
        d = np.abs(halves).max(axis=-1) / 31.0
        q = np.clip(np.round(halves * inverse(d)[..., None]), -32, 31) + 32
        return q.astype(np.uint8).reshape(out, inputs // 32, 32), d.astype(np.float32), None
    raise ValueError(f"quantize: the kinds are {', '.join(KINDS)}. Given: {kind!r}")


def _quantizable(model: nn.Module) -> list[tuple[nn.Module, str, nn.Linear]]:
    return [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
            if type(child) is nn.Linear and child.weight.device.type == "cpu" and child.weight.dtype == torch.float32
            and child.in_features % 32 == 0]


# quantizing at load: the kinds `quantize_blocks` rounds, and ggml's K types written in llama.cpp's
# layout (engine/model/kquant.py) with llama-quantize's fallback where rows are no whole super-blocks
LOAD_KINDS = ("q8_0", "q4_0", "q4_1", "q4_k", "q6_k")
_K_FALLBACK = {"q4_k": "q5_0", "q6_k": "q8_0"}


def quantize_linear(weight: torch.Tensor, bias: torch.Tensor | None, kind: str, kernel: QuantKernel,
                    int8: bool = False, dequantized: bool = False):
    """A float weight [out, in] (in a multiple of 32) quantized to `kind` (one of LOAD_KINDS): its
    `QuantLinear`, or with `dequantized` the float32 weight those blocks stand for."""
    from engine.model.kquant import encode_q4_k, encode_q6_k

    if kind not in _K_FALLBACK:
        q, d, m = quantize_blocks(weight, kind)
        if dequantized:
            return dequantize(q, d, m, kind)
        return QuantLinear(q, d, m, kind, bias, kernel, int8)
    w = weight.detach().float().numpy()
    if w.shape[1] % 256:
        from gguf import GGMLQuantizationType
        from gguf.quants import quantize as gguf_quantize

        kind = _K_FALLBACK[kind]
        raw = gguf_quantize(w, GGMLQuantizationType[kind.upper()])
    else:
        raw = (encode_q4_k if kind == "q4_k" else encode_q6_k)(w)
    if dequantized:
        return dequantize(*blocks_of_gguf(raw, kind))
    return QuantLinear.from_gguf(raw, kind, bias, kernel, int8)


def quantize_linears(model: nn.Module, kind: str, kernel: QuantKernel, dequantized: bool = False,
                     int8: bool = False, gguf_kinds: bool = False) -> int:
    """Replace every float32 CPU `nn.Linear` (inputs a multiple of 32) with a `QuantLinear` of its
    weight quantized to `kind` (`int8`: with int8 activations); `dequantized`: instead, write the
    de-quantized weights back into the float model (the reference the quantized one is compared
    with). `gguf_kinds`: `kind` names a GGUF type as `--quantize` does (q4_k, q6_k: ggml's K
    blocks), else one of the kernels' kinds, plainly rounded (`quantize_blocks`). Returns the count."""
    count = 0
    for parent, name, linear in _quantizable(model):
        if gguf_kinds:
            made = quantize_linear(linear.weight, linear.bias, kind, kernel, int8, dequantized)
        else:
            q, d, m = quantize_blocks(linear.weight, kind)
            made = dequantize(q, d, m, kind) if dequantized else QuantLinear(q, d, m, kind, linear.bias, kernel, int8)
        if dequantized:
            with torch.no_grad():
                linear.weight.copy_(made)
        else:
            setattr(parent, name, made)
        count += 1
    return count
