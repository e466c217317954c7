"""Paged attention for transformers models, through `transformers.AttentionInterface`.

Every layer of a model loaded with `attn_implementation="rill_paged"` calls `paged_attention`
with the query, key and value of all tokens of the step flattened into one row
(`[1, heads, total_tokens, head_dim]`). It writes the new keys and values into the paged
cache at their slots, then attends each sequence to its own cached tokens: all one-token
(decode) sequences together in one batched call, each longer chunk (prefill) on its own.
"""

from __future__ import annotations

import math
import mmap
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

ATTN_NAME = "rill_paged"


def kv_cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The KV cache's dtype from `EngineConfig.kv_cache_dtype`: "auto" is the model's."""
    return model_dtype if name == "auto" else getattr(torch, name)


class PagedKVCache:
    """Keys and values of every layer, `[num_blocks * block_size, kv_heads, head_dim]` each."""

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device):
        shape = (num_blocks * block_size, num_kv_heads, head_dim)
        # Pages cost RAM only once they are touched. Unwritten memory must read as zeros: it may
        # otherwise hold NaN bit patterns, and a masked NaN still poisons attention (0 * NaN).
        # On CPU the cache is anonymous memory from the OS (mmap), which reads as zeros already;
        # zeroing each block when first handed out (`zero_new_blocks`, as torch.empty on another
        # device needs) was a second pass over every fresh page: 3.7% of the engine thread at 32
        # clients, where each new prompt takes never-used blocks.
        self.block_size = block_size
        self.num_blocks = num_blocks
        zeroed = device.type == "cpu"
        self.keys = [self._tensor(shape, dtype, device, zeroed) for _ in range(num_layers)]
        self.values = [self._tensor(shape, dtype, device, zeroed) for _ in range(num_layers)]
        self._zeroed = bytearray(b"\x01" if zeroed else b"\x00") * num_blocks  # 1 once a block reads as zeros
        self.zero_new_blocks([0])  # block 0 also backs the padding of decode slot tables

    @staticmethod
    def _tensor(shape, dtype: torch.dtype, device: torch.device, zeroed: bool) -> torch.Tensor:
        if not zeroed:
            return torch.empty(shape, dtype=dtype, device=device)
        count = math.prod(shape)
        memory = mmap.mmap(-1, max(1, count * torch.finfo(dtype).bits // 8))  # the tensor keeps it alive
        return torch.frombuffer(memory, dtype=dtype, count=count).view(shape)

    def zero_new_blocks(self, block_ids) -> None:
        """Zero the blocks among `block_ids` that were never zeroed before."""
        fresh = [b for b in block_ids if not self._zeroed[b]]
        if not fresh:
            return
        for b in fresh:
            self._zeroed[b] = 1
        index = torch.tensor(fresh, dtype=torch.long, device=self.keys[0].device)
        for cache in (*self.keys, *self.values):
            cache.view(self.num_blocks, self.block_size, *cache.shape[1:]).index_fill_(0, index, 0)

    @staticmethod
    def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
                        dtype: torch.dtype) -> int:
        return 2 * num_layers * block_size * num_kv_heads * head_dim * torch.finfo(dtype).bits // 8


@dataclass(slots=True)
class PrefillChunk:
    """A chunk of `num_tokens` query tokens at positions [start, start + num_tokens)."""

    token_offset: int  # where its tokens sit in the step's flat token row
    num_tokens: int
    start: int  # position of its first query token
    slots: torch.Tensor  # [start + num_tokens] cache slots of positions 0..end
    image_blocks: tuple = ()  # [first, last] positions of images inside it whose tokens see each other both ways


@dataclass(slots=True)
class StepMetadata:
    """What the attention needs to know about one forward step (shared by all layers)."""

    cache: PagedKVCache
    slot_mapping: torch.Tensor  # [total_tokens] where each new token's K/V goes
    decode_token_index: torch.Tensor | None  # [num_decodes] their rows in the flat token row
    decode_slots: torch.Tensor | None  # [num_decodes, max_context] slots (0-padded)
    decode_context_lens: torch.Tensor | None  # [num_decodes]
    prefills: list[PrefillChunk] = field(default_factory=list)
    decode_kernel: object | None = None  # kernels.decode_attention.DecodeAttentionKernel (float32 CPU) or kernels.gpu.PagedDecodeKernel (CUDA)
    decode_block_tables: torch.Tensor | None = None  # [num_decodes, width] int32, for a kernel that reads blocks
    decode_max_context: int = 0  # the longest of decode_context_lens
    sinks_seen: bool = False  # a layer passed attention sinks (s_aux): the decode kernels cannot take them
    _masks: dict = field(default_factory=dict)  # (kind, key, window) -> bool mask, built once per step

    def decode_mask(self, sliding_window: int | None) -> torch.Tensor:
        """[num_decodes, 1, 1, max_context]: True where the key is visible."""
        key = ("decode", None, sliding_window)
        mask = self._masks.get(key)
        if mask is None:
            positions = torch.arange(self.decode_slots.shape[1], device=self.decode_slots.device)
            lens = self.decode_context_lens[:, None]
            mask = positions[None, :] < lens
            if sliding_window:
                mask &= positions[None, :] > lens - 1 - sliding_window
            mask = mask[:, None, None, :]
            self._masks[key] = mask
        return mask

    def prefill_mask(self, i: int, chunk: PrefillChunk, groups: int, sliding_window: int | None) -> torch.Tensor:
        """[groups * num_tokens, context]: causal (and windowed) visibility, repeated per query group."""
        key = ("prefill", i, sliding_window)
        mask = self._masks.get(key)
        if mask is None:
            device = chunk.slots.device
            q_pos = torch.arange(chunk.start, chunk.start + chunk.num_tokens, device=device)[:, None]
            k_pos = torch.arange(chunk.start + chunk.num_tokens, device=device)[None, :]
            mask = k_pos <= q_pos
            for first, last in chunk.image_blocks:  # Gemma 3: an image's tokens see the whole image
                mask |= (q_pos >= first) & (q_pos <= last) & (k_pos >= first) & (k_pos <= last)
            if sliding_window:
                mask &= k_pos > q_pos - sliding_window
            mask = mask.repeat(groups, 1)
            self._masks[key] = mask
        return mask


def _attend(q, k, v, mask, scaling, softcap, sinks=None):
    # q: [B, kv_heads, Lq, D]  k, v: [B, kv_heads, Lk, D]  mask: broadcastable to [B, kv_heads, Lq, Lk]
    # sinks: None, or [kv_heads, Lq, 1] one learned logit per query row that joins the softmax and is dropped
    if softcap is None and sinks is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scaling)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scaling
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is not None:  # gpt-oss: softmax over [scores, sink], the sink's share then dropped
        scores = torch.cat([scores, sinks.to(scores.dtype).expand(scores.shape[0], -1, -1, -1)], dim=-1)
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32)[..., :-1]
        return torch.matmul(probs.to(q.dtype), v)
    return torch.matmul(torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype), v)


def _sink_rows(s_aux: torch.Tensor | None, num_kv_heads: int, rows: int) -> torch.Tensor | None:
    """[heads] sink logits -> [kv_heads, groups * rows, 1] in the query layout of `_attend` (a KV head's
    query group, each head's `rows` queries in turn)."""
    if s_aux is None:
        return None
    groups = s_aux.shape[0] // num_kv_heads
    return s_aux.view(num_kv_heads, groups, 1, 1).expand(num_kv_heads, groups, rows, 1).reshape(
        num_kv_heads, groups * rows, 1)


def paged_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                    rill_step: StepMetadata | None = None, sliding_window=None, softcap=None, s_aux=None,
                    **kwargs):
    """The attention function transformers calls per layer (see module docstring).

    query: [1, heads, T, D]; key, value: [1, kv_heads, T, D]; s_aux: None or [heads] attention sinks
    (gpt-oss: the decode kernels have none, so their decodes take the torch path);
    returns ([1, T, heads, D], None).
    """
    if rill_step is None:
        raise RuntimeError("rill_paged attention needs the engine's step metadata (rill_step=...): the model's "
                           f"{type(module).__name__} was called without it")
    step = rill_step
    layer = module.layer_idx
    _, num_heads, num_tokens, head_dim = query.shape
    num_kv_heads = key.shape[1]
    groups = num_heads // num_kv_heads
    if scaling is None:
        scaling = head_dim ** -0.5
    k_cache, v_cache = step.cache.keys[layer], step.cache.values[layer]
    k_cache.index_copy_(0, step.slot_mapping, key[0].transpose(0, 1).to(k_cache.dtype))
    v_cache.index_copy_(0, step.slot_mapping, value[0].transpose(0, 1).to(v_cache.dtype))

    out = query.new_empty(num_tokens, num_heads, head_dim)
    kernel = step.decode_kernel if s_aux is None else None
    if s_aux is not None:
        step.sinks_seen = True
    if step.decode_block_tables is not None and kernel is not None:  # the GPU kernel: the paged cache read in place
        kernel(query, out, k_cache, v_cache, step.decode_token_index, step.decode_block_tables,
               step.cache.block_size, step.decode_context_lens, scaling, sliding_window, softcap,
               step.decode_max_context)
    elif step.decode_token_index is not None and kernel is not None and query.dtype == k_cache.dtype == torch.float32 \
            and query.stride(-1) == 1:
        kernel(query, out, k_cache, v_cache, step.decode_token_index, step.decode_slots,
               step.decode_context_lens, scaling, sliding_window, softcap)
    elif step.decode_token_index is not None:
        num_dec = step.decode_token_index.shape[0]
        # q: [num_dec, kv_heads, groups, D]: the query group of a KV head acts as its query length
        # (index_select, not advanced indexing: the latter costs milliseconds per call on CPU)
        q = query[0].index_select(1, step.decode_token_index).transpose(0, 1)
        q = q.reshape(num_dec, num_kv_heads, groups, head_dim)
        ctx = step.decode_slots.shape[1]
        flat_slots = step.decode_slots.view(-1)
        # (a 16-bit cache beside a float32 model: its keys and values read back in the query's dtype)
        k = k_cache.index_select(0, flat_slots).to(query.dtype).view(num_dec, ctx, num_kv_heads, head_dim).transpose(1, 2)
        v = v_cache.index_select(0, flat_slots).to(query.dtype).view(num_dec, ctx, num_kv_heads, head_dim).transpose(1, 2)
        o = _attend(q, k, v, step.decode_mask(sliding_window), scaling, softcap,
                    _sink_rows(s_aux, num_kv_heads, 1))  # [num_dec, kv_heads, groups, D]
        out.index_copy_(0, step.decode_token_index, o.reshape(num_dec, num_heads, head_dim))
    for i, chunk in enumerate(step.prefills):
        n, s = chunk.num_tokens, chunk.token_offset
        # q: [1, kv_heads, groups * n, D]
        q = query[:, :, s:s + n].reshape(1, num_kv_heads, groups * n, head_dim)
        k = k_cache.index_select(0, chunk.slots).to(query.dtype).transpose(0, 1)[None]  # [1, kv_heads, ctx, D]
        v = v_cache.index_select(0, chunk.slots).to(query.dtype).transpose(0, 1)[None]
        o = _attend(q, k, v, step.prefill_mask(i, chunk, groups, sliding_window), scaling, softcap,
                    _sink_rows(s_aux, num_kv_heads, n))
        out[s:s + n] = o.reshape(num_heads, n, head_dim).transpose(0, 1)
    return out[None], None


AttentionInterface.register(ATTN_NAME, paged_attention)
