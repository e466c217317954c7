"""The load-time check of the paged path: a model takes it only once it gives its own forward's logits.

`check_paged_path` runs two short steps on a small paged cache of its own, the way `PagedRunner`
does: a 5-token prompt, then that prompt's next token as a decode beside a second 3-token prompt
in the same flat row (the decode kernel the runner would use included). Their logits must equal
those of the model's own forward (its own attention, no cache) on each sequence alone, within a
tolerance fit for the dtypes. A model whose layers do not hand their attention the step's
metadata (StableLM's decoder layers pass no keyword arguments), attend in a way the paged path
does not know, or mix the flat row's sequences fails it, and the reason is logged and shown on
/health: the engine then takes the fallback runner rather than failing every request.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from engine.attention import ATTN_NAME, PagedKVCache, PrefillChunk, StepMetadata
from engine.runner.paged import kv_geometry, supports_paged_attention

log = logging.getLogger("rill.engine")

PROMPT_A, PROMPT_B = 6, 3  # tokens of the two probe sequences (A: 5 as a prompt, then 1 as a decode)
_OURS = (ATTN_NAME, "rill_probe")


@dataclass(frozen=True, slots=True)
class PagedCheck:
    """What the probe found: `reason` is None when the paged path gave the model's own logits."""

    reason: str | None  # why the model takes the fallback path
    sinks: bool = False  # its attention passes sinks (s_aux): no decode kernel takes them
    max_error: float = 0.0  # the largest logit difference, relative to the largest logit


def own_attention(model) -> str:
    """The attention the model was loaded with (kept across engine rebuilds over the same model)."""
    own = getattr(model, "_rill_own_attention", None)
    if own is None:
        own = getattr(model.config, "_attn_implementation", None)
        own = "eager" if own in (None, *_OURS) else own
        model._rill_own_attention = own
    return own


def tolerance(*dtypes: torch.dtype, lossy: bool = False) -> float:
    """Largest logit difference allowed, relative to the largest logit: float32 noise, or 16-bit
    rounding (or int8 activations: a last-bit difference in a linear's input can round it a step apart)."""
    return 1e-3 if not lossy and all(d == torch.float32 or d == torch.float64 for d in dtypes) else 6e-2


def _int8_activations(model) -> bool:
    """Whether the model's block linears round their inputs to int8 (`--activations int8`)."""
    from engine.model.quant import FusedProjections, QuantLinear

    return any(isinstance(m, (QuantLinear, FusedProjections)) and m.int8 for m in model.modules())


def _probe_ids(model) -> tuple[list[int], list[int]]:
    """The two probe prompts: fixed ids spread over the vocabulary."""
    text = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    ids = [(37 * i + 3) % int(text.vocab_size) for i in range(PROMPT_A + PROMPT_B)]
    return ids[:PROMPT_A], ids[PROMPT_A:]


def _slots(blocks: list[int], length: int, block_size: int) -> torch.Tensor:
    pos = torch.arange(length)
    return torch.tensor(blocks)[pos // block_size] * block_size + pos % block_size


@torch.inference_mode()
def _paged_logits(model, ids_a: list[int], ids_b: list[int], block_size: int, kv_dtype: torch.dtype,
                  decode_kernel) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """The two probe steps on the paged path -> (A's 6 rows, B's 3 rows) of float32 logits, sinks seen."""
    dev = model.device
    num_layers, num_kv_heads, head_dim = kv_geometry(model.config)
    per_a, per_b = -(-PROMPT_A // block_size), -(-PROMPT_B // block_size)
    blocks_a, blocks_b = list(range(1, 1 + per_a)), list(range(1 + per_a, 1 + per_a + per_b))
    cache = PagedKVCache(num_layers, 1 + per_a + per_b, block_size, num_kv_heads, head_dim, kv_dtype, dev)
    cache.zero_new_blocks(blocks_a + blocks_b)
    slots_a, slots_b = _slots(blocks_a, PROMPT_A, block_size), _slots(blocks_b, PROMPT_B, block_size)

    def forward(ids, positions, step):
        out = model(input_ids=torch.tensor([ids], device=dev), position_ids=torch.tensor([positions], device=dev),
                    use_cache=False, logits_to_keep=0, rill_step=step)
        return out.logits[0].float()

    n = PROMPT_A - 1
    first = StepMetadata(cache=cache, slot_mapping=slots_a[:n].to(dev), decode_token_index=None, decode_slots=None,
                         decode_context_lens=None, prefills=[PrefillChunk(0, n, 0, slots_a[:n].to(dev))])
    rows_first = forward(ids_a[:n], list(range(n)), first)  # [5, vocab]
    reads_blocks = getattr(decode_kernel, "reads", None) == "blocks"
    second = StepMetadata(
        cache=cache, slot_mapping=torch.cat([slots_a[n:], slots_b]).to(dev),
        decode_token_index=torch.tensor([0], device=dev), decode_slots=slots_a[None].to(dev),
        decode_context_lens=torch.tensor([PROMPT_A], device=dev),
        prefills=[PrefillChunk(1, PROMPT_B, 0, slots_b.to(dev))], decode_kernel=decode_kernel,
        decode_block_tables=torch.tensor([blocks_a], dtype=torch.int32, device=dev) if reads_blocks else None,
        decode_max_context=PROMPT_A)
    rows_second = forward([ids_a[n], *ids_b], [n, *range(PROMPT_B)], second)  # [4, vocab]
    return (torch.cat([rows_first, rows_second[:1]]), rows_second[1:], first.sinks_seen or second.sinks_seen)


@torch.inference_mode()
def _own_logits(model, ids: list[int]) -> torch.Tensor:
    out = model(input_ids=torch.tensor([ids], device=model.device), use_cache=False)
    return out.logits[0].float()


def check_paged_path(model, block_size: int, kv_dtype: torch.dtype | None = None, decode_kernel=None) -> PagedCheck:
    """Whether the paged path gives the model's own logits (see the module docstring). On success the
    model is left on the paged attention; otherwise on the attention it was loaded with."""
    own = own_attention(model)
    kv_dtype = kv_dtype or model.dtype
    if not supports_paged_attention(model):
        _restore(model, own)
        return PagedCheck("its layers do not all call transformers' attention interface")
    ids_a, ids_b = _probe_ids(model)
    try:
        paged_a, paged_b, sinks = _paged_logits(model, ids_a, ids_b, block_size, kv_dtype, decode_kernel)
        model.set_attn_implementation(own)
        want_a, want_b = _own_logits(model, ids_a), _own_logits(model, ids_b)
    except Exception as exc:  # e.g. layers that drop the step's metadata on the way to their attention
        _restore(model, own)
        return PagedCheck(f"the paged path failed its probe: {type(exc).__name__}: {exc}")
    scale = max(float(want_a.abs().max()), float(want_b.abs().max()), 1e-6)
    error = max(float((paged_a - want_a).abs().max()), float((paged_b - want_b).abs().max())) / scale
    allowed = tolerance(model.dtype, kv_dtype, lossy=_int8_activations(model))
    if not error <= allowed:  # NaN fails too
        return PagedCheck(f"the paged path's logits differ from the model's own forward by {error:.2e} of the "
                          f"largest logit (allowed: {allowed:g})", sinks, error)
    model.set_attn_implementation(ATTN_NAME)
    return PagedCheck(None, sinks, error)


def _restore(model, own: str) -> None:
    try:
        model.set_attn_implementation(own)
    except Exception:  # the model refuses any change: it keeps what it has
        pass
