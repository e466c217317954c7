"""A batch plan -> tensors -> one model forward -> the logits of the sequences that sample.

`PagedRunner` is the fast path: all scheduled tokens in one flat row, attention through
`attention.paged_attention` on the paged cache. `FallbackRunner` serves models whose layers do
not call transformers' attention interface (Bloom, Falcon, remote code): one forward per
sequence with its own `DynamicCache`, correct but unbatched.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from engine.attention import ATTN_NAME, PagedKVCache, PrefillChunk, StepMetadata
from engine.sampler import argmax_is_enough
from engine.scheduler import ScheduledChunk

log = logging.getLogger("rill.engine")



class RequestFault(RuntimeError):
    """Raised by the test hook inside a forward; names the one sequence that must fail."""

    def __init__(self, seq_id: str):
        super().__init__(f"injected fault in the forward of {seq_id}")
        self.seq_id = seq_id


def _raise_injected_faults(plan: list[ScheduledChunk]) -> None:
    for chunk in plan:
        if chunk.seq.fault:
            raise RequestFault(chunk.seq.seq_id)


def kv_geometry(config) -> tuple[int, int, int]:
    """(num_layers, num_kv_heads, head_dim) of a transformers config."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    num_layers = text.num_hidden_layers
    num_heads = text.num_attention_heads
    num_kv_heads = getattr(text, "num_key_value_heads", None) or num_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // num_heads
    return num_layers, num_kv_heads, head_dim


def supports_paged_attention(model) -> bool:
    """Switch the model to the paged attention and check, with a 3-token probe, that every layer calls it."""
    try:
        model.set_attn_implementation(ATTN_NAME)
    except Exception as exc:  # the model refuses custom attention
        log.info("attention interface refused (%s)", exc)
        return False
    num_layers = kv_geometry(model.config)[0]
    seen: set[int] = set()

    def probe(module, query, key, value, attention_mask, **kwargs):
        seen.add(module.layer_idx)
        from transformers.integrations.sdpa_attention import sdpa_attention_forward
        return sdpa_attention_forward(module, query, key, value, None, is_causal=True, **{
            k: v for k, v in kwargs.items() if k in ("scaling", "dropout")})

    from transformers import AttentionInterface
    AttentionInterface.register("rill_probe", probe)
    try:
        model.set_attn_implementation("rill_probe")
        with torch.inference_mode():
            model(input_ids=torch.tensor([[1, 2, 3]], device=model.device),
                  position_ids=torch.arange(3, device=model.device)[None], use_cache=False)
    except Exception as exc:
        log.info("attention probe failed (%s)", exc)
        seen.clear()
    finally:
        try:
            model.set_attn_implementation(ATTN_NAME if len(seen) == num_layers else "eager")
        except Exception:
            pass
    return len(seen) == num_layers


