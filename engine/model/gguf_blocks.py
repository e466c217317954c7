"""GGUF's quantized blocks read in numpy: each type of GGUF_TYPES (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1,
Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS) into q, d, m blocks of 32 weights of one of the kernels'
seven kinds (engine/kernels/qlinear.py's KINDS; csrc/blocks.h), whose de-quantized weights are
gguf-py's (and so transformers') bit for bit. engine/model/panels.py lays them out for the kernels.
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from engine.kernels.qlinear import SUPER_KINDS

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
