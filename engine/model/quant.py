"""Block-quantized linears on the CPU: GGUF's quantized tensors kept as blocks, computed in C.

A GGUF model's quantized weights stay quantized in memory: each type of GGUF_TYPES (Q8_0, Q4_0,
Q4_1, Q5_0, Q5_1, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS) is read as blocks of 32 weights of one
of the kernels' seven kinds (q8_0, q4_0, q4_1, q5_1, q6_k, and the super-blocks of 256 q4_k and
q6_ks: csrc/blocks.h), whose de-quantized weights are gguf-py's (and so transformers') bit for
bit, and rearranged once into panels of 16 outputs (`panels_of_blocks` here, `rill_repack` in C
from the raw rows: byte for byte the same).
The lean loader (engine/model/gguf.py) makes each linear of such a tensor with
`QuantLinear.from_gguf`, from the file's raw rows. A safetensors model can be quantized at load
the same way (`quantize_linears`, `--quantize q8_0|q4_0|q4_1`).

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
from engine.kernels.qlinear import KINDS, SUPER_KINDS, QuantKernel

log = logging.getLogger("rill.engine")

_RAW_BLOCK_BYTES = {"q8_0": 34, "q4_0": 18, "q4_1": 20}  # ggml's block of 32 weights
OFFSETS = {"q4_0": 8, "q6_k": 32}  # w = d (q - offset) for these kinds
IQ4_VALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], np.int8)


def _blocks(raw: np.ndarray, size: int) -> np.ndarray:
    """raw [out, row bytes] -> [out, blocks, size]."""
    return np.ascontiguousarray(raw).reshape(raw.shape[0], -1, size)


def _half(blocks: np.ndarray, start: int) -> np.ndarray:
    """The float16 at bytes start and start + 1 of each block, as float32."""
    return blocks[..., start:start + 2].copy().view(np.float16)[..., 0].astype(np.float32)


def _nibbles(packed: np.ndarray) -> np.ndarray:
    """16 bytes -> 32 values: element j the low nibble of byte j, element j + 16 its high nibble."""
    return np.concatenate([packed & 15, packed >> 4], axis=-1)


def _bits(packed: np.ndarray) -> np.ndarray:
    """bytes [..., n] -> their bits [..., 8, n]: [..., i, e] is bit i of byte e."""
    return np.unpackbits(packed[..., None], axis=-1, bitorder="little").swapaxes(-1, -2)


def _scales_k4(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K's and Q5_K's 12 bytes of six-bit scales and minimums -> 8 of each, as float32."""
    low, mid, high = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    scale = np.concatenate([low & 63, (high & 15) | ((low >> 2) & 48)], axis=-1)
    minimum = np.concatenate([mid & 63, (high >> 4) | ((mid >> 2) & 48)], axis=-1)
    return scale.astype(np.float32), minimum.astype(np.float32)


def unpack_raw(raw: np.ndarray, kind: str) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """ggml blocks [out, in / 32 * block bytes] uint8 -> q [out, in / 32, 32] (int8 for Q8_0, 0..15
    for Q4), d [out, in / 32] float32, m (Q4_1) or None."""
    blocks = _blocks(raw, _RAW_BLOCK_BYTES[kind])
    d = _half(blocks, 0)
    if kind == "q8_0":
        return blocks[:, :, 2:34].copy().view(np.int8), d, None
    if kind == "q4_1":
        return _nibbles(blocks[:, :, 4:20]), d, _half(blocks, 2)
    return _nibbles(blocks[:, :, 2:18]), d, None