class PagedRunner:
    """Runs a plan on the paged KV cache in one forward."""

    path = "paged"

    def __init__(self, model, num_blocks: int, block_size: int, decode_kernel=None, native=None,
                 native_prefill_tokens: int = 128):
        self.model = model
        self.decode_kernel = decode_kernel  # cpu.DecodeAttentionKernel, gpu.PagedDecodeKernel or None (torch path)
        self.kernel_reads_blocks = getattr(decode_kernel, "reads", None) == "blocks"
        self.native = native  # native.NativeDecoder for decode steps and short prefills, or None (modules)
        # Steps whose prompt chunks attend to no more positions in all than one prompt of this many
        # tokens would (sum of tokens x their chunk's end) run natively too, each prompt token
        # attending as a decode would: a wave of short prompts (32 of 20 tokens: 1.58 against 1.87 s
        # through the modules, engine alone). Longer chunks, or short ones after a long context,
        # keep the modules, whose attention (torch's SDPA) reads a context once per chunk, not once
        # per token, and whose Python costs little beside that much work.
        self.native_prefill_tokens = native_prefill_tokens
        self.device = model.device
        num_layers, num_kv_heads, head_dim = kv_geometry(model.config)
        self.cache = PagedKVCache(num_layers, num_blocks, block_size, num_kv_heads, head_dim,
                                  model.dtype, self.device)
        self.block_size = block_size
        # tokens of prompt chunks (of 2 or more tokens): all, and those run by the native layers
        self.prompt_tokens = self.native_prompt_tokens = 0

    @torch.inference_mode()
    def run(self, plan: list[ScheduledChunk]) -> torch.Tensor:
        """Returns float32 logits [num_sampling_chunks, vocab], in plan order."""
        _raise_injected_faults(plan)
        if self.native is not None and all(c.num_tokens == 1 for c in plan):
            return self._native_decodes(plan)
        bs, dev = self.block_size, self.device
        input_ids: list[int] = []
        positions: list[int] = []
        token_rows: list[int] = []  # which plan row each token belongs to
        dec_index: list[int] = []  # flat token index of each one-token chunk
        dec_rows: list[int] = []
        dec_lens: list[int] = []
        prefills: list[tuple[int, int, int, int]] = []  # (token offset, tokens, start, row)
        sample_rows: list[int] = []
        for row, chunk in enumerate(plan):
            seq, start, n = chunk.seq, chunk.start, chunk.num_tokens
            offset = len(input_ids)
            input_ids.extend(seq.token_ids[start:start + n])
            positions.extend(range(start, start + n))
            token_rows.extend([row] * n)
            if n == 1:
                dec_index.append(offset)
                dec_rows.append(row)
                dec_lens.append(start + 1)
            else:
                prefills.append((offset, n, start, row))
            if chunk.samples:
                sample_rows.append(offset + n - 1)
        self.cache.zero_new_blocks([b for c in plan
                                    for b in c.seq.block_table[c.start // bs:(c.start + c.num_tokens - 1) // bs + 1]])
        width = max(len(c.seq.block_table) for c in plan)
        # block_tables: [rows, width]; slot of position p of row r = table[r, p // bs] * bs + p % bs
        # flat_tables[r * width + i]: block i of row r. (index_select throughout: advanced
        # indexing costs milliseconds per call on CPU.)
        flat_tables = torch.tensor([b for c in plan for b in c.seq.block_table + [0] * (width - len(c.seq.block_table))],
                                   dtype=torch.long)
        pos = torch.tensor(positions, dtype=torch.long)

        def slots(rows: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
            return flat_tables.index_select(0, rows * width + positions // bs) * bs + positions % bs

        slot_mapping = slots(torch.tensor(token_rows), pos)
        decode_slots = decode_lens = decode_index = decode_tables = None
        if dec_index:
            if self.kernel_reads_blocks:  # [num_decodes, width]: no slot per context position
                decode_tables = flat_tables.view(len(plan), width).index_select(0, torch.tensor(dec_rows))
                decode_tables = decode_tables.to(dev, torch.int32)
            else:
                ctx_len = max(dec_lens)
                ctx = torch.arange(ctx_len).repeat(len(dec_rows))
                rows = torch.tensor(dec_rows).repeat_interleave(ctx_len)
                decode_slots = slots(rows, ctx).view(len(dec_rows), ctx_len).to(dev)  # [num_decodes, max_context]
            decode_lens = torch.tensor(dec_lens, device=dev)
            decode_index = torch.tensor(dec_index, device=dev)
        prompt_tokens = len(input_ids) - len(dec_index)
        self.prompt_tokens += prompt_tokens
        attended = sum(n * (start + n) for _, n, start, _ in prefills)  # positions the prompt tokens read
        if self.native is not None and attended <= self.native_prefill_tokens ** 2:
            if prefills:  # every token attends as a decode would: its own row of slots, its position + 1
                lens = pos + 1
                context = int(lens.max())
                rows = torch.tensor(token_rows).repeat_interleave(context)
                token_slots = slots(rows, torch.arange(context).repeat(len(input_ids))).view(len(input_ids), context)
            else:
                token_slots, lens = decode_slots, decode_lens
            keep = None if len(sample_rows) == len(input_ids) else torch.tensor(sample_rows, dtype=torch.long)
            self.native_prompt_tokens += prompt_tokens
            return self.native.run(torch.tensor(input_ids), pos, self.cache, slot_mapping, token_slots, lens, keep,
                                   argmax_only=_argmax_only(plan))
        chunks = []
        for offset, n, start, row in prefills:
            ctx = torch.arange(start + n)
            chunks.append(PrefillChunk(offset, n, start, slots(torch.full_like(ctx, row), ctx).to(dev)))
        step = StepMetadata(
            cache=self.cache,
            slot_mapping=slot_mapping.to(dev),
            decode_token_index=decode_index,
            decode_slots=decode_slots,
            decode_context_lens=decode_lens,
            prefills=chunks,
            decode_kernel=self.decode_kernel,
            decode_block_tables=decode_tables,
            decode_max_context=max(dec_lens, default=0),
        )
        out = self.model(
            input_ids=torch.tensor([input_ids], device=dev),  # [1, total_tokens]
            position_ids=pos.to(dev)[None],  # [1, total_tokens]
            use_cache=False,
            # 0 keeps every row: the usual all-decode step needs no gather of hidden states
            logits_to_keep=0 if len(sample_rows) == len(input_ids) else torch.tensor(sample_rows, dtype=torch.long, device=dev),
            rill_step=step,
        )
        logits = out.logits[0].float()  # [num_sampling_chunks, vocab]
        if dev.type != "cpu" and _argmax_only(plan):
            # each row's argmax found where the logits are (-1: a row not finite): the sampler then
            # copies no logits to the host (256 rows of SmolLM2's are 50 MB a step)
            best = torch.where(torch.isfinite(logits).all(dim=1), logits.argmax(dim=1), -1)
            logits.rill_argmax = best.cpu()
        return logits

    def _native_decodes(self, plan: list[ScheduledChunk]) -> torch.Tensor:
        """`run` for a step of decodes only on the native step, its slots computed with numpy: the
        same arguments, without the dozen small torch operations a step of one sequence paid for
        in Python (each slowed by the step's reads having just emptied the caches)."""
        bs, rows = self.block_size, len(plan)
        lens = np.fromiter((c.start + 1 for c in plan), np.int64, rows)  # each row's context, its own token included
        context = int(lens.max())
        width = -(-context // bs)  # blocks of the longest context
        tables = np.zeros((rows, width), np.int64)  # a shorter row's missing blocks: block 0, never read
        for r, c in enumerate(plan):
            table = c.seq.block_table[:width]
            tables[r, :len(table)] = table
        self.cache.zero_new_blocks([c.seq.block_table[c.start // bs] for c in plan])
        j = np.arange(context)
        token_slots = tables[:, j // bs] * bs + j % bs  # [rows, context]: the slot of each position
        positions = lens - 1
        slot_mapping = token_slots[np.arange(rows), positions]
        sample_rows = [r for r, c in enumerate(plan) if c.samples]
        keep = None if len(sample_rows) == rows else torch.tensor(sample_rows, dtype=torch.long)
        input_ids = torch.tensor([c.seq.token_ids[c.start] for c in plan])
        return self.native.run(input_ids, torch.from_numpy(positions), self.cache, torch.from_numpy(slot_mapping),
                               torch.from_numpy(token_slots), torch.from_numpy(lens), keep, argmax_only=_argmax_only(plan))

    def free(self, seq_id: str) -> None:  # the paged cache needs nothing beyond the allocator
        pass


def _argmax_only(plan: list[ScheduledChunk]) -> bool:
    """Every sampling row of the step wants its argmax alone (engine/sampler.py)."""
    return all(argmax_is_enough(c.seq) for c in plan if c.samples)


def _truncate(cache, length: int) -> None:
    """Cut every layer of a `DynamicCache` back to `length` tokens (a failed forward may have
    appended to some layers only)."""
    for layer in cache.layers:
        extra = layer.get_seq_length() - length
        if extra > 0:
            layer.crop(-extra)


class FallbackRunner:
    """One forward per sequence with a `DynamicCache` kept per sequence (models without the interface)."""

    path = "fallback"

    def __init__(self, model):
        self.model = model
        self.caches: dict[str, object] = {}

    @torch.inference_mode()
    def run(self, plan: list[ScheduledChunk]) -> torch.Tensor:
        from transformers import DynamicCache

        _raise_injected_faults(plan)
        rows = []
        for done, chunk in enumerate(plan):
            seq, start, n = chunk.seq, chunk.start, chunk.num_tokens
            if start == 0:
                self.caches[seq.seq_id] = DynamicCache(config=self.model.config)
            cache = self.caches[seq.seq_id]
            end = start + n
            try:
                out = self.model(
                    input_ids=torch.tensor([seq.token_ids[start:end]], device=self.model.device),
                    attention_mask=torch.ones(1, end, dtype=torch.long, device=self.model.device),
                    past_key_values=cache,
                    use_cache=True,
                    logits_to_keep=1,
                )
            except Exception:  # roll back what this run appended, so that a retry starts clean
                for ran in plan[:done + 1]:
                    _truncate(self.caches[ran.seq.seq_id], ran.start)
                raise
            if chunk.samples:
                rows.append(out.logits[0, -1].float())
        if not rows:
            return torch.empty(0, 0)
        return torch.stack(rows)

    def free(self, seq_id: str) -> None:
        self.caches.pop(seq_id, None)
