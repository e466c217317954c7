"""Block-quantized linears on the CPU: GGUF's blocks kept as blocks, computed in C.

A GGUF model's quantized weights stay quantized in memory: the lean loader (engine/model/gguf.py)
makes each linear whose tensor has a block type here a `QuantLinear` straight from the file's rows
(`QuantLinear.from_gguf`, rearranged once into panels of 16 outputs, engine/kernels/qlinear.py). A
safetensors model can be quantized at load the same way (`quantize_linears`, `--quantize q8_0|q4_0`).

Activations stay float32, so a step computes the same products as the float32 model whose
weights are the de-quantized blocks, up to the order of the additions: greedy output matches HF
`generate` on that de-quantized model (the parity tests).
"""

from __future__ import annotations

import functools
import logging

import numpy as np
import torch
from torch import nn

from engine.kernels.linear import padded_bias
from engine.kernels.qlinear import KINDS, QuantKernel

log = logging.getLogger("rill.engine")

_RAW_BLOCK_BYTES = {"q8_0": 34, "q4_0": 18, "q4_1": 20}  # ggml's block of 32 weights
_PANEL_BLOCK_BYTES = {"q8_0": 32 * 16 + 64, "q4_0": 32 * 8 + 64, "q4_1": 32 * 8 + 128}


