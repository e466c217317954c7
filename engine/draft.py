"""Drafts from a second, small model with the target's tokenizer (`--speculative draft`).

The draft model runs on the engine's own pieces: `setup_model` makes it ready as it does the
target (packed linears, the decode kernels, the native step where it takes the model), a
`PagedRunner` on its own paged KV cache and a `BlockAllocator` of its own. Each target sequence
it drafts for has a shadow `Sequence` here: the target's tokens, then the draft's guesses, with
the shadow's own block table and count of computed tokens.

    prefill    a prompt the target computes this step, but its last token (after the schedule)
    sync       the shadow's tokens <- the target's; its K/V past their common prefix rolled back
               (the guesses the target rejected, and the one it drew instead, which follows)
    forward 1  every drafting shadow's uncomputed tokens (the target's new ones: one after a
               rejection, two after a draft taken whole) -> guess 1
    forward j  guess j - 1 alone -> guess j, while a shadow wants more (its own length k)

A guess is the draft's argmax for greedy and seeded requests (a point mass: the target's own draw
decides, so a seeded request keeps its tokens), and a draw from the draft's processed distribution
q for unseeded sampled ones, kept for the rejection rule (engine/speculative.py): the target then
accepts with min(1, p/q) and draws from max(0, p - q) after a rejection, which keeps p exactly and
accepts more than a point mass does where p is flat.

The shadows of sequences that are not drafting keep their K/V (they catch up later); when the pool
runs short, they are dropped first. The draft has a prefix cache of its own, as the target does: a
new shadow starts from the blocks of the longest prefix the draft computed before (same cache salt
only), and the full blocks of the target's tokens are named as they are computed (never a block
that holds a guess). A draft forward that fails drops the shadows it ran: the target
goes on without guesses.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

import numpy as np
import torch

from engine.attention import PagedKVCache, kv_cache_dtype
from engine.config import EngineConfig
from engine.kv_cache import BlockAllocator
from engine.model.memory import num_kv_blocks
from engine.model.setup import setup_model
from engine.request import Sequence
from engine.runner.paged import PagedRunner, kv_geometry
from engine.runner.step_output import StepOutput
from engine.sampler import distribution, pick
from engine.scheduler import ScheduledChunk

log = logging.getLogger("rill.engine")

EMBEDDED = "embedded"  # --draft-model embedded: the embedded SmolLM2-135M-Instruct


def load_draft(draft_model: str, target, **load_kwargs):
    """The draft model loaded by the target's loader with the same settings (dtype, device,
    quantize, activations), once its vocabulary is checked against the target's. Raises
    ModelLoadError with one line (app.py exits 2)."""
    from engine.model.loading import ModelLoadError, load_model

    draft = load_model(None if draft_model == EMBEDDED else draft_model, **load_kwargs)
    reason = vocabulary_mismatch(target.tokenizer, draft.tokenizer)
    if reason is not None:
        raise ModelLoadError(f"--draft-model {draft_model}: the draft model {draft.name} cannot draft for "
                             f"{target.name}: {reason}; a draft must have the same tokenizer (e.g. "
                             "SmolLM2-135M-Instruct for SmolLM2-360M or -1.7B)")
    return draft


def vocabulary_mismatch(target_tokenizer, draft_tokenizer) -> str | None:
    """None when both tokenizers give every token the same id, else what differs."""
    target, draft = target_tokenizer.get_vocab(), draft_tokenizer.get_vocab()
    if len(target) != len(draft):
        return f"its tokenizer has {len(draft)} tokens, the model's {len(target)}"
    for token, token_id in target.items():
        if draft.get(token) != token_id:
            return f"token {token!r} is id {token_id} for the model, {draft.get(token)} for the draft"
    return None


@dataclass(slots=True)
class Proposal:
    """What the draft model guesses for one sequence this step."""

    token_ids: list[int]
    probs: list[np.ndarray] | None  # [len(token_ids)] the draft's q [width] of each drawn guess; None: argmax guesses


@dataclass(slots=True)
class Shadow:
    """A target sequence as the draft model holds it."""

    seq: Sequence  # the draft's: the target's tokens then its guesses; its own block table and computed count
    synced: int  # the target's length when last synced: every token before it is the target's


class DraftModel:
    """A second model that proposes each drafting sequence's next k tokens, batched over sequences."""

    def __init__(self, loaded, config: EngineConfig, max_model_len: int, vocab_width: int):
        model = loaded.model
        self.name = loaded.name
        self.max_len = min(max_model_len, loaded.context_length)  # positions the draft may compute
        self.width = min(vocab_width, _logits_width(model))  # ids a guess may take: the target embeds them all
        self.budget = config.max_num_batched_tokens  # tokens of one draft forward at most
        num_layers, num_kv_heads, head_dim = kv_geometry(model.config)
        per_block = PagedKVCache.bytes_per_block(num_layers, config.block_size, num_kv_heads, head_dim,
                                                 kv_cache_dtype(config.kv_cache_dtype, model.dtype))
        # room for the sequences it drafts for at once, at full context (capped by free memory)
        sizing = dataclasses.replace(config, num_kv_blocks=None, kv_cache_memory=None,
                                     max_num_seqs=config.speculative_max_seqs)
        self.num_kv_blocks = num_kv_blocks(sizing, self.max_len, per_block, model.device)
        setup = setup_model(model, config, self.num_kv_blocks)
        if not isinstance(setup.runner, PagedRunner):
            raise ValueError(f"the draft model {loaded.name} cannot run on the paged KV cache "
                             f"({setup.runner_reason}); choose a draft of an architecture the paged path takes")
        self.runner = setup.runner
        # the draft's prefix cache: a prompt whose start the draft has computed before (a chat's
        # earlier turns, a shared system prompt) is not computed again, as the target does not
        self.allocator = BlockAllocator(self.num_kv_blocks, config.block_size, prefix_caching=config.prefix_caching)
        self.shadows: dict[str, Shadow] = {}  # target seq_id -> its shadow
        self.generator = torch.Generator().manual_seed(config.seed + 1)  # draws of sampled guesses
        log.info("engine: draft model %s, %d KV blocks, decode attention %s", loaded.name, self.num_kv_blocks,
                 setup.decode_attention)

    def forget(self, seq_id: str) -> None:
        """Drop a sequence's shadow (finished, or its blocks wanted): its blocks go back."""
        shadow = self.shadows.pop(seq_id, None)
        if shadow is not None:
            self.allocator.free(shadow.seq.block_table)

    def prefill(self, goals: list[tuple[Sequence, int]]) -> None:
        """For each (target sequence, n) of `goals`, the draft computes the sequence's tokens up to n
        (its prompt, as the target computes it in the same step), so that the first guesses after
        the first token cost no prompt."""
        plan, budget = [], self.budget
        keep = {seq.seq_id for seq, _ in goals}
        for seq, goal in goals:
            if goal > self.max_len:
                continue
            shadow = self._synced(seq)
            start = shadow.num_computed_tokens
            num_new = min(goal - start, budget)
            if num_new > 0 and self._allocate(shadow, start + num_new, keep):
                plan.append(ScheduledChunk(shadow, start, num_new))
                budget -= num_new
        if plan and self._run(plan) is not None:
            for chunk in plan:
                chunk.seq.num_computed_tokens = chunk.start + chunk.num_tokens

    def propose(self, wanted: list[tuple[Sequence, int]]) -> dict[str, Proposal]:
        """Up to k guesses after each (decode-ready target sequence, k) of `wanted`, by seq_id."""
        plan, lengths, budget = [], {}, self.budget
        keep = {seq.seq_id for seq, _ in wanted}
        for seq, k in wanted:
            k = min(k, self.max_len + 1 - len(seq.token_ids))  # guess k - 1 is the last position computed
            if k < 1:
                continue
            shadow = self._synced(seq)
            start = shadow.num_computed_tokens
            num_new = len(shadow.token_ids) - start
            if num_new > budget:  # a long catch-up (a prompt): part of it now, guesses a later step
                num_new, k = max(budget, 0), 0
            if num_new < 1 or not self._allocate(shadow, start + num_new + max(k - 1, 0), keep):
                continue
            plan.append(ScheduledChunk(shadow, start, num_new))
            budget -= num_new
            if k:
                lengths[seq.seq_id] = k
        proposals = {seq_id: Proposal([], None) for seq_id in lengths}
        while plan:
            step = self._run(plan)
            if step is None:
                for chunk in plan:
                    proposals.pop(chunk.seq.seq_id, None)
                break
            plan = self._advance(plan, step, proposals, lengths)
        return {seq_id: p for seq_id, p in proposals.items() if p.token_ids}

    def _run(self, plan: list[ScheduledChunk]) -> StepOutput | None:
        """One draft forward; None when it failed: the target goes on without guesses, and the
        shadows it ran start over."""
        try:
            return StepOutput.of(self.runner.run(plan))
        except Exception as exc:
            log.warning("a draft forward of %d sequences failed (%s: %s); they go on without drafts",
                        len(plan), type(exc).__name__, exc)
            for chunk in plan:
                self.forget(chunk.seq.seq_id)
            return None

    def _advance(self, plan: list[ScheduledChunk], step: StepOutput, proposals: dict[str, Proposal],
                 lengths: dict[str, int]) -> list[ScheduledChunk]:
        """After a draft forward: each sampling shadow's next guess; the next forward's chunks."""
        following, row = [], 0
        logits = None
        for chunk in plan:
            shadow = chunk.seq
            shadow.num_computed_tokens = chunk.start + chunk.num_tokens
            if not chunk.samples:
                continue
            i, row = row, row + 1
            proposal = proposals.get(shadow.seq_id)
            if proposal is None:
                continue
            params = shadow.params
            if params.temperature == 0 or params.seed is not None:
                best = -1 if step.argmax is None else int(step.argmax[i])
                if not 0 <= best < self.width:
                    if logits is None:
                        logits = step.logits.cpu().numpy()  # [sampling rows, vocab]
                    guess = logits[i, :self.width]
                    best = int(guess.argmax()) if np.isfinite(guess).all() else -1
                if best < 0:
                    continue  # a row not finite: no more guesses (the target fails it, or not, alone)
                token = best
            else:
                if logits is None:
                    logits = step.logits.cpu().numpy()
                guess = logits[i, :self.width]
                if not np.isfinite(guess).all():
                    continue
                q = distribution(guess, params)
                token = pick(q, float(torch.rand(1, generator=self.generator, dtype=torch.float64)))
                proposal.probs = (proposal.probs or []) + [q]
            proposal.token_ids.append(token)
            shadow.token_ids.append(token)
            if len(proposal.token_ids) < lengths[shadow.seq_id]:
                following.append(ScheduledChunk(shadow, shadow.num_computed_tokens, 1))
        return following

    def _synced(self, seq: Sequence) -> Sequence:
        """`seq`'s shadow, its tokens the target's now: K/V past their common prefix no longer count."""
        shadow = self.shadows.get(seq.seq_id)
        salt = seq.params.cache_salt  # blocks are shared only between requests of the same salt, as the target's
        if shadow is None:
            mine = Sequence(seq_id=seq.seq_id, request_id=seq.request_id, index=seq.index,
                            token_ids=list(seq.token_ids), num_prompt_tokens=seq.num_prompt_tokens, params=seq.params)
            mine.num_computed_tokens = self.allocator.match_prefix(mine.token_ids, mine.block_hashes,
                                                                   mine.block_table, salt)
            mine.num_cached_blocks = len(mine.block_table)
            self.allocator.count_lookup(len(mine.token_ids), mine.num_computed_tokens)
            self.shadows[seq.seq_id] = Shadow(mine, len(seq.token_ids))
            return mine
        mine, tokens = shadow.seq, seq.token_ids
        same = shadow.synced  # the target only appends: everything before this is the same
        end = min(len(mine.token_ids), len(tokens))
        while same < end and mine.token_ids[same] == tokens[same]:
            same += 1
        del mine.token_ids[same:]
        mine.token_ids.extend(tokens[same:])
        shadow.synced = len(tokens)
        if mine.num_computed_tokens > same:
            mine.num_computed_tokens = same
            self.allocator.shrink(mine.block_table, same)
        # name the full blocks that hold the target's tokens only (never a guess): from `same` on,
        # the shadow's tokens may still change, so only blocks before it
        mine.num_cached_blocks = self.allocator.cache_full_blocks(
            mine.token_ids, mine.block_hashes, mine.block_table, min(mine.num_computed_tokens, same),
            mine.num_cached_blocks, salt)
        return mine

    def _allocate(self, shadow: Sequence, num_tokens: int, keep: set[str]) -> bool:
        """Blocks for `num_tokens` of `shadow`; short of them, the shadows of sequences not drafting
        now give theirs up (they start over when they draft again)."""
        if self.allocator.allocate(shadow.block_table, num_tokens):
            return True
        for seq_id in [s for s in self.shadows if s not in keep]:
            self.forget(seq_id)
        return self.allocator.allocate(shadow.block_table, num_tokens)

    def close(self) -> None:
        """Let go of the draft's KV cache (a rebuilt core allocates its own)."""
        self.runner = None
        self.shadows.clear()


def _logits_width(model) -> int:
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    return int(getattr(head, "out_features", 0) or getattr(model.config, "vocab_size", 0))
