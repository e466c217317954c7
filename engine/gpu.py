"""Decode attention on a GPU, read from the paged KV cache in place (a Triton kernel).

The torch path gathers every decode's keys and values into one tensor padded to the longest
context of the step, so its memory grows with batch x context. Here one program per (decode
sequence, KV head) walks that sequence's own block table and reads its keys and values where they
lie, with an online softmax in float32: no gather, no padding, nothing allocated but the output.
The query heads that share a KV head (GQA) are computed together, so each key is read once.

Exact float32 arithmetic (no TF32: products are summed on the CUDA cores, not `tl.dot`), so a
float32 model keeps greedy parity with `generate` up to summation order. bfloat16 and float16
caches are read as stored and accumulated in float32. Sliding windows and Gemma-2's logit soft
cap are handled in the kernel. Without Triton (`import triton` fails) the engine keeps the torch path.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # no Triton: the torch path
    triton = None


if triton is not None:
    @triton.jit
    def _paged_decode(q_ptr, q_tok, q_head, out_ptr, o_tok, o_head, k_ptr, v_ptr, c_slot, c_head,
                      index_ptr, tables_ptr, t_row, lens_ptr, scaling, softcap, window,
                      BLOCK: tl.constexpr, GROUPS: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr,
                      D_PAD: tl.constexpr, BLOCK_N: tl.constexpr, SOFTCAP: tl.constexpr, WINDOW: tl.constexpr):
        row = tl.program_id(0)  # the decode sequence
        kvh = tl.program_id(1)  # its KV head; query heads kvh * GROUPS .. + GROUPS - 1
        tok = tl.load(index_ptr + row).to(tl.int64)  # its token's row in the step's flat query
        length = tl.load(lens_ptr + row)
        g = tl.arange(0, G_PAD)
        d = tl.arange(0, D_PAD)
        heads = kvh * GROUPS + g
        qmask = (g < GROUPS)[:, None] & (d < D)[None, :]
        q = tl.load(q_ptr + tok * q_tok + heads[:, None] * q_head + d[None, :], mask=qmask, other=0.0)
        q = q.to(tl.float32) * scaling
        m = tl.full([G_PAD], float("-inf"), tl.float32)
        total = tl.zeros([G_PAD], tl.float32)
        acc = tl.zeros([G_PAD, D_PAD], tl.float32)
        start = 0
        if WINDOW:  # visible: the last `window` positions
            start = tl.maximum(length - window, 0)
        for s in range(start, length, BLOCK_N):
            pos = s + tl.arange(0, BLOCK_N)
            pmask = pos < length
            block = tl.load(tables_ptr + row * t_row + pos // BLOCK, mask=pmask, other=0).to(tl.int64)
            offs = (block * BLOCK + pos % BLOCK)[:, None] * c_slot + kvh * c_head + d[None, :]
            kvmask = pmask[:, None] & (d < D)[None, :]
            k = tl.load(k_ptr + offs, mask=kvmask, other=0.0).to(tl.float32)  # [BLOCK_N, D_PAD]
            scores = tl.sum(q[:, None, :] * k[None, :, :], axis=2)  # [G_PAD, BLOCK_N]
            if SOFTCAP:  # softcap * tanh(scores / softcap), tanh(x) = 1 - 2 / (exp(2x) + 1)
                scores = softcap * (1.0 - 2.0 / (tl.exp(2.0 * scores / softcap) + 1.0))
            scores = tl.where(pmask[None, :], scores, float("-inf"))
            m_new = tl.maximum(m, tl.max(scores, axis=1))
            alpha = tl.exp(m - m_new)
            p = tl.exp(scores - m_new[:, None])
            total = total * alpha + tl.sum(p, axis=1)
            v = tl.load(v_ptr + offs, mask=kvmask, other=0.0).to(tl.float32)
            acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
            m = m_new
        acc = acc / total[:, None]
        tl.store(out_ptr + tok * o_tok + heads[:, None] * o_head + d[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=qmask)


class PagedDecodeKernel:
    """Decode attention for every one-token sequence of a step, on the paged cache in place.

    Takes block tables (`reads = "blocks"`), not per-position slot tables: the runner then builds
    nothing per context position either."""

    reads = "blocks"
    path = "triton (paged, in place)"
    dtypes = (torch.float32, torch.bfloat16, torch.float16)

    def __init__(self, block_n: int = 32):
        self.block_n = block_n
        self.calls = 0  # steps whose decodes it ran (the tests check that it did)

    def __call__(self, query, out, k_cache, v_cache, token_index, block_tables, block_size, context_lens,
                 scaling, sliding_window, softcap):
        """query: [1, heads, T, D] (any strides but the last); out: [T, heads, D]; caches: [slots,
        kv_heads, D]; token_index, context_lens: [decodes]; block_tables: [decodes, width]."""
        _, heads, _, dim = query.shape
        kv_heads = k_cache.shape[1]
        groups = heads // kv_heads
        rows = token_index.shape[0]
        q = query[0] if query.stride(-1) == 1 else query[0].contiguous()  # [heads, T, D]
        _paged_decode[(rows, kv_heads)](
            q, q.stride(1), q.stride(0), out, out.stride(0), out.stride(1), k_cache, v_cache,
            k_cache.stride(0), k_cache.stride(1), token_index, block_tables, block_tables.stride(0), context_lens,
            float(scaling), float(softcap or 0.0), int(sliding_window or 0),
            BLOCK=block_size, GROUPS=groups, G_PAD=triton.next_power_of_2(groups), D=dim,
            D_PAD=triton.next_power_of_2(dim), BLOCK_N=self.block_n, SOFTCAP=bool(softcap),
            WINDOW=bool(sliding_window))
        self.calls += 1


def paged_decode_kernel(device: torch.device) -> PagedDecodeKernel | None:
    """The kernel for a CUDA device when Triton is installed, else None (the torch path)."""
    if triton is None or device.type != "cuda":
        return None
    return PagedDecodeKernel()
