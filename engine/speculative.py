"""Speculative decoding: guessed tokens checked in one forward, exactly.

At one sequence a decode step reads every weight to make one token; a forward of the last token
and k guessed tokens reads the same weights once, so each guess the model agrees with is a token
for little more than nothing. The guesses come from one of two proposers:

- `ngram` (prompt lookup, as llama.cpp's lookup decoding and vLLM's n-gram proposer): the longest
  recent suffix n-gram that occurred earlier in prompt + output proposes the tokens that followed
  it there (`NgramIndex`); a match of only 2 tokens proposes one token (longer guesses from
  such short matches slowed open-ended chat).
- `draft`: a second, small model with the same tokenizer, run by the same engine on its own KV
  blocks (engine/draft.py), guesses k tokens one forward at a time.

    propose (before the schedule)  seq.draft_token_ids <- the proposer's guesses
    schedule                       a decode-ready sequence's chunk carries its draft: k + 1 positions
    scheduled (after it)           a draft model computes the plan's prompt chunks too
    verify (after the forward)     the acceptance rule below, position by position; the first
                                   rejection ends the step with the token drawn in its place
    settle                         computed tokens += accepted; the blocks past them go back (the
                                   draft model rolls its own K/V back when it next syncs)

The acceptance rule is exact. Greedy: the draft's token is kept when it is the row's argmax, so
the output is the argmax chain without speculation. Sampled, a guess as a point mass (n-gram
guesses, and a draft model's argmax for seeded requests): the token at each position is drawn
from the target's processed distribution p (temperature, top-k, top-p, min-p: `sampler._draw`)
with one uniform draw, the same draw and inverse CDF the sampler makes without speculation; the
guess d is accepted when the drawn token is d (probability p(d)), and otherwise the drawn token
(distributed as p with d removed, renormalized) is emitted and the step ends. That is the
rejection rule of speculative sampling (Leviathan et al. 2023, Chen et al. 2023) for a draft that
is a point mass on d (min(1, p(d)/1) = p(d); residual max(0, p - 1_d) normalized = p without d),
and it consumes one uniform per emitted token in the same order, so a seeded request gives the
same tokens with speculation on and off (up to the last-bit rounding of a batched forward, which
can move a draw that lands within that rounding of a token boundary). Sampled, a guess drawn from
the draft model's own processed distribution q (unseeded requests): d is accepted with
probability min(1, p(d)/q(d)), and after a rejection the step ends with a token drawn from
max(0, p - q), normalized: again exactly p at every position, and where q is close to p nearly
every guess is kept (a point mass would keep only p(d) of them).

Not speculated (their next token depends on more than the logits and the seed, so each is drawn
one step at a time as before): a grammar, logprobs, repetition/presence/frequency penalties, a
sequence still under min_tokens, a thought with a token budget. Stop strings, stop tokens, EOS and
max_tokens need nothing: accepted tokens go through the per-token state machine one at a time
and the first that finishes the sequence drops the rest.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import numpy as np
import torch

from engine.request import RequestOutput, Sequence
from engine.runner.step_output import StepOutput
from engine.sampler import _draw, distribution, pick

NGRAM_MAX = 6  # the longest suffix looked up (longer ones help input-grounded prompts)
NGRAM_MIN = 2  # the shortest: one token matches too often to be worth a guess
MAX_COOLDOWN = 16  # steps a sequence whose guesses keep failing waits before guessing again


def speculates(seq: Sequence) -> bool:
    """Whether this sequence's next tokens may be drafted: nothing but its logits and its seed
    decides them (see the module docstring for what is left out and why)."""
    p = seq.params
    return (p.logprobs is None and p.repetition_penalty == 1.0 and not p.presence_penalty
            and not p.frequency_penalty and seq.grammar is None and seq.num_output_tokens >= p.min_tokens
            and not (seq.reasoning is not None and p.max_reasoning_tokens is not None))


@dataclass(slots=True)
class NgramIndex:
    """Where each n-gram (n in NGRAM_MIN..NGRAM_MAX) of a token list last ended, kept up to date as
    the list grows, so a lookup costs a few dict probes instead of a scan of the context."""

    last_end: dict[tuple[int, ...], int] = field(default_factory=dict)  # n-gram -> end (exclusive) of its latest occurrence
    num_indexed: int = 0  # ends 1..num_indexed are in `last_end`

    def propose(self, tokens: list[int], k: int) -> list[int]:
        """Up to k tokens that followed the latest earlier occurrence of the longest suffix n-gram."""
        end = len(tokens)
        for e in range(self.num_indexed + 1, end):  # every end but the suffix's own
            for n in range(NGRAM_MIN, min(NGRAM_MAX, e) + 1):
                self.last_end[tuple(tokens[e - n:e])] = e
        self.num_indexed = max(self.num_indexed, end - 1)
        for n in range(min(NGRAM_MAX, end - 1), NGRAM_MIN - 1, -1):
            e = self.last_end.get(tuple(tokens[end - n:end]))
            if e is not None:  # a match of the shortest length guesses one token only (it is often chance)
                return tokens[e:e + (k if n > NGRAM_MIN else 1)]
        return []


@dataclass(slots=True)
class DraftState:
    """One sequence's proposer state and how far its guesses have been right."""

    index: NgramIndex = field(default_factory=NgramIndex)  # the n-gram proposer's (unused with a draft model)
    k: int = 1  # the next draft's length at most
    misses: int = 0  # drafts in a row of which nothing was accepted
    cooldown: int = 0  # steps to wait before the next draft
    draft_probs: list[np.ndarray] | None = None  # this step's guesses' q (a draft model's draws), else None