def unpack_q4_k(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """ggml Q4_K super-blocks [out, in / 256 * 144] uint8 (float16 d and dmin, 8 six-bit scales and
    mins, 256 nibbles) -> q, d, m of "q4_k" blocks of 32, their factors kept: d [out, in / 32, 2]
    (the super-block's d, the block's scale) and m (-dmin, the block's min). Their products
    (`k_products`: d * scale, m = -dmin * min in float32 as gguf-py and transformers compute them)
    are Q4_1's d and m for the same weights, bit for bit."""
    blocks = _blocks(raw, 144)
    out, supers = blocks.shape[:2]
    scale, minimum = _scales_k4(blocks[..., 4:16])
    nibbles = blocks[..., 16:144].reshape(out, supers, 4, 1, 32)  # 64 weights per 32 bytes: low, then high
    q = np.concatenate([nibbles & 15, nibbles >> 4], axis=3).reshape(out, supers * 8, 32)
    factor = np.broadcast_to(_half(blocks, 0)[..., None], scale.shape)
    low = np.broadcast_to(-_half(blocks, 2)[..., None], minimum.shape)
    return (q, np.stack([factor, scale], axis=-1).reshape(out, -1, 2),
            np.stack([low, minimum], axis=-1).reshape(out, -1, 2))


def super_products(d: np.ndarray, m: np.ndarray | None) -> tuple[np.ndarray, np.ndarray | None]:
    """A super-block kind's factors (the last axis: the super-block's float, the block's integer) ->
    the d and m of its products' kind (q4_1, q6_k): one float32 product each (-dmin times a min is
    -(dmin min) exactly)."""
    return d[..., 0] * d[..., 1], None if m is None else m[..., 0] * m[..., 1]


def unpack_q5_k(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """ggml Q5_K super-blocks [out, in / 256 * 176] (Q4_K's scales, then a fifth bit per weight:
    bit i of byte e for element e of sub-block i) -> q (0..31), d, m of "q5_1" blocks of 32, the
    products in float32 as gguf-py computes them."""
    blocks = _blocks(raw, 176)
    out, supers = blocks.shape[:2]
    scale, minimum = _scales_k4(blocks[..., 4:16])
    nibbles = blocks[..., 48:176].reshape(out, supers, 4, 1, 32)
    low = np.concatenate([nibbles & 15, nibbles >> 4], axis=3).reshape(out, supers, 8, 32)
    q = (low | (_bits(blocks[..., 16:48]) << 4)).reshape(out, supers * 8, 32)
    sub_d = (_half(blocks, 0)[..., None] * scale).reshape(out, -1)
    sub_m = -(_half(blocks, 2)[..., None] * minimum).reshape(out, -1)
    return q, sub_d, sub_m


def unpack_q5_1(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """ggml Q5_1 blocks [out, in / 32 * 24] (float16 d and m, the fifth bits as a uint32, 16 bytes
    of nibbles) -> q (0..31), d, m: w = d q + m."""
    blocks = _blocks(raw, 24)
    q = _nibbles(blocks[..., 8:24]) | (_bits(blocks[..., 4:8]).swapaxes(-1, -2).reshape(*blocks.shape[:2], 32) << 4)
    return q, _half(blocks, 0), _half(blocks, 2)


def unpack_q5_0(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray, None]:
    """ggml Q5_0 blocks [out, in / 32 * 22] (w = d (q - 16), q 0..31) -> "q6_k" blocks: q + 16
    (so that q - 32 is the same integer) and the same d for both halves."""
    blocks = _blocks(raw, 22)
    q = _nibbles(blocks[..., 6:22]) | (_bits(blocks[..., 2:6]).swapaxes(-1, -2).reshape(*blocks.shape[:2], 32) << 4)
    d = _half(blocks, 0)
    return q + 16, np.stack([d, d], axis=-1), None


def unpack_q6_k(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray, None]:
    """ggml Q6_K super-blocks [out, in / 256 * 210] (128 bytes of low nibbles, 64 of two-bit highs,
    16 int8 scales, float16 d; w = d scale (q - 32) per 16 weights) -> q (0..63) and d of "q6_ks"
    blocks: [out, in / 32, 2, 2], per 16 inputs its factors (d, scale), whose float32 products
    (`super_products`) are q6_k's d."""
    blocks = _blocks(raw, 210)
    out, supers = blocks.shape[:2]
    low = blocks[..., 0:128].reshape(out, supers, 2, 1, 64)  # element 128 h + 64 s + c: nibble s of byte 64 h + c
    low = np.concatenate([low & 15, low >> 4], axis=3).reshape(out, supers, 256)
    high = blocks[..., 128:192].reshape(out, supers, 2, 1, 32)  # element 128 h + 32 t + c: bits 2t of byte 32 h + c
    high = ((high >> np.array([0, 2, 4, 6], np.uint8).reshape(4, 1)) & 3).reshape(out, supers, 256)
    scales = blocks[..., 192:208].copy().view(np.int8).astype(np.float32)
    return (low | (high << 4)).reshape(out, supers * 8, 32), _q6_factors(_half(blocks, 208), scales), None


def _q6_factors(d: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """A super-block's float d [out, supers] and its 16 integer scales [out, supers, 16] -> "q6_ks"'s
    d [out, supers * 8, 2, 2]: per block, per 16 inputs, (d, scale)."""
    out, supers = d.shape
    return np.stack([np.broadcast_to(d[..., None], scales.shape), scales], axis=-1).reshape(out, supers * 8, 2, 2)


def unpack_q3_k(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray, None]:
    """ggml Q3_K super-blocks [out, in / 256 * 110] (a mask of third bits, 64 bytes of two-bit lows,
    12 bytes of six-bit scales, float16 d; w = d (scale - 32) q per 16 weights, q in -4..3) ->
    "q6_k" blocks: q + 32 and the float32 products d (scale - 32)."""
    blocks = _blocks(raw, 110)
    out, supers = blocks.shape[:2]
    packed = blocks[..., 96:108]
    low = np.concatenate([packed[..., 0:8] & 15, packed[..., 0:8] >> 4], axis=-1)  # scale 8 s + j: byte j >> 4 s
    high = (packed[..., None, 8:12] >> np.array([0, 2, 4, 6], np.uint8).reshape(4, 1)) & 3  # 4 s + j: byte 8 + j >> 2 s
    scales = (low | (high.reshape(out, supers, 16) << 4)).astype(np.float32) - 32.0
    d = _q6_factors(_half(blocks, 108), scales)
    twos = blocks[..., 32:96].reshape(out, supers, 2, 1, 32)  # element 128 h + 32 s + c: bits 2s of byte 32 h + c
    twos = ((twos >> np.array([0, 2, 4, 6], np.uint8).reshape(4, 1)) & 3).reshape(out, supers, 256)
    third = _bits(blocks[..., 0:32]).reshape(out, supers, 256)  # element 32 i + c: bit i of byte c
    q = twos + 28 + 4 * third  # q + 32: the bit set means no -4
    return q.reshape(out, supers * 8, 32), d, None


def unpack_iq4_nl(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray, None]:
    """ggml IQ4_NL blocks [out, in / 32 * 18] (float16 d, 16 bytes of nibbles indexing ggml's 16
    int8 values) -> q8_0 blocks: those values and d."""
    blocks = _blocks(raw, 18)
    return IQ4_VALUES[_nibbles(blocks[..., 2:18])], _half(blocks, 0), None


def unpack_iq4_xs(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray, None]:
    """ggml IQ4_XS super-blocks [out, in / 256 * 136] (float16 d, six-bit scales: the high two bits
    in a uint16, the low four in 4 bytes; 8 x 16 bytes of IQ4_NL nibbles) -> q8_0 blocks: the
    int8 values and d (scale - 32) in float32."""
    blocks = _blocks(raw, 136)
    out, supers = blocks.shape[:2]
    high = blocks[..., 2:4].copy().view(np.uint16) >> np.array([0, 2, 4, 6, 8, 10, 12, 14], np.uint16)
    low = np.stack([blocks[..., 4:8] & 15, blocks[..., 4:8] >> 4], axis=-1).reshape(out, supers, 8)
    scales = (low | ((high & 3).astype(np.uint8) << 4)).astype(np.float32) - 32.0
    d = (_half(blocks, 0)[..., None] * scales).reshape(out, supers * 8)
    q = IQ4_VALUES[_nibbles(blocks[..., 8:136].reshape(out, supers, 8, 16))]
    return q.reshape(out, supers * 8, 32), d, None


# a GGUF tensor type -> (its reader, the kernels' kind of block that holds it)
GGUF_TYPES = {**{kind: (functools.partial(unpack_raw, kind=kind), kind) for kind in ("q8_0", "q4_0", "q4_1")},
              "q5_0": (unpack_q5_0, "q6_k"), "q5_1": (unpack_q5_1, "q5_1"), "q3_k": (unpack_q3_k, "q6_ks"),
              "q4_k": (unpack_q4_k, "q4_k"), "q5_k": (unpack_q5_k, "q5_1"), "q6_k": (unpack_q6_k, "q6_ks"),
              "iq4_nl": (unpack_iq4_nl, "q8_0"), "iq4_xs": (unpack_iq4_xs, "q8_0")}
# a GGUF tensor type -> (weights, bytes) of its block in the file
GGUF_BLOCKS = {"q8_0": (32, 34), "q4_0": (32, 18), "q4_1": (32, 20), "q5_0": (32, 22), "q5_1": (32, 24),
               "q3_k": (256, 110), "q4_k": (256, 144), "q5_k": (256, 176), "q6_k": (256, 210), "iq4_nl": (32, 18),
               "iq4_xs": (256, 136)}

_GGUF_HALVES = {"q8_0": (0,), "q4_0": (0,), "q4_1": (0, 2), "q5_0": (0,), "q5_1": (0, 2), "q3_k": (108,),
                "q4_k": (0, 2), "q5_k": (0, 2), "q6_k": (208,), "iq4_nl": (0,), "iq4_xs": (0,)}  # float16 scales


def random_gguf_blocks(ggml_type: str, out: int, inputs: int, seed: int = 0) -> np.ndarray:
    """Valid raw blocks of `ggml_type` (uint8 [out, row bytes]) for the checks: random bytes, their
    float16 scales (d, dmin, m) random too but finite and moderate (weights mostly under 1)."""
    gen = np.random.default_rng(seed)
    weights, size = GGUF_BLOCKS[ggml_type]
    blocks = gen.integers(0, 256, (out, inputs // weights, size), dtype=np.uint8)
    size_of_scale = 0.01 if weights == 32 else 0.01 / 64  # a super-block's d multiplies 6- or 8-bit scales
    for start in _GGUF_HALVES[ggml_type]:
        scale = (gen.standard_normal((out, inputs // weights)) * size_of_scale).astype(np.float16)
        blocks[..., start:start + 2] = scale.view(np.uint8).reshape(out, -1, 2)
    return blocks.reshape(out, -1)


def held_kind(ggml_type: str, int8: bool = False) -> str:
    """The kernels' kind that holds a GGUF type's blocks: GGUF_TYPES's, but with int8 activations a
    super-block kind's products' (the int8 kernel has no super-blocks)."""
    kind = GGUF_TYPES[ggml_type][1]
    return SUPER_KINDS.get(kind, kind) if int8 else kind


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
    """The float32 weight [out, in] the blocks stand for: d (q - offset) (+ m), Q6_K's d per 16."""
    if kind in SUPER_KINDS:
        (d, m), kind = super_products(d, m), SUPER_KINDS[kind]
    values = q.astype(np.float32)
    if kind in OFFSETS:
        values = values - np.float32(OFFSETS[kind])
    if kind == "q6_k":
        w = d[..., None] * values.reshape(*q.shape[:2], 2, 16)
    else:
        w = d[..., None] * values
    if m is not None:
        w = w + m[..., None]
    return torch.from_numpy(w.reshape(q.shape[0], -1))


def panels_of_blocks(q: np.ndarray, d: np.ndarray, m: np.ndarray | None, kind: str,
                     int8: bool = False) -> torch.Tensor:
    """q, d, m of a reader -> the kernel's panels (uint8 [ceil(out / 16), in / 32 * panel block
    bytes]): csrc/qlinear.c's layout (input-major), or with `int8` csrc/qlinear_i8.c's (groups of
    4 inputs per output, for the byte dot products). Q5_1 and Q6_K blocks hold their low nibbles as
    Q4's and the bits above them in a plane of their own after them; q4_k (q6_ks) blocks their
    integers after q4_1's weights (q6_ks: after q - 32 as int8 bytes), in super-blocks headed by their
    floats (see csrc/blocks.h); with `int8`, as the blocks of their products' kind."""
    if kind in SUPER_KINDS and int8:
        (d, m), kind = super_products(d, m), SUPER_KINDS[kind]
    if kind in SUPER_KINDS:
        return _super_panels(q, d, m, kind)
    out, blocks, _ = q.shape
    panels = -(-out // 16)
    pad = panels * 16 - out
    if pad:
        q = np.concatenate([q, np.zeros((pad, blocks, 32), q.dtype)])
        d = np.concatenate([d, np.zeros((pad, *d.shape[1:]), np.float32)])
        m = None if m is None else np.concatenate([m, np.zeros((pad, blocks), np.float32)])
    if kind == "q8_0":
        if int8:  # [panel, block, half, group of 4 inputs, output, input in the group]
            weights = q.reshape(panels, 2, 8, blocks, 8, 4).transpose(0, 3, 1, 4, 2, 5)
        else:  # [panel, block, input, output]
            weights = q.reshape(panels, 16, blocks, 32).transpose(0, 2, 3, 1)
        parts = [np.ascontiguousarray(weights).view(np.uint8).reshape(panels, blocks, 512)]
    else:
        q = q.astype(np.uint8)
        low, high = q & 15, q >> 4
        if int8:  # [panel, block, half, vector v, output, b]: low nibble input 4v + b, high 16 + 4v + b
            low = low.reshape(panels, 2, 8, blocks, 2, 4, 4)
            packed = low[:, :, :, :, 0] | (low[:, :, :, :, 1] << 4)
            parts = [packed.transpose(0, 3, 1, 4, 2, 5).reshape(panels, blocks, 256)]
        else:  # [panel, block, input, output j | output j + 8 in the high nibble]
            low = low.reshape(panels, 16, blocks, 32).transpose(0, 2, 3, 1)
            parts = [(low[..., :8] | (low[..., 8:] << 4)).reshape(panels, blocks, 256)]
        if kind == "q5_1" and int8:  # [panel, block, half, output, b]: bit v input 4v + b's, bit 4 + v 16 + 4v + b's
            bits = high.reshape(panels, 2, 8, blocks, 2, 4, 4) << np.arange(8, dtype=np.uint8).reshape(2, 4, 1)
            parts.append(bits.sum(axis=(4, 5), dtype=np.uint8).transpose(0, 3, 1, 2, 4).reshape(panels, blocks, 64))
        elif kind == "q5_1":  # [panel, block, 4 inputs 4G + g, output j]: bit 2g output j's, 2g + 1 j + 8's
            bits = high.reshape(panels, 16, blocks, 8, 4).transpose(0, 2, 3, 4, 1).reshape(panels, blocks, 8, 4, 2, 8)
            bits = bits << np.arange(8, dtype=np.uint8).reshape(4, 2, 1)
            parts.append(bits.sum(axis=(3, 4), dtype=np.uint8).reshape(panels, blocks, 64))
        elif kind == "q6_k" and int8:  # [panel, block, half, pair w, output, b]: bits 4o + 2i input 16i + 4(2w + o) + b's
            bits = high.reshape(panels, 2, 8, blocks, 2, 2, 2, 4)  # [.., i, w, o, b]
            bits = bits << np.array([[0, 4], [2, 6]], np.uint8).reshape(2, 1, 2, 1)
            parts.append(bits.sum(axis=(4, 6), dtype=np.uint8).transpose(0, 3, 1, 4, 2, 5).reshape(panels, blocks, 128))
        elif kind == "q6_k":  # [panel, block, 2 inputs 2P + o, output j]: bits 4o output j's, 4o + 2 j + 8's
            bits = high.reshape(panels, 16, blocks, 16, 2).transpose(0, 2, 3, 4, 1).reshape(panels, blocks, 16, 2, 2, 8)
            bits = bits << np.array([0, 2, 4, 6], np.uint8).reshape(2, 2, 1)
            parts.append(bits.sum(axis=(3, 4), dtype=np.uint8).reshape(panels, blocks, 128))
    scales = d.reshape(panels, 16, blocks, -1).transpose(0, 2, 3, 1)  # [panel, block, (Q6_K: half,) output]
    parts.append(np.ascontiguousarray(scales).view(np.uint8).reshape(panels, blocks, -1))
    if m is not None:
        parts.append(np.ascontiguousarray(m.reshape(panels, 16, blocks).transpose(0, 2, 1)).view(np.uint8))
    return torch.from_numpy(np.ascontiguousarray(np.concatenate(parts, axis=-1)).reshape(panels, -1))


def _super_panels(q: np.ndarray, d: np.ndarray, m: np.ndarray | None, kind: str) -> torch.Tensor:
    """q4_k's (q6_ks') panels: per super-block of 8 blocks, float32 D[16] (q4_k: and M[16]), its
    outputs' factors, then each block's weights (q4_k: as q4_1's; q6_ks: q - 32 as int8, as q8_0's)
    and its integers: q4_k uint8 scale[16], min[16]; q6_ks int8 scale[2][16] (per 16 inputs)."""
    out, blocks, _ = q.shape
    pad = -out % 16
    if pad:
        q = np.concatenate([q, np.zeros((pad, blocks, 32), q.dtype)])
        d, m = (None if a is None else np.concatenate([a, np.zeros((pad, *a.shape[1:]), np.float32)]) for a in (d, m))
    panels, supers = (out + pad) // 16, blocks // 8
    if kind == "q4_k":  # weights as q4_1's; [output, block, scale | min] -> [panel, block, scale | min, output]
        laid = panels_of_blocks(q, *super_products(d, m), SUPER_KINDS[kind]).numpy().reshape(panels, blocks, -1)[..., :256]
        ints = np.stack([d[..., 1], m[..., 1]], axis=-1).astype(np.uint8)
        heads = np.stack([d[:, ::8, 0], m[:, ::8, 0]], axis=-1)
    else:  # weights q - 32 as int8, as q8_0's; [output, block, part]: int8
        values = (q.astype(np.int16) - 32).astype(np.int8)
        laid = panels_of_blocks(values, np.zeros(values.shape[:2], np.float32), None, "q8_0").numpy()
        laid = laid.reshape(panels, blocks, -1)[..., :512]
        ints = d[..., 1].astype(np.int8).view(np.uint8)
        heads = d[:, ::8, 0, 0, None]
    ints = ints.reshape(panels, 16, blocks, 2).transpose(0, 2, 3, 1).reshape(panels, blocks, 32)
    body = np.concatenate([laid, ints], axis=-1).reshape(panels, supers, -1)
    count = heads.shape[-1]  # [output, super, D (| M)] -> [panel, super, D[16] (| M[16])]
    heads = np.ascontiguousarray(heads.astype(np.float32).reshape(panels, 16, supers, count).transpose(0, 2, 3, 1))
    return torch.from_numpy(np.ascontiguousarray(np.concatenate([heads.view(np.uint8).reshape(panels, supers, -1), body],
                                                                axis=-1)).reshape(panels, -1))


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
    """`nn.Linear` for inference on CPU with its weight kept as blocks of one of the kernels' kinds
    (Q8_0, Q4_0, Q4_1, Q5_1, Q6_K, Q4_K, Q6_KS: every type of GGUF_TYPES); `int8`: its input rounded to int8 per
    block of 32 (faster, lossy) instead of float32."""

    def __init__(self, q: np.ndarray, d: np.ndarray, m: np.ndarray | None, kind: str, bias: torch.Tensor | None,
                 kernel: QuantKernel, int8: bool = False):
        super().__init__()
        self._hold(panels_of_blocks(q, d, m, kind, int8), q.shape[0], q.shape[1] * 32, kind, bias, kernel, int8)

    def _hold(self, panels: torch.Tensor, out_features: int, in_features: int, kind: str,
              bias: torch.Tensor | None, kernel: QuantKernel, int8: bool, source: str | None = None):
        self.out_features, self.in_features = out_features, in_features
        self.kind, self.kernel, self.int8 = kind, kernel, int8
        self.source = source or kind  # the file's type of block (Q5_K is held as q5_1 blocks, Q6_K as q6_ks)
        self.panels = panels  # uint8 [ceil(out / 16), in / 32 * block bytes]
        self.bias = padded_bias(bias, panels.shape[0], out_features)

    @classmethod
    def from_gguf(cls, raw: np.ndarray, ggml_type: str, bias: torch.Tensor | None, kernel: QuantKernel | None,
                  int8: bool = False, order: np.ndarray | None = None) -> "QuantLinear":
        """The layer of a GGUF tensor's raw blocks (uint8 [out, row bytes], e.g. the file's memory
        map; `ggml_type` a key of GGUF_TYPES), rows in `order`: laid out by the kernel library's
        `rill_repack` (under a nanosecond a weight), or without it by numpy (`blocks_of_gguf`, then
        `panels_of_blocks`: the reference, equal byte for byte)."""
        if ggml_type not in GGUF_TYPES:
            raise ValueError(f"GGUF blocks kept as blocks: {', '.join(GGUF_TYPES)}. Given: {ggml_type!r}")
        kind = held_kind(ggml_type, int8)
        weights, size = GGUF_BLOCKS[ggml_type]
        if raw.ndim != 2 or raw.shape[1] % size:
            raise ValueError(f"{ggml_type} rows are whole blocks of {size} bytes; given raw of shape {raw.shape}")
        in_features = raw.shape[1] // size * weights
        if kernel is not None:
            panels = kernel.repack(raw, ggml_type, kind, in_features, order, int8)
        else:
            panels = panels_of_blocks(*blocks_of_gguf(raw, ggml_type, order), int8)
        layer = cls.__new__(cls)
        nn.Module.__init__(layer)
        layer._hold(panels, raw.shape[0] if order is None else len(order), in_features, kind, bias, kernel, int8,
                    ggml_type)
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        y = self.kernel(x.reshape(-1, self.in_features), self.panels, self.bias, self.out_features, self.kind,
                        self.int8)
        return y.view(*lead, self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.kind}" + \
            (f" (GGUF {self.source})" if self.source != self.kind else "") + (", int8 activations" if self.int8 else "")


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
    Only whole panels are fused (each part but the last a multiple of 16 outputs); each group's parts
    are freed as it is made (kept alive to the end, as a list of every module did, they made an 8B
    Q4_K_M's load peak at 7.0 GiB of RSS for the 4.7 it holds after)."""
    groups = 0
    # the modules that own projections (a list of every module would keep the replaced parts alive)
    owners = [module for module in model.modules() if any(hasattr(module, names[0]) for names in FUSABLE)]
    for module in owners:
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
