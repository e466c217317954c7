"""Decode attention on a GPU, read from the paged KV cache in place (a Triton kernel).

The torch path gathers every decode's keys and values into one tensor padded to the longest
context of the step, so its memory grows with batch x context. Here one program per (decode
sequence, KV head) walks that sequence's own block table and reads its keys and values where they
lie, with an online softmax in float32: no gather, no padding (split shares, below, allocate
their softmax states: a few floats per head and share).
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
                      index_ptr, tables_ptr, t_row, lens_ptr, scaling, softcap, window, part_m, part_l, part_acc,
                      BLOCK: tl.constexpr, GROUPS: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr,
                      D_PAD: tl.constexpr, BLOCK_N: tl.constexpr, SOFTCAP: tl.constexpr, WINDOW: tl.constexpr,
                      SPLITS: tl.constexpr):
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
        end = length
        if SPLITS > 1:  # this program's share of the visible positions, whole tiles of BLOCK_N
            chunk = tl.cdiv(tl.cdiv(length - start, SPLITS), BLOCK_N) * BLOCK_N
            start = start + tl.program_id(2) * chunk
            end = tl.minimum(start + chunk, length)
        for s in range(start, end, BLOCK_N):
            pos = s + tl.arange(0, BLOCK_N)
            pmask = pos < end
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
        if SPLITS > 1:  # the share's softmax state, merged by _merge_splits (an empty share: -inf, 0, 0)
            part = (row * tl.num_programs(1) * GROUPS + heads) * SPLITS + tl.program_id(2)
            tl.store(part_m + part, m, mask=g < GROUPS)
            tl.store(part_l + part, total, mask=g < GROUPS)
            tl.store(part_acc + part[:, None] * D_PAD + d[None, :], acc, mask=qmask)
        else:
            acc = acc / total[:, None]
            tl.store(out_ptr + tok * o_tok + heads[:, None] * o_head + d[None, :],
                     acc.to(out_ptr.dtype.element_ty), mask=qmask)

    @triton.jit
    def _merge_splits(part_m, part_l, part_acc, out_ptr, o_tok, o_head, index_ptr,
                      SPLITS: tl.constexpr, S_PAD: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr):
        row = tl.program_id(0)
        head = tl.program_id(1)
        tok = tl.load(index_ptr + row).to(tl.int64)
        s = tl.arange(0, S_PAD)
        d = tl.arange(0, D_PAD)
        part = (row * tl.num_programs(1) + head) * SPLITS + s
        m = tl.load(part_m + part, mask=s < SPLITS, other=float("-inf"))
        weight = tl.exp(m - tl.max(m, axis=0))  # at least one share saw a position: the max is finite
        total = tl.sum(weight * tl.load(part_l + part, mask=s < SPLITS, other=0.0), axis=0)
        acc = tl.load(part_acc + part[:, None] * D_PAD + d[None, :], mask=(s < SPLITS)[:, None], other=0.0)
        acc = tl.sum(weight[:, None] * acc, axis=0) / total
        tl.store(out_ptr + tok * o_tok + head * o_head + d, acc.to(out_ptr.dtype.element_ty), mask=d < D)


class PagedDecodeKernel:
    """Decode attention for every one-token sequence of a step, on the paged cache in place.

    Takes block tables (`reads = "blocks"`), not per-position slot tables: the runner then builds
    nothing per context position either. When a step has too few (sequence, KV head) pairs to fill
    the GPU (one chat's long context: 3 programs for SmolLM2), each pair's positions are split
    into shares run side by side, whose softmax states a second kernel merges (flash-decoding)."""

    reads = "blocks"
    path = "triton (paged, in place)"
    MIN_SHARE = 256  # positions: a share below this costs more to merge than it saves

    def __init__(self, device: torch.device, block_n: int = 32):
        self.block_n = block_n
        # programs to aim for: two per multiprocessor (8 off CUDA: Triton's interpreter, in a test)
        self.target = 2 * torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 8
        self.splits: int | None = None  # fixed shares (tests), else chosen per step
        self.calls = 0  # steps whose decodes it ran (the tests check that it did)

    def num_splits(self, pairs: int, max_context: int, window: int | None) -> int:
        if self.splits is not None:
            return self.splits
        visible = min(max_context, window) if window else max_context
        if pairs >= self.target:
            return 1
        return max(1, min(-(-self.target // pairs), visible // self.MIN_SHARE, 64))

    def __call__(self, query, out, k_cache, v_cache, token_index, block_tables, block_size, context_lens,
                 scaling, sliding_window, softcap, max_context: int):
        """query: [1, heads, T, D] (any strides but the last); out: [T, heads, D]; caches: [slots,
        kv_heads, D]; token_index, context_lens: [decodes]; block_tables: [decodes, width];
        max_context: the longest of context_lens."""
        _, heads, _, dim = query.shape
        kv_heads = k_cache.shape[1]
        groups = heads // kv_heads
        rows = token_index.shape[0]
        d_pad = triton.next_power_of_2(dim)
        splits = self.num_splits(rows * kv_heads, max_context, sliding_window)
        q = query[0] if query.stride(-1) == 1 else query[0].contiguous()  # [heads, T, D]
        part_m = part_l = part_acc = out  # unused unless split
        if splits > 1:
            part_m = torch.empty(rows * heads * splits, dtype=torch.float32, device=out.device)
            part_l = torch.empty_like(part_m)
            part_acc = torch.empty(rows * heads * splits * d_pad, dtype=torch.float32, device=out.device)
        _paged_decode[(rows, kv_heads, splits)](
            q, q.stride(1), q.stride(0), out, out.stride(0), out.stride(1), k_cache, v_cache,
            k_cache.stride(0), k_cache.stride(1), token_index, block_tables, block_tables.stride(0), context_lens,
            float(scaling), float(softcap or 0.0), int(sliding_window or 0), part_m, part_l, part_acc,
            BLOCK=block_size, GROUPS=groups, G_PAD=triton.next_power_of_2(groups), D=dim,
            D_PAD=d_pad, BLOCK_N=self.block_n, SOFTCAP=bool(softcap), WINDOW=bool(sliding_window), SPLITS=splits)
        if splits > 1:
            _merge_splits[(rows, heads)](part_m, part_l, part_acc, out, out.stride(0), out.stride(1), token_index,
                                         SPLITS=splits, S_PAD=triton.next_power_of_2(splits), D=dim, D_PAD=d_pad)
        self.calls += 1


def paged_decode_kernel(device: torch.device) -> PagedDecodeKernel | None:
    """The kernel for a CUDA device when Triton is installed, else None (the torch path)."""
    if triton is None or device.type != "cuda":
        return None
    return PagedDecodeKernel(device)
