"""`PagedRunner`: a step's chunks as one flat row of tokens, one forward, on the paged KV cache.

`prepare_decode` and `prepare_prefill` turn the plan's one-token chunks and prompt chunks into the
attention metadata of `engine.attention.StepMetadata`; a step the native decoder takes (decodes,
and prompt chunks short enough) goes to `engine.runner.native.NativeDecoder` instead.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

from engine.attention import ATTN_NAME, PagedKVCache, PrefillChunk, StepMetadata
from engine.model.vision import covers_images
from engine.runner.faults import raise_injected_faults
from engine.runner.step_output import StepOutput
from engine.sampler import argmax_is_enough
from engine.scheduler import ScheduledChunk

log = logging.getLogger("rill.engine")


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


@dataclass(slots=True)
class FlatBatch:
    """A plan's tokens as one flat row, and where each belongs."""

    input_ids: list[int]  # [tokens] every scheduled token, chunk after chunk
    positions: torch.Tensor  # [tokens] int64, each token's position in its sequence
    token_rows: list[int]  # [tokens] the plan row of each token
    decode_index: list[int]  # [decodes] the flat index of each one-token chunk's token
    decode_rows: list[int]  # [decodes] its plan row
    decode_lens: list[int]  # [decodes] its context, its own token included
    prefills: list[tuple[int, int, int, int]]  # (token offset, tokens, start, row) of each prompt chunk
    image_blocks: dict[int, tuple]  # row -> [first, last] of the images its chunk attends both ways (Gemma 3)
    sample_rows: list[int]  # [sampling chunks] the flat index of each sampling chunk's last token
    tables: torch.Tensor  # [rows * width] int64: block i of row r at r * width + i (0-padded)
    width: int  # blocks in the longest block table
    block_size: int

    def slots(self, rows: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The cache slot of each (row, position): table[row, position // bs] * bs + position % bs.
        (index_select throughout: advanced indexing costs milliseconds per call on CPU.)"""
        bs = self.block_size
        return self.tables.index_select(0, rows * self.width + positions // bs) * bs + positions % bs

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.input_ids) - len(self.decode_index)

    @property
    def attended(self) -> int:
        """Positions the prompt tokens read, all chunks together."""
        return sum(n * (start + n) for _, n, start, _ in self.prefills)


def flatten(plan: list[ScheduledChunk], block_size: int) -> FlatBatch:
    """The plan's chunks as a `FlatBatch`."""
    batch = FlatBatch([], torch.empty(0), [], [], [], [], [], {}, [], torch.empty(0), 0, block_size)
    positions: list[int] = []
    for row, chunk in enumerate(plan):
        start, n = chunk.start, chunk.num_tokens
        offset = len(batch.input_ids)
        batch.input_ids.extend(chunk.token_ids)
        positions.extend(range(start, start + n))
        batch.token_rows.extend([row] * n)
        if n == 1:
            batch.decode_index.append(offset)
            batch.decode_rows.append(row)
            batch.decode_lens.append(start + 1)
        else:
            batch.prefills.append((offset, n, start, row))
            if chunk.seq.images is not None and chunk.seq.images.whole:
                batch.image_blocks[row] = chunk.seq.images.blocks_within(start, start + n)
        if chunk.samples:  # a draft's chunk: a row for each of its positions too
            batch.sample_rows.extend(range(offset + n - 1 - len(chunk.draft), offset + n))
    batch.positions = torch.tensor(positions, dtype=torch.long)
    batch.width = width = max(len(c.seq.block_table) for c in plan)
    batch.tables = torch.tensor([b for c in plan for b in c.seq.block_table + [0] * (width - len(c.seq.block_table))],
                                dtype=torch.long)
    return batch


class PagedRunner:
    """Runs a plan on the paged KV cache in one forward."""

    path = "paged"
    encoder = None  # engine.model.vision.ImageEncoder of a vision-language model (EngineCore sets it)

    def __init__(self, model, num_blocks: int, block_size: int, decode_kernel=None, native=None,
                 native_prefill_tokens: int = 128, kv_dtype: torch.dtype | None = None):
        self.model = model
        self.decode_kernel = decode_kernel  # kernels.decode_attention.DecodeAttentionKernel, kernels.gpu.PagedDecodeKernel or None (torch path)
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
                                  kv_dtype or model.dtype, self.device)  # kv_dtype: a 16-bit cache beside a float32 model
        self.block_size = block_size
        # tokens of prompt chunks (of 2 or more tokens): all, and those run by the native layers
        self.prompt_tokens = self.native_prompt_tokens = 0

    @torch.inference_mode()
    def run(self, plan: list[ScheduledChunk]) -> StepOutput:
        """float32 logits [num_sampling_chunks, vocab] in plan order, with their argmax where the step found it."""
        raise_injected_faults(plan)
        images = self.encoder is not None and any(covers_images(c) for c in plan)
        if self.native is not None and all(c.num_tokens == 1 for c in plan) and not images:
            return self._native_decodes(plan)
        bs = self.block_size
        batch = flatten(plan, bs)
        self.cache.zero_new_blocks([b for c in plan
                                    for b in c.seq.block_table[c.start // bs:(c.start + c.num_tokens - 1) // bs + 1]])
        slot_mapping = batch.slots(torch.tensor(batch.token_rows), batch.positions)
        decode = self.prepare_decode(batch)
        self.prompt_tokens += batch.num_prompt_tokens
        if self.native is not None and batch.attended <= self.native_prefill_tokens ** 2 and not images:
            self.native_prompt_tokens += batch.num_prompt_tokens
            return self._native_step(plan, batch, slot_mapping, decode)
        step = StepMetadata(cache=self.cache, slot_mapping=slot_mapping.to(self.device),
                            prefills=self.prepare_prefill(batch), decode_kernel=self.decode_kernel, **decode)
        return self._model_step(plan, batch, step, images)

    def prepare_decode(self, batch: FlatBatch) -> dict:
        """The decode fields of `StepMetadata` for the batch's one-token chunks (None without any):
        each one's slot of every context position, or its block table for a kernel that reads blocks."""
        dev, rows = self.device, batch.decode_rows
        decode = dict(decode_token_index=None, decode_slots=None, decode_context_lens=None,
                      decode_block_tables=None, decode_max_context=max(batch.decode_lens, default=0))
        if not rows:
            return decode
        if self.kernel_reads_blocks:  # [num_decodes, width]: no slot per context position
            tables = batch.tables.view(-1, batch.width).index_select(0, torch.tensor(rows))
            decode["decode_block_tables"] = tables.to(dev, torch.int32)
        else:
            ctx_len = max(batch.decode_lens)
            ctx = torch.arange(ctx_len).repeat(len(rows))
            row_of = torch.tensor(rows).repeat_interleave(ctx_len)
            decode["decode_slots"] = batch.slots(row_of, ctx).view(len(rows), ctx_len).to(dev)  # [num_decodes, max_context]
        decode["decode_context_lens"] = torch.tensor(batch.decode_lens, device=dev)
        decode["decode_token_index"] = torch.tensor(batch.decode_index, device=dev)
        return decode

    def prepare_prefill(self, batch: FlatBatch) -> list[PrefillChunk]:
        """One `PrefillChunk` per prompt chunk: its tokens' place in the flat row and the slots of its context."""
        chunks = []
        for offset, n, start, row in batch.prefills:
            ctx = torch.arange(start + n)
            chunks.append(PrefillChunk(offset, n, start, batch.slots(torch.full_like(ctx, row), ctx).to(self.device),
                                       batch.image_blocks.get(row, ())))
        return chunks

    def _native_step(self, plan: list[ScheduledChunk], batch: FlatBatch, slot_mapping: torch.Tensor,
                     decode: dict) -> StepOutput:
        """The step on the native decoder: every token attends as a decode would, to its own row of
        slots up to its position."""
        if batch.prefills:
            lens = batch.positions + 1
            context = int(lens.max())
            tokens = len(batch.input_ids)
            rows = torch.tensor(batch.token_rows).repeat_interleave(context)
            token_slots = batch.slots(rows, torch.arange(context).repeat(tokens)).view(tokens, context)
        else:
            token_slots, lens = decode["decode_slots"], decode["decode_context_lens"]
        keep = None if len(batch.sample_rows) == len(batch.input_ids) else torch.tensor(batch.sample_rows, dtype=torch.long)
        return self.native.run(torch.tensor(batch.input_ids), batch.positions, self.cache, slot_mapping, token_slots,
                               lens, keep, argmax_only=_argmax_only(plan))

    def _model_step(self, plan: list[ScheduledChunk], batch: FlatBatch, step: StepMetadata,
                    images: bool = False) -> StepOutput:
        """The step through the model's own modules, attention on the paged cache; with `images`,
        from input embeddings where the image features replace the image tokens' own."""
        dev, sample_rows = self.device, batch.sample_rows
        ids = torch.tensor([batch.input_ids], device=dev)  # [1, total_tokens]
        inputs = dict(inputs_embeds=self.encoder.embed(self.model.get_input_embeddings(), plan, ids)) if images \
            else dict(input_ids=ids)
        out = self.model(
            **inputs,
            position_ids=batch.positions.to(dev)[None],  # [1, total_tokens]
            use_cache=False,
            # 0 keeps every row: the usual all-decode step needs no gather of hidden states
            logits_to_keep=0 if len(sample_rows) == len(batch.input_ids) else torch.tensor(sample_rows, dtype=torch.long, device=dev),
            rill_step=step,
        )
        logits = out.logits[0].float()  # [num_sampling_chunks, vocab]
        if dev.type != "cpu" and _argmax_only(plan):
            # each row's argmax found where the logits are (-1: a row not finite): the sampler then
            # copies no logits to the host (256 rows of SmolLM2's are 50 MB a step)
            best = torch.where(torch.isfinite(logits).all(dim=1), logits.argmax(dim=1), -1)
            return StepOutput(logits, best.cpu())
        return StepOutput(logits)

    def _native_decodes(self, plan: list[ScheduledChunk]) -> StepOutput:
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