def make_speculator(config, draft, max_model_len: int, vocab_size: int) -> Speculator | None:
    """The `Speculator` of `config.speculative` (None: off). `draft`: the loaded draft model
    (`engine.draft.load_draft`), which `draft` mode needs."""
    if config.speculative == "off":
        return None
    drafter = None
    if config.speculative == "draft":
        if draft is None:
            raise ValueError("speculative='draft' needs the draft model loaded (engine.draft.load_draft) and "
                             "passed to the engine")
        from engine.draft import DraftModel

        drafter = DraftModel(draft, config, max_model_len, vocab_size)
    return Speculator(config.num_speculative_tokens, config.speculative_max_seqs, drafter)


class Speculator:
    """Drafts for the running sequences, the acceptance rule, the KV rollback and the counts."""

    def __init__(self, num_speculative_tokens: int, max_running: int, drafter=None):
        self.num_speculative_tokens = num_speculative_tokens  # a draft's length at most
        self.max_running = max_running  # above this many running sequences the forward is not memory-bound: no drafts
        self.drafter = drafter  # engine.draft.DraftModel, or None: n-gram guesses
        self.states: dict[str, DraftState] = {}  # seq_id -> its state
        self.draft_tokens_total = 0  # tokens proposed and verified
        self.accepted_tokens_total = 0  # of which the model agreed with

    def forget(self, seq_id: str) -> None:
        self.states.pop(seq_id, None)
        if self.drafter is not None:
            self.drafter.forget(seq_id)

    def close(self) -> None:
        """Let go of the draft model's KV cache (a rebuilt core makes its own)."""
        if self.drafter is not None:
            self.drafter.close()

    def propose(self, running: list[Sequence], max_model_len: int) -> None:
        """Set each running sequence's `draft_token_ids` (empty where nothing is guessed)."""
        busy = len(running) > self.max_running
        wanted: list[tuple[Sequence, int]] = []  # (sequence, its draft's length at most)
        for seq in running:
            seq.draft_token_ids = []
            k = 0 if busy else self._length(seq, max_model_len)
            if k:
                wanted.append((seq, k))
        if self.drafter is None:
            for seq, k in wanted:
                seq.draft_token_ids = self.states[seq.seq_id].index.propose(seq.token_ids, k)
            return
        proposals = self.drafter.propose(wanted) if wanted else {}
        for seq, _ in wanted:
            proposal = proposals.get(seq.seq_id)
            state = self.states[seq.seq_id]
            seq.draft_token_ids = proposal.token_ids if proposal is not None else []
            state.draft_probs = proposal.probs if proposal is not None else None

    def scheduled(self, plan: list) -> None:
        """After the schedule: a draft model computes the prompt chunks of the plan beside the target
        (all but a prompt's last token), unless the batch is too large for drafts."""
        if self.drafter is None or len(plan) > self.max_running:
            return
        goals = [(c.seq, min(c.start + c.num_tokens, len(c.seq.token_ids) - 1)) for c in plan
                 if c.start < len(c.seq.token_ids) - 1 and speculates(c.seq)]
        if goals:
            self.drafter.prefill(goals)

    def _length(self, seq: Sequence, max_model_len: int) -> int:
        """How many tokens to guess after `seq` this step (0: none)."""
        if seq.num_computed_tokens != len(seq.token_ids) - 1 or not speculates(seq):
            return 0  # a prompt or a recomputation still on the way, or a sequence drawn step by step
        state = self.states.get(seq.seq_id)
        if state is None:
            state = self.states[seq.seq_id] = DraftState(k=self.num_speculative_tokens)
        state.draft_probs = None
        if state.cooldown:
            state.cooldown -= 1
            return 0
        room = min(seq.params.max_tokens - seq.num_output_tokens - 1,  # the token after the draft counts too
                   max_model_len - 1 - len(seq.token_ids))  # the draft's last position stays inside the context
        return max(0, min(state.k, room))

    def verify(self, step: StepOutput, seq: Sequence, draft: tuple[int, ...], sampler) -> list[int] | None:
        """The tokens a verified draft adds: the accepted prefix of `draft`, then one drawn token.
        step: the k + 1 rows [k + 1, vocab] of the chunk (last token, then each draft token). None
        when a row that decides a token is not finite (the request fails, as it would without)."""
        params = seq.params
        greedy = params.temperature == 0
        best = step.argmax.tolist() if greedy and step.argmax is not None else None
        if step.screened and (best is None or min(best) < 0):
            raise RuntimeError("the step computed only the argmax of rows whose sampling reads their logits")
        logits = None if best is not None and min(best) >= 0 else step.logits.cpu().numpy()  # [k + 1, vocab]
        state = self.states.get(seq.seq_id)
        probs = state.draft_probs if state is not None and not greedy and params.seed is None else None
        tokens: list[int] = []
        for i in range(len(draft) + 1):
            if logits is not None and not np.isfinite(logits[i]).all():
                return None
            rejected = False
            if greedy:
                token = best[i] if logits is None else int(logits[i].argmax())
            elif probs is not None and i < len(draft):
                token, rejected = self._judge(logits[i], params, draft[i], probs[i], seq, sampler)
            else:
                token = _draw(logits[i], params, self._uniform(seq, sampler))
            tokens.append(token)
            if rejected or i == len(draft) or token != draft[i]:
                break
        self._count(seq, len(draft), len(tokens) - 1)
        return tokens

    def _judge(self, row: np.ndarray, params, guess: int, q: np.ndarray, seq: Sequence, sampler) -> tuple[int, bool]:
        """(token, rejected) at a position whose guess was drawn from the draft's q: the guess with
        probability min(1, p(guess) / q(guess)), else a token drawn from max(0, p - q), normalized."""
        p = distribution(row, params)  # [vocab] float64
        if self._uniform(seq, sampler) * q[guess] < p[guess]:
            return guess, False
        residual = p.copy()
        residual[:len(q)] -= q
        np.maximum(residual, 0.0, out=residual)
        if not residual.sum() > 0:  # p <= q everywhere: p == q up to rounding, so any draw from p
            residual = p
        return pick(residual, self._uniform(seq, sampler)), True

    @staticmethod
    def _uniform(seq: Sequence, sampler) -> float:
        """The draw the sampler would make for this sequence's next token: from its own generator
        when seeded (the same sequence of draws with speculation on and off), else the shared one."""
        gen = sampler.generator if seq.params.seed is None else sampler._generator(seq)
        return float(torch.rand(1, generator=gen, dtype=torch.float64))

    def _count(self, seq: Sequence, drafted: int, accepted: int) -> None:
        """Count a verified draft and adapt the sequence's next draft length: longer after a draft
        taken whole, as long as what was taken plus one after a partial one, and after one taken not
        at all a pause that doubles with each such draft in a row (open-ended text then costs little)."""
        self.draft_tokens_total += drafted
        self.accepted_tokens_total += accepted
        state = self.states.get(seq.seq_id)
        if state is None:
            return
        if accepted == drafted:
            state.k = min(self.num_speculative_tokens, state.k + 2)
            state.misses = 0
        elif accepted:
            state.k = accepted + 1
            state.misses = 0
        else:
            state.k = 1
            state.misses += 1
            state.cooldown = min(MAX_COOLDOWN, 2 ** (state.misses - 1)) if state.misses > 1 else 0

    @staticmethod
    def settle(seq: Sequence, accepted: int, allocator) -> None:
        """After the accepted tokens joined `seq.token_ids`: their K/V count as computed; the blocks
        that held only rejected positions go back to the allocator. Only then are full blocks named
        in the prefix cache, so a block's hash never covers a rejected token."""
        seq.num_computed_tokens += accepted
        allocator.shrink(seq.block_table, seq.num_computed_tokens)
        seq.num_cached_blocks = allocator.cache_full_blocks(
            seq.token_ids, seq.block_hashes, seq.block_table, seq.num_computed_tokens, seq.num_cached_blocks,
            seq.params.cache_salt, seq.images)


def merge_outputs(outputs: list[RequestOutput]) -> RequestOutput:
    """One delta for the tokens a verified draft added in one step (the last one's state)."""
    if len(outputs) == 1:
        return outputs[0]
    last = outputs[-1]
    return dataclasses.replace(last, token_ids=[t for o in outputs for t in o.token_ids],
                               text="".join(o.text for o in outputs),
                               reasoning="".join(o.reasoning for o in outputs))
