"""The K-quant blocks of ggml (Q4_K, Q5_K, Q6_K) written from float weights, in llama.cpp's byte
layout (a file's blocks and these read alike), by min/max or absmax rounding without llama.cpp's
search for the best scales: `--quantize q4_k|q6_k` quantizes at load with them, and
bench/gguf_file.py writes its GGUFs with them.
"""

from __future__ import annotations

import numpy as np


def _halves(*values: np.ndarray) -> np.ndarray:
    """float16 fields side by side as bytes: each value [..] -> [.., 2 * len(values)] uint8."""
    return np.stack(values, axis=-1).astype(np.float16).view(np.uint8).reshape(*values[0].shape, 2 * len(values))


def _safe(x: np.ndarray) -> np.ndarray:
    return np.where(x == 0, 1, x)


def _min_max_sub_blocks(weight: np.ndarray, levels: int):
    """The K-quant asymmetric scheme (Q4_K, Q5_K): 8 sub-blocks of 32 per super-block, each
    w ~ d * sc * q - dmin * m with 6-bit sc and m and q in [0, levels]. Min/max rounding.
    weight [rows, cols] -> d, dmin [rows, supers]; sc, m [rows, supers, 8]; q [rows, supers, 8, 32]."""
    rows = weight.shape[0]
    w = weight.astype(np.float64).reshape(rows, -1, 8, 32)
    low, high = np.minimum(w.min(-1), 0), np.maximum(w.max(-1), 0)
    scale, minimum = (high - low) / levels, -low
    d = (scale.max(-1) / 63).astype(np.float16).astype(np.float64)
    dmin = (minimum.max(-1) / 63).astype(np.float16).astype(np.float64)
    sc = np.clip(np.round(scale / _safe(d)[..., None]), 0, 63).astype(np.uint8)
    m = np.clip(np.round(minimum / _safe(dmin)[..., None]), 0, 63).astype(np.uint8)
    step = (d[..., None] * sc)[..., None]
    q = np.clip(np.round((w + (dmin[..., None] * m)[..., None]) / _safe(step)), 0, levels).astype(np.uint8)
    return d, dmin, sc, m, q


def _pack_k_scales(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    """Eight 6-bit scales and mins in ggml's 12 bytes: [.., 8] twice -> [.., 12] uint8."""
    packed = np.empty((*sc.shape[:-1], 12), np.uint8)
    packed[..., 0:4] = (sc[..., :4] & 63) | ((sc[..., 4:] >> 4) << 6)
    packed[..., 4:8] = (m[..., :4] & 63) | ((m[..., 4:] >> 4) << 6)
    packed[..., 8:12] = (sc[..., 4:] & 15) | ((m[..., 4:] & 15) << 4)
    return packed


def _low_nibbles(q: np.ndarray) -> np.ndarray:
    """q [rows, supers, 8, 32] -> [rows, supers, 128]: sub-block 2j in the low nibbles of bytes
    32j..32j+31, sub-block 2j + 1 in their high nibbles."""
    return ((q[:, :, 0::2] & 15) | ((q[:, :, 1::2] & 15) << 4)).reshape(*q.shape[:2], 128)


def encode_q4_k(weight: np.ndarray) -> np.ndarray:
    """Q4_K: weight [rows, cols] (cols a multiple of 256) -> blocks [rows, cols / 256 * 144] uint8
    (d, dmin, 12 bytes of scales and mins, 128 bytes of 4-bit values)."""
    d, dmin, sc, m, q = _min_max_sub_blocks(weight, 15)
    blocks = np.concatenate([_halves(d, dmin), _pack_k_scales(sc, m), _low_nibbles(q)], axis=-1)
    return blocks.reshape(weight.shape[0], -1)


def encode_q5_k(weight: np.ndarray) -> np.ndarray:
    """Q5_K: weight [rows, cols] (cols a multiple of 256) -> blocks [rows, cols / 256 * 176] uint8
    (d, dmin, 12 bytes of scales and mins, 32 bytes of fifth bits, 128 bytes of low 4 bits)."""
    d, dmin, sc, m, q = _min_max_sub_blocks(weight, 31)
    high = ((q >> 4) & 1) << np.arange(8, dtype=np.uint8)[:, None]  # bit i of byte l: value l of sub-block i
    qh = np.bitwise_or.reduce(high, axis=2)  # [rows, supers, 32]
    blocks = np.concatenate([_halves(d, dmin), _pack_k_scales(sc, m), qh, _low_nibbles(q)], axis=-1)
    return blocks.reshape(weight.shape[0], -1)


def encode_q6_k(weight: np.ndarray) -> np.ndarray:
    """Q6_K: weight [rows, cols] (cols a multiple of 256) -> blocks [rows, cols / 256 * 210] uint8
    (128 bytes of low 4 bits, 64 bytes of high 2 bits, 16 int8 scales of 16 values each, d).
    Symmetric absmax rounding: w ~ d * sc * (q - 32), q in [0, 63]."""
    rows = weight.shape[0]
    w = weight.astype(np.float64).reshape(rows, -1, 16, 16)  # [rows, supers, group, 16]
    scale = np.abs(w).max(-1) / 31
    d = (scale.max(-1) / 127).astype(np.float16).astype(np.float64)
    sc = np.clip(np.round(scale / _safe(d)[..., None]), 0, 127).astype(np.int8)
    step = (d[..., None] * sc)[..., None]
    q = (np.clip(np.round(w / _safe(step)), -32, 31) + 32).astype(np.uint8).reshape(rows, -1, 2, 128)
    # value e of a super-block: half e // 128; its low 4 bits in nibble (e % 128) // 64 of byte
    # 64 * half + e % 64, its high 2 bits at bit 2 * ((e % 128) // 32) of byte 32 * half + e % 32
    low = q.reshape(rows, -1, 2, 2, 64)
    ql = ((low[:, :, :, 0] & 15) | ((low[:, :, :, 1] & 15) << 4)).reshape(rows, -1, 128)
    high = (q.reshape(rows, -1, 2, 4, 32) >> 4) << (2 * np.arange(4, dtype=np.uint8))[:, None]
    qh = np.bitwise_or.reduce(high, axis=3).reshape(rows, -1, 64)
    blocks = np.concatenate([ql, qh, sc.view(np.uint8), _halves(d)], axis=-1)
    return blocks.reshape(rows, -1)
