"""Batched sampling: one pass over the whole batch's logits with per-row parameters.

Penalties, temperature, top-k, top-p and min-p are tensor operations over `[rows, vocab]`.
The only per-row Python work is drawing noise for seeded rows from their own generators,
so a seeded request samples the same tokens whatever else shares the batch.

Constrained rows (an active grammar, engine/grammar.py) get their bitmask filled for this step
and -inf on every token it forbids, over the whole logits row (a padded vocabulary's extra ids
included), before penalties, greedy or sampling and logprobs; other rows are untouched. A row
whose thought reached its budget (engine/reasoning.py) takes the forced end tag.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.grammar import allowed_tokens
from engine.request import Sequence, TokenLogprob


@dataclass(slots=True)
class SampleResult:
    token_ids: list[int]  # one per row
    logprobs: list[TokenLogprob | None]  # one per row; None where not asked
    bad_rows: list[int]  # rows whose logits were not finite (the request fails)


class Sampler:
    def __init__(self, eos_token_ids: list[int], seed: int = 0, grammars=None):
        self.eos_token_ids = eos_token_ids
        self.grammars = grammars  # engine.grammar.GrammarCompiler: fills the constrained rows' bitmasks
        self.generator = torch.Generator().manual_seed(seed)  # shared by unseeded rows
        self.seq_generators: dict[str, torch.Generator] = {}  # seq_id -> its own generator

    def forget(self, seq_id: str) -> None:
        self.seq_generators.pop(seq_id, None)

    def _generator(self, seq: Sequence) -> torch.Generator:
        gen = self.seq_generators.get(seq.seq_id)
        if gen is None:
            gen = torch.Generator().manual_seed(seq.params.seed + seq.index)
            self.seq_generators[seq.seq_id] = gen
        return gen

    @torch.inference_mode()
    def sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> SampleResult:
        """logits: [rows, vocab] float32, one row per sequence in `seqs`."""
        logits = logits.cpu()
        rows, vocab = logits.shape
        params = [s.params for s in seqs]
        finite = torch.isfinite(logits).all(dim=1)
        bad_rows = [i for i in range(rows) if not finite[i]] if not bool(finite.all()) else []
        if bad_rows:
            logits = torch.nan_to_num(logits, nan=0.0, posinf=0.0, neginf=0.0)
        constrained = [i for i, s in enumerate(seqs) if s.grammar is not None and s.grammar.active]
        if constrained:
            logits = self._mask(logits, seqs, constrained)
        raw = logits

        logits = self._apply_penalties(logits, seqs)
        # min_tokens: hide EOS and stop ids until enough tokens exist (a grammar decides its own end)
        for i, (s, p) in enumerate(zip(seqs, params)):
            if s.num_output_tokens < p.min_tokens and not (s.grammar is not None and s.grammar.active):
                banned = [t for t in (*self.eos_token_ids, *p.stop_token_ids) if t < vocab]
                if banned:
                    logits = logits.clone() if logits is raw else logits
                    logits[i, banned] = float("-inf")

        temps = torch.tensor([p.temperature for p in params])
        greedy = temps == 0
        chosen = logits.argmax(dim=1)
        if not bool(greedy.all()):
            chosen = torch.where(greedy, chosen, self._sample(logits, seqs, params, temps))

        token_ids = chosen.tolist()
        for i, s in enumerate(seqs):
            if s.reasoning is not None and (forced := s.reasoning.forced_token()) is not None:
                token_ids[i] = forced  # the thought used its budget: it ends here
        logprobs: list[TokenLogprob | None] = [None] * rows
        want = [i for i, p in enumerate(params) if p.logprobs is not None]
        if want:
            lp = torch.log_softmax(raw[want], dim=-1)
            top_n = max(params[i].logprobs for i in want)
            top_vals, top_ids = lp.topk(max(top_n, 1), dim=-1)
            for j, i in enumerate(want):
                n = params[i].logprobs
                top = [(t, v) for t, v in zip(top_ids[j, :n].tolist(), top_vals[j, :n].tolist())
                       if v != float("-inf")]  # a token the grammar forbids is no alternative
                logprobs[i] = TokenLogprob(token_id=token_ids[i], logprob=float(lp[j, token_ids[i]]), top=top)
        return SampleResult(token_ids, logprobs, bad_rows)

    def _mask(self, logits: torch.Tensor, seqs: list[Sequence], rows: list[int]) -> torch.Tensor:
        """logits [rows, vocab] with -inf where the grammar of each row in `rows` forbids the token
        (a copy; the other rows unchanged). The first token may also open a thought."""
        vocab = logits.shape[1]
        bitmask = self.grammars.fill_bitmasks([seqs[i].grammar.matcher for i in rows])  # [len(rows), words]
        allowed = torch.from_numpy(allowed_tokens(bitmask, vocab))  # [len(rows), vocab] bool
        for j, i in enumerate(rows):
            reasoning = seqs[i].reasoning
            if reasoning is not None and reasoning.may_open and reasoning.tags.start_id < vocab:
                allowed[j, reasoning.tags.start_id] = True
        index = torch.tensor(rows)
        logits = logits.clone()
        logits[index] = logits[index].masked_fill(~allowed, float("-inf"))
        return logits

    def _apply_penalties(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        params = [s.params for s in seqs]
        use_rep = any(p.repetition_penalty != 1.0 for p in params)
        use_freq = any(p.presence_penalty or p.frequency_penalty for p in params)
        if not (use_rep or use_freq):
            return logits
        rows, vocab = logits.shape
        logits = logits.clone()
        if use_rep:
            # seen[i, t]: token t appears in row i's prompt or output (HF RepetitionPenaltyLogitsProcessor)
            seen = torch.zeros(rows, vocab, dtype=torch.bool)
            for i, s in enumerate(seqs):
                seen[i, torch.tensor(s.token_ids, dtype=torch.long).clamp_(max=vocab - 1)] = True
            penalty = torch.tensor([p.repetition_penalty for p in params])[:, None].expand(rows, vocab)
            penalized = torch.where(logits > 0, logits / penalty, logits * penalty)
            logits = torch.where(seen, penalized, logits)
        if use_freq:
            counts = torch.zeros(rows, vocab)
            for i, s in enumerate(seqs):
                out = s.output_token_ids
                if out:
                    ids = torch.tensor(out, dtype=torch.long).clamp_(max=vocab - 1)
                    counts[i].index_add_(0, ids, torch.ones(len(out)))
            freq = torch.tensor([p.frequency_penalty for p in params])[:, None]
            pres = torch.tensor([p.presence_penalty for p in params])[:, None]
            logits = logits - freq * counts - pres * (counts > 0).float()
        return logits

    def _sample(self, logits, seqs, params, temps) -> torch.Tensor:
        rows, vocab = logits.shape
        # Scaled from each row's maximum: (logits - max) / t is <= 0 with its top entries at 0 for
        # every t > 0, so a tiny temperature sharpens towards greedy instead of overflowing (l / 1e-40
        # is inf, softmax of inf is NaN: token 0 forever).
        top = logits.max(dim=-1, keepdim=True).values
        top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
        logits = (logits - top) / torch.where(temps == 0, torch.ones_like(temps), temps)[:, None]
        top_k = torch.tensor([p.top_k if 0 < p.top_k < vocab else vocab for p in params])
        top_p = torch.tensor([p.top_p for p in params])
        min_p = torch.tensor([p.min_p for p in params])
        if bool((top_k < vocab).any()) or bool((top_p < 1).any()):
            sorted_logits, order = logits.sort(dim=-1, descending=True)
            ranks = torch.arange(vocab)[None, :]
            drop = ranks >= top_k[:, None]
            probs = sorted_logits.softmax(dim=-1)
            mass_before = probs.cumsum(dim=-1) - probs
            drop |= mass_before >= top_p[:, None]  # keeps at least the top token
            sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
            logits = torch.empty_like(logits).scatter_(1, order, sorted_logits)
        probs = logits.softmax(dim=-1)
        if bool((min_p > 0).any()):
            keep = probs >= min_p[:, None] * probs.max(dim=-1, keepdim=True).values
            probs = torch.where(keep, probs, torch.zeros_like(probs))
        # Exponential race: argmax(p / E) with E ~ Exp(1) samples from p. Seeded rows draw E
        # from their own generator; the rest share one draw.
        noise = torch.empty(rows, vocab).exponential_(generator=self.generator)
        for i, s in enumerate(seqs):
            if s.params.seed is not None and s.params.temperature > 0:
                noise[i].exponential_(generator=self._generator(s))
        return (probs / noise).argmax(dim=1)
