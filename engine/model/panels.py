"""The kernels' panels: q, d, m blocks (engine/model/gguf_blocks.py) rearranged once into panels of
16 outputs, in csrc/qlinear.c's layout or csrc/qlinear_i8.c's (the numpy reference of the C
`rill_repack`, byte for byte the same), and Q8_0 panels read back into blocks."""

from __future__ import annotations

import numpy as np
import torch

from engine.kernels.qlinear import SUPER_KINDS
from engine.model.gguf_blocks import super_products


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