def unpack_raw(raw: np.ndarray, kind: str) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """ggml blocks [out, in / 32 * block bytes] uint8 -> q [out, in / 32, 32] (int8 for Q8_0, 0..15
    for Q4), d [out, in / 32] float32, m (Q4_1) or None."""
    out = raw.shape[0]
    blocks = np.ascontiguousarray(raw).reshape(out, -1, _RAW_BLOCK_BYTES[kind])
    d = blocks[:, :, 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    if kind == "q8_0":
        return blocks[:, :, 2:34].copy().view(np.int8), d, None
    start = 4 if kind == "q4_1" else 2
    m = blocks[:, :, 2:4].copy().view(np.float16)[..., 0].astype(np.float32) if kind == "q4_1" else None
    packed = blocks[:, :, start:start + 16]
    q = np.concatenate([packed & 15, packed >> 4], axis=-1)  # element j low nibble, j + 16 high
    return q, d, m


def unpack_q4_k(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """ggml Q4_K super-blocks [out, in / 256 * 144] uint8 (float16 d and dmin, 8 six-bit scales and
    mins, 256 nibbles) -> q, d, m of Q4_1 blocks of 32 (d = d * scale, m = -dmin * min, products
    in float32 as gguf-py and transformers compute them): the same weights, bit for bit."""
    out = raw.shape[0]
    blocks = np.ascontiguousarray(raw).reshape(out, -1, 144)
    supers = blocks.shape[1]
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    dmin = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    packed = blocks[..., 4:16].reshape(out, supers, 3, 4)  # bytes 0-3, 4-7, 8-11
    low, mid, high = packed[..., 0, :], packed[..., 1, :], packed[..., 2, :]
    scale = np.concatenate([low & 63, (high & 15) | ((low >> 2) & 48)], axis=-1)  # [out, supers, 8]
    minimum = np.concatenate([mid & 63, (high >> 4) | ((mid >> 2) & 48)], axis=-1)
    nibbles = blocks[..., 16:144].reshape(out, supers, 4, 1, 32)  # 64 weights per 32 bytes: low, then high
    q = np.concatenate([nibbles & 15, nibbles >> 4], axis=3).reshape(out, supers * 8, 32)
    sub_d = (d[..., None] * scale.astype(np.float32)).reshape(out, -1)
    sub_m = -(dmin[..., None] * minimum.astype(np.float32)).reshape(out, -1)
    return q, sub_d, sub_m


# a GGUF tensor type -> (its reader, the kernel's kind of block that holds it)
GGUF_TYPES = {**{kind: (functools.partial(unpack_raw, kind=kind), kind) for kind in ("q8_0", "q4_0", "q4_1")},
              "q4_k": (unpack_q4_k, "q4_1")}


def blocks_of_gguf(raw: np.ndarray, ggml_type: str, order: np.ndarray | None = None):
    """A GGUF tensor's raw blocks (uint8 [out, row bytes]) of type `ggml_type` (lower case, a key of
    GGUF_TYPES) -> q, d, m and the kernel's kind that holds them; `order`: the rows to keep, in
    that order (llama.cpp stores q/k rows permuted)."""
    read, kind = GGUF_TYPES[ggml_type]
    if order is not None:
        raw = raw[order]
    q, d, m = read(raw)
    return q, d, m, kind


def dequantize(q: np.ndarray, d: np.ndarray, m: np.ndarray | None, kind: str) -> torch.Tensor:
    """The float32 weight [out, in] the blocks stand for."""
    values = q.astype(np.float32)
    if kind == "q4_0":
        values = values - 8.0
    w = d[..., None] * values
    if m is not None:
        w = w + m[..., None]
    return torch.from_numpy(w.reshape(q.shape[0], -1))


def panels_of_blocks(q: np.ndarray, d: np.ndarray, m: np.ndarray | None, kind: str,
                     int8: bool = False) -> torch.Tensor:
    """q, d, m of `unpack_raw` -> the kernel's panels (uint8 [ceil(out / 16), in / 32 * panel block
    bytes]): csrc/qlinear.c's layout (input-major), or with `int8` csrc/qlinear_i8.c's (groups of
    4 inputs per output, for the byte dot products)."""
    out, blocks, _ = q.shape
    panels = -(-out // 16)
    pad = panels * 16 - out
    if pad:
        q = np.concatenate([q, np.zeros((pad, blocks, 32), q.dtype)])
        d = np.concatenate([d, np.zeros((pad, blocks), np.float32)])
        m = None if m is None else np.concatenate([m, np.zeros((pad, blocks), np.float32)])
    if int8 and kind == "q8_0":  # [panel, block, half, group of 4 inputs, output, input in the group]
        weights = q.reshape(panels, 2, 8, blocks, 8, 4).transpose(0, 3, 1, 4, 2, 5)
        weights = np.ascontiguousarray(weights).view(np.uint8).reshape(panels, blocks, 512)
    elif int8:  # [panel, block, half, vector v, output, b]: low nibble input 4v + b, high 16 + 4v + b
        q = q.astype(np.uint8).reshape(panels, 2, 8, blocks, 2, 4, 4)
        packed = q[:, :, :, :, 0] | (q[:, :, :, :, 1] << 4)
        weights = np.ascontiguousarray(packed.transpose(0, 3, 1, 4, 2, 5)).reshape(panels, blocks, 256)
    elif kind == "q8_0":  # [panel, block, input, output]
        weights = np.ascontiguousarray(q.reshape(panels, 16, blocks, 32).transpose(0, 2, 3, 1))
        weights = weights.view(np.uint8).reshape(panels, blocks, 512)
    else:  # [panel, block, input, output j | output j + 8 in the high nibble]
        q = q.reshape(panels, 16, blocks, 32).transpose(0, 2, 3, 1).astype(np.uint8)
        weights = (q[..., :8] | (q[..., 8:] << 4)).reshape(panels, blocks, 256)
    parts = [weights, np.ascontiguousarray(d.reshape(panels, 16, blocks).transpose(0, 2, 1)).view(np.uint8)]
    if m is not None:
        parts.append(np.ascontiguousarray(m.reshape(panels, 16, blocks).transpose(0, 2, 1)).view(np.uint8))
    return torch.from_numpy(np.ascontiguousarray(np.concatenate(parts, axis=-1)).reshape(panels, -1))


def q8_0_blocks_of_panels(panels: torch.Tensor, out: int, blocks: int) -> tuple[np.ndarray, np.ndarray]:
    """The inverse of `panels_of_blocks` for Q8_0 in csrc/qlinear.c's layout: q [out, blocks, 32]
    int8 and d [out, blocks] float32."""
    raw = panels.numpy().reshape(-1, blocks, 32 * 16 + 64)  # [panel, block, 32 x 16 int8 | 16 float32 d]
    count = raw.shape[0]
    q = np.ascontiguousarray(raw[:, :, :512]).view(np.int8).reshape(count, blocks, 32, 16)
    d = np.ascontiguousarray(raw[:, :, 512:]).view(np.float32).reshape(count, blocks, 16)
    return (np.ascontiguousarray(q.transpose(0, 3, 1, 2).reshape(count * 16, blocks, 32)[:out]),
            np.ascontiguousarray(d.transpose(0, 2, 1).reshape(count * 16, blocks)[:out]))


def quantize_activations(x: torch.Tensor) -> torch.Tensor:
    """x [rows, in] -> the float32 values csrc/qlinear_i8.c computes with: each block of 32 inputs
    rounded to int8 steps of max |x| / 127 (the reference of the int8-activation kernel)."""
    blocks = x.float().reshape(x.shape[0], -1, 32)
    d = blocks.abs().amax(dim=-1, keepdim=True) / 127.0
    inverse = torch.where(d != 0, 1.0 / d, torch.zeros_like(d))
    return (torch.round(blocks * inverse).clamp(-127, 127) * d).reshape(x.shape)


class QuantLinear(nn.Module):
    """`nn.Linear` for inference on CPU with its weight kept as Q8_0/Q4_0/Q4_1 blocks; `int8`: its
    input rounded to int8 per block of 32 (faster, lossy) instead of float32."""

    def __init__(self, q: np.ndarray, d: np.ndarray, m: np.ndarray | None, kind: str, bias: torch.Tensor | None,
                 kernel: QuantKernel, int8: bool = False):
        super().__init__()
        self.out_features, self.in_features = q.shape[0], q.shape[1] * 32
        self.kind, self.kernel, self.int8 = kind, kernel, int8
        self.source = kind  # the file's type of block (Q4_K is held as Q4_1 blocks)
        self.panels = panels_of_blocks(q, d, m, kind, int8)
        self.bias = padded_bias(bias, self.panels.shape[0], self.out_features)

    @classmethod
    def from_gguf(cls, raw: np.ndarray, ggml_type: str, bias: torch.Tensor | None, kernel: QuantKernel,
                  int8: bool = False, order: np.ndarray | None = None) -> "QuantLinear":
        """The layer of a GGUF tensor's raw blocks (see `blocks_of_gguf`), rows in `order`."""
        q, d, m, kind = blocks_of_gguf(raw, ggml_type, order)
        layer = cls(q, d, m, kind, bias, kernel, int8)
        layer.source = ggml_type
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        y = self.kernel(x.reshape(-1, self.in_features), self.panels, self.bias, self.out_features, self.kind,
                        self.int8)
        return y.view(*lead, self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.kind}" + \
            (", int8 activations" if self.int8 else "")


class FusedProjections(nn.Module):
    """Several `QuantLinear`s of one input (q/k/v, gate/up) as one kernel call: their panels end to
    end. The model still calls each projection; the first call computes all of them for its input
    and the others return their columns of that result while the input is the same tensor."""

    def __init__(self, parts: list[QuantLinear]):
        super().__init__()
        first = parts[0]
        self.kind, self.kernel, self.in_features, self.int8 = first.kind, first.kernel, first.in_features, first.int8
        self.panels = torch.cat([part.panels for part in parts])
        self.bias = None
        if any(part.bias is not None for part in parts):
            self.bias = torch.cat([part.bias if part.bias is not None else torch.zeros(part.panels.shape[0] * 16)
                                   for part in parts])
        self.widths = [part.panels.shape[0] * 16 for part in parts]
        self.out_features = sum(self.widths)
        self._input: torch.Tensor | None = None  # the input of the last fused call
        self._outputs: list[torch.Tensor] = []

    def part(self, index: int, x: torch.Tensor) -> torch.Tensor:
        if index == 0 or x is not self._input:
            lead = x.shape[:-1]
            y = self.kernel(x.reshape(-1, self.in_features), self.panels, self.bias, self.out_features, self.kind,
                            self.int8)
            self._outputs = [piece.view(*lead, piece.shape[-1]) for piece in y.split(self.widths, dim=-1)]
            self._input = x
        out = self._outputs[index]
        if index == len(self.widths) - 1:  # the last part: forget the input (no reference kept past the step)
            self._input, self._outputs = None, []
        return out


class FusedPart(nn.Module):
    """One projection of a `FusedProjections` group, where the model expects its own linear."""

    def __init__(self, group: FusedProjections, index: int, out_features: int):
        super().__init__()
        self.group, self.index = group, index
        self.in_features, self.out_features = group.in_features, out_features
        self.kind = group.kind

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.group.part(self.index, x)
        return out if out.shape[-1] == self.out_features else out[..., :self.out_features]

    def extra_repr(self) -> str:
        return f"part {self.index} of {len(self.group.widths)}, out_features={self.out_features}, {self.kind}"


FUSABLE = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))  # the Llama family's names


def fuse_projections(model: nn.Module) -> int:
    """Group the `QuantLinear` projections that read one input (by their names in the Llama family:
    q/k/v in attention, gate/up in the MLP) into `FusedProjections`; returns the groups made.
    Only whole panels are fused (each part but the last a multiple of 16 outputs)."""
    groups = 0
    for module in list(model.modules()):
        for names in FUSABLE:
            parts = [getattr(module, name, None) for name in names]
            if not all(type(part) is QuantLinear for part in parts):
                continue
            if len({(part.kind, part.in_features, part.int8) for part in parts}) != 1:
                continue
            if any(part.out_features % 16 for part in parts[:-1]):
                continue
            group = FusedProjections(parts)
            for index, (name, part) in enumerate(zip(names, parts)):
                setattr(module, name, FusedPart(group, index, part.out_features))
            module.add_module("fused_" + "_".join(n.removesuffix("_proj") for n in names), group)
            groups += 1
    return groups


def quantize_blocks(weight: torch.Tensor, kind: str) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """A float weight [out, in] (in a multiple of 32) -> q, d, m as `unpack_raw` gives them, with
    ggml's rounding rules: Q8_0 d = max|w| / 127; Q4_0 d = (the w of largest magnitude) / -8;
    Q4_1 d = (max - min) / 15, m = min. Scales are rounded to float16 as in a GGUF file."""
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
    if kind == "q4_1":
        low, high = w.min(axis=-1), w.max(axis=-1)
        d = (high - low) / 15.0
        q = np.clip(np.floor((w - low[..., None]) * inverse(d)[..., None] + 0.5), 0, 15).astype(np.uint8)
        return q, half(d), half(low)
    raise ValueError(f"quantize: the kinds are {', '.join(KINDS)}. Given: {kind!r}")


def _quantizable(model: nn.Module) -> list[tuple[nn.Module, str, nn.Linear]]:
    return [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
            if type(child) is nn.Linear and child.weight.device.type == "cpu" and child.weight.dtype == torch.float32
            and child.in_features % 32 == 0]


def quantize_linears(model: nn.Module, kind: str, kernel: QuantKernel, dequantized: bool = False,
                     int8: bool = False) -> int:
    """Replace every float32 CPU `nn.Linear` (inputs a multiple of 32) with a `QuantLinear` of its
    weight quantized to `kind` (`int8`: with int8 activations); `dequantized`: instead, write the
    de-quantized weights back into the float model (the reference the quantized one is compared
    with). Returns the count."""
    count = 0
    for parent, name, linear in _quantizable(model):
        q, d, m = quantize_blocks(linear.weight, kind)
        if dequantized:
            with torch.no_grad():
                linear.weight.copy_(dequantize(q, d, m, kind))
        else:
            setattr(parent, name, QuantLinear(q, d, m, kind, linear.bias, kernel, int8))
        count += 1
    return count
