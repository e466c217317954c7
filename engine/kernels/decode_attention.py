"""`rill_decode_attention` (csrc/decode_attention.c): decode attention read straight from the paged cache.

The torch path of `engine.attention.paged_attention` gathers every sequence's context with
`index_select` and runs SDPA with a mask, which reads the keys twice and builds tensors per layer:
15% of a 32-sequence step here against 2% for this kernel.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from engine.kernels.build import checked_kernel


class DecodeAttentionKernel:
    """`rill_decode_attention` from the compiled library, called with tensors (float32, CPU)."""

    reads = "slots"  # a slot per context position (kernels.gpu.PagedDecodeKernel reads block tables)

    def __init__(self, library: ctypes.CDLL, path: Path):
        self.path = path
        self._fn = library.rill_decode_attention
        i64, ptr, i32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
        self._fn.argtypes = [ptr, i64, i64, ptr, ptr, ptr, ptr, i64, ptr, ptr,
                             i32, i32, i32, i32, ctypes.c_float, i64, ctypes.c_float, i32]
        self._fn.restype = None
        self.threads = torch.get_num_threads()

    def __call__(self, query: torch.Tensor, out: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 index: torch.Tensor, slots: torch.Tensor, lens: torch.Tensor, scale: float,
                 window: int | None, softcap: float | None) -> None:
        """query: [1, heads, T, D] (any strides, D contiguous); out: [T, heads, D]; k/v_cache:
        [slots, kv_heads, D]; index, lens: [B] int64; slots: [B, max_ctx] int64. Fills out[index]."""
        _, heads, _, head_dim = query.shape
        self._fn(query.data_ptr(), query.stride(2), query.stride(1), index.data_ptr(),
                 k_cache.data_ptr(), v_cache.data_ptr(), slots.data_ptr(), slots.shape[1], lens.data_ptr(),
                 out.data_ptr(), index.shape[0], heads, k_cache.shape[1], head_dim, scale,
                 window or 0, softcap or 0.0, self.threads)


def _kernel_agrees(kernel: DecodeAttentionKernel) -> bool:
    """The kernel against the torch path of `paged_attention` on one small step: ragged
    contexts, grouped queries, a head size that is no multiple of 16, a window, a softcap."""
    from engine.attention import PagedKVCache, StepMetadata, paged_attention

    class Layer:
        layer_idx = 0

    gen = torch.Generator().manual_seed(0)
    heads, kv_heads, dim, block = 4, 2, 24, 4
    cache = PagedKVCache(1, 32, block, kv_heads, dim, torch.float32, torch.device("cpu"))
    cache.keys[0].copy_(torch.randn(cache.keys[0].shape, generator=gen))
    cache.values[0].copy_(torch.randn(cache.values[0].shape, generator=gen))
    lens = torch.tensor([1, 37, 20])
    slots = torch.randperm(32 * block, generator=gen)[:3 * 37].view(3, 37)  # scattered, like a busy cache
    q, k, v = (torch.randn(1, 3, n, dim, generator=gen).transpose(1, 2) for n in (heads, kv_heads, kv_heads))
    last = slots[torch.arange(3), lens - 1]
    for window, softcap in ((None, None), (8, None), (None, 5.0)):
        outs = []
        for use in (kernel, None):
            step = StepMetadata(cache=cache, slot_mapping=last, decode_token_index=torch.arange(3),
                                decode_slots=slots, decode_context_lens=lens, decode_kernel=use)
            outs.append(paged_attention(Layer(), q, k, v, None, scaling=0.3, rill_step=step,
                                        sliding_window=window, softcap=softcap)[0])
        if not torch.allclose(outs[0], outs[1], atol=1e-5, rtol=1e-4):
            return False
    return True


def decode_attention_kernel(cache_dir: Path) -> DecodeAttentionKernel | None:
    """The compiled decode kernel, or None (with the reason logged) when it cannot be used here."""
    return checked_kernel(DecodeAttentionKernel, _kernel_agrees, cache_dir, "decode attention", "the torch path",
                          "the torch path")
