"""Batched sampling: one pass over the whole batch's logits with per-row parameters.

Penalties, temperature, top-k, top-p and min-p are tensor operations over `[rows, vocab]`.
The only per-row Python work is drawing noise for seeded rows from their own generators,
so a seeded request samples the same tokens whatever else shares the batch.

With the compiled kernel (engine/kernels/sampling.py) the penalties, the ban, the argmax of a
changed row and the draw run in C, one row per thread, from the same uniform draws: the same tokens
as the numpy reference below, which still draws a row the kernel leaves unresolved (about one in
10^5: a last-bit difference could flip its choice) and every row when there is no kernel.

Constrained rows (an active grammar, engine/grammar.py) get their bitmask filled for this step
and -inf on every token it forbids, over the whole logits row (a padded vocabulary's extra ids
included), before penalties, greedy or sampling and logprobs; other rows are untouched. A row
whose thought reached its budget (engine/reasoning.py) takes the forced end tag.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from engine.config import rill_cache_dir
from engine.grammar import allowed_tokens
from engine.kernels import sampling as native
from engine.request import Sequence, TokenLogprob
from engine.runner.step_output import StepOutput


@dataclass(slots=True)
class SampleResult:
    """The tokens a step drew, one per row."""

    token_ids: list[int]  # one per row
    logprobs: list[TokenLogprob | None]  # one per row; None where not asked
    bad_rows: list[int]  # rows whose logits were not finite (the request fails)


def argmax_is_enough(seq) -> bool:
    """Whether this sequence's next token is its logits' argmax and nothing else is read from them
    (greedy, no logprobs, penalties, grammar mask or banned end): then the native step may find
    the argmax without computing every logit (csrc/decode_layer.c, screened_argmax)."""
    p = seq.params
    return (p.temperature == 0 and p.logprobs is None and p.repetition_penalty == 1.0 and not p.presence_penalty
            and not p.frequency_penalty and (seq.grammar is None or not seq.grammar.active)
            and seq.num_output_tokens >= p.min_tokens)


def _end_spent_thoughts(token_ids: list[int], seqs) -> list[int]:
    """token_ids, with the token that closes a thought where one used its budget (engine/reasoning.py)."""
    for i, s in enumerate(seqs):
        if s.reasoning is not None and (forced := s.reasoning.forced_token()) is not None:
            token_ids[i] = forced
    return token_ids


class Sampler:
    """Draws each row's next token with its own parameters, the batch in one pass."""

    def __init__(self, eos_token_ids: list[int], seed: int = 0, grammars=None, use_kernel: bool = True):
        self.eos_token_ids = eos_token_ids
        self.kernel = native.sampling_kernel(rill_cache_dir(), _draw) if use_kernel else None
        self.grammars = grammars  # engine.grammar.GrammarCompiler: fills the constrained rows' bitmasks
        self.generator = torch.Generator().manual_seed(seed)  # shared by unseeded rows
        self.seq_generators: dict[str, torch.Generator] = {}  # seq_id -> its own generator
        self.seq_banned: dict[str, torch.Tensor] = {}  # seq_id -> [k] ids hidden until min_tokens, made once
        self.seq_history: dict[str, np.ndarray] = {}  # seq_id -> its token ids so far (int64), for the kernel's penalties
        self.resolved = self.unresolved = 0  # rows the kernel drew, rows it left to the reference

    def forget(self, seq_id: str) -> None:
        self.seq_generators.pop(seq_id, None)
        self.seq_banned.pop(seq_id, None)
        self.seq_history.pop(seq_id, None)

    def _banned(self, seq: Sequence, vocab: int) -> torch.Tensor:
        """EOS and the stop token ids below `vocab`, as one tensor built on the sequence's first step
        under min_tokens: later steps cost the same whatever the length of stop_token_ids."""
        banned = self.seq_banned.get(seq.seq_id)
        if banned is None:
            ids = {t for t in (*self.eos_token_ids, *seq.params.stop_token_ids) if t < vocab}
            banned = self.seq_banned[seq.seq_id] = torch.tensor(sorted(ids), dtype=torch.long)
        return banned

    def _generator(self, seq: Sequence) -> torch.Generator:
        gen = self.seq_generators.get(seq.seq_id)
        if gen is None:
            gen = torch.Generator().manual_seed(seq.params.seed + seq.index)
            self.seq_generators[seq.seq_id] = gen
        return gen

    @torch.inference_mode()
    def sample(self, step: StepOutput | torch.Tensor, seqs: list[Sequence]) -> SampleResult:
        """step: a runner's StepOutput, or bare logits [rows, vocab] float32; one row per sequence in `seqs`."""
        step = StepOutput.of(step)
        best = step.argmax
        if best is not None and best.numel() and int(best.min()) >= 0 and all(argmax_is_enough(s) for s in seqs):
            # the step found each row's argmax (the native step, a GPU's) and no row reads more of its
            # logits: nothing to copy from the device or to pass over
            return SampleResult(_end_spent_thoughts(best.tolist(), seqs), [None] * len(seqs), [])
        logits = step.logits.cpu()
        rows, vocab = logits.shape
        params = [s.params for s in seqs]
        # each row's argmax from the step (engine/runner/native.py), if it has them and all are finite
        best = None if best is None else best.tolist()
        if step.screened and not all(argmax_is_enough(s) for s in seqs):
            raise RuntimeError("the step computed only the argmax of rows whose sampling reads their logits")
        if best is not None and min(best) < 0:
            best = None
        if best is not None:
            bad_rows = []
        else:  # numpy for the two passes over every row: torch's CPU isfinite and argmax take 10-20x longer here
            finite = np.isfinite(logits.numpy()).all(axis=1)  # [rows] bool
            bad_rows = [] if finite.all() else [i for i in range(rows) if not finite[i]]
        if bad_rows:
            logits = torch.nan_to_num(logits, nan=0.0, posinf=0.0, neginf=0.0)
        given = logits
        constrained = [i for i, s in enumerate(seqs) if s.grammar is not None and s.grammar.active]
        if constrained:
            logits = self._mask(logits, seqs, constrained)
        raw = logits

        if self.kernel is not None:
            token_ids = self._sample_native(logits, seqs, params, best if logits is given else None)
        else:
            token_ids = self._sample_reference(logits, raw, given, best, seqs, params)

        token_ids = _end_spent_thoughts(token_ids, seqs)
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

    def _sample_reference(self, logits, raw, given, best, seqs, params) -> list[int]:
        """Each row's token in torch and numpy: penalties, the min_tokens ban, then the argmax or a draw."""
        vocab = logits.shape[1]
        logits = self._apply_penalties(logits, seqs)
        # min_tokens: hide EOS and stop ids until enough tokens exist (a grammar decides its own end)
        for i, (s, p) in enumerate(zip(seqs, params)):
            if s.num_output_tokens < p.min_tokens and not (s.grammar is not None and s.grammar.active):
                banned = self._banned(s, vocab)
                if banned.numel():
                    logits = logits.clone() if logits is raw else logits
                    logits[i, banned] = float("-inf")

        if best is not None and logits is given:  # no mask, penalty or ban changed a row
            token_ids = best
        else:
            token_ids = logits.numpy().argmax(axis=1).tolist()  # the first of equal maxima, as torch's argmax
        if any(p.temperature != 0 for p in params):
            greedy = torch.tensor([p.temperature == 0 for p in params])
            token_ids = torch.where(greedy, torch.tensor(token_ids), self._sample(logits, seqs, params)).tolist()
        return token_ids

    def _uniforms(self, seqs, params) -> list[float]:
        """Each sampling row's uniform draw in [0, 1) (greedy rows: 0): one shared draw per row, then one
        from each seeded row's own generator, in row order."""
        shared = torch.rand(len(seqs), generator=self.generator, dtype=torch.float64).tolist()
        return [0.0 if p.temperature == 0 else shared[i] if p.seed is None
                else float(torch.rand(1, generator=self._generator(s), dtype=torch.float64))
                for i, (s, p) in enumerate(zip(seqs, params))]

    def _history(self, seq: Sequence) -> np.ndarray:
        """seq's token ids (prompt, output) as int64, extended by the tokens since its last step."""
        ids = seq.token_ids
        have = self.seq_history.get(seq.seq_id)
        if have is None or len(have) > len(ids) or (len(have) and have[-1] != ids[len(have) - 1]):
            have = np.array(ids, dtype=np.int64)
        elif len(have) < len(ids):
            have = np.concatenate([have, np.array(ids[len(have):], dtype=np.int64)])
        self.seq_history[seq.seq_id] = have
        return have

    def _sample_native(self, logits: torch.Tensor, seqs, params, best) -> list[int]:
        """Each row's token from the C kernel (penalties, ban, argmax or draw); the reference draws the
        rows it leaves unresolved. best: each row's argmax when no row of `logits` was changed."""
        rows, vocab = logits.shape
        u = self._uniforms(seqs, params) if any(p.temperature != 0 for p in params) else [0.0] * rows
        fparams, iparams, keep = [], [], []
        for i, (s, p) in enumerate(zip(seqs, params)):
            penalized = p.repetition_penalty != 1.0 or ((p.presence_penalty or p.frequency_penalty)
                                                        and s.num_output_tokens > 0)
            history = self._history(s) if penalized else None
            banned = None
            if s.num_output_tokens < p.min_tokens and not (s.grammar is not None and s.grammar.active):
                banned = self._banned(s, vocab)
            keep.append((history, banned))
            mode = native.DRAW if p.temperature != 0 else \
                native.SKIP if best is not None and history is None and banned is None else native.ARGMAX
            fparams.append((p.temperature, p.top_p, p.min_p, u[i], p.repetition_penalty, p.frequency_penalty,
                            p.presence_penalty))
            iparams.append((mode, 0 if history is None else history.ctypes.data, 0 if history is None else len(history),
                            s.num_prompt_tokens, 0 if banned is None else banned.data_ptr(),
                            0 if banned is None else banned.numel(), p.top_k))
        a = np.ascontiguousarray(logits.numpy())  # rows of contiguous float32 (a view's rows may not be)
        tokens, status = self.kernel(a, np.array(fparams, dtype=np.float64), np.array(iparams, dtype=np.int64))
        token_ids = tokens.tolist()
        for i in range(rows):
            if iparams[i][0] == native.SKIP:
                token_ids[i] = best[i]
        unresolved = np.flatnonzero(status != native.DRAWN).tolist()
        self.resolved += rows - len(unresolved)
        self.unresolved += len(unresolved)
        for i in unresolved:  # the reference, with the same draw
            given = logits[i:i + 1]
            row = self._apply_penalties(given, [seqs[i]])
            if keep[i][1] is not None and keep[i][1].numel():
                row = row.clone() if row is given else row  # the step's logits stay as they came
                row[0, keep[i][1]] = float("-inf")
            token_ids[i] = _draw(row[0].numpy(), params[i], u[i])
        return token_ids

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

    def _sample(self, logits, seqs, params) -> torch.Tensor:
        """A token id per row (greedy rows: anything, the caller keeps their argmax), drawn from the
        row's distribution after temperature, top-k, top-p and min-p: one uniform draw per row
        (a seeded row from its own generator) against the cumulative probabilities. Row by row in
        numpy: only the candidates top-k/top-p keep are sorted, never the whole vocabulary unless
        the nucleus is wider than NUCLEUS_PROBE tokens."""
        a = logits.numpy()
        chosen = np.zeros(logits.shape[0], dtype=np.int64)
        for i, (p, u) in enumerate(zip(params, self._uniforms(seqs, params))):
            if p.temperature != 0:
                chosen[i] = _draw(a[i], p, u)
        return torch.from_numpy(chosen)


NUCLEUS_PROBES = (256, 4096)  # top-p looks for its nucleus among this many best tokens, then sorts them all
CDF_BLOCK = 512  # the inverse CDF finds its block of this many tokens first, then the token inside it


def _draw(row: np.ndarray, p, u: float) -> int:
    """One token of `row` (float32 logits [vocab]) for sampling params `p` (temperature > 0) and a
    uniform draw u in [0, 1). Scaled from the row's maximum: (logits - max) / t is <= 0 with its top
    entry at 0 for every t > 0, so a tiny temperature sharpens towards greedy instead of
    overflowing (l / 1e-40 is inf, softmax of inf is NaN: token 0 forever)."""
    vocab = row.shape[0]
    top = row.max()
    z = (row - (top if np.isfinite(top) else 0.0)) / np.float32(p.temperature)
    weights = torch.exp(torch.from_numpy(z)).numpy()  # [vocab] unnormalized probabilities, the best at 1
    starts = np.arange(0, vocab, CDF_BLOCK)
    block_mass = np.add.reduceat(weights, starts, dtype=np.float64)
    total = float(block_mass.sum())
    if not total > 0:
        return int(row.argmax())
    top_k = p.top_k if 0 < p.top_k < vocab else vocab
    if top_k < vocab or p.top_p < 1:
        ids = _kept(weights, total, top_k, p.top_p)
        weights = weights[ids]
    else:
        ids = None
    if p.min_p > 0:  # tokens below min_p times the best token's probability (the best is 1 here)
        weights = np.where(weights >= p.min_p * weights.max(), weights, 0.0)
        block_mass = None
    if ids is None and block_mass is not None:  # the whole vocabulary: find the block, then the token in it
        cumulative = np.cumsum(block_mass)
        block = min(int(np.searchsorted(cumulative, u * cumulative[-1], side="right")), len(cumulative) - 1)
        part = weights[starts[block]:starts[block] + CDF_BLOCK]
        inside = np.cumsum(part, dtype=np.float64)
        target = u * cumulative[-1] - (cumulative[block - 1] if block else 0.0)
        return int(starts[block] + _possible(part, int(np.searchsorted(inside, target, side="right"))))
    cumulative = np.cumsum(weights, dtype=np.float64)
    pick = _possible(weights, int(np.searchsorted(cumulative, u * cumulative[-1], side="right")))
    return int(pick if ids is None else ids[pick])


def distribution(row: np.ndarray, p) -> np.ndarray:
    """The probabilities `_draw` samples `row` (float32 logits [vocab]) with for params `p`
    (temperature > 0): temperature, then top-k and top-p, then min-p; float64 [vocab], summing to 1.
    Speculative decoding's rejection rule reads them for the target's and the draft's rows."""
    top = row.max()
    z = (row - (top if np.isfinite(top) else 0.0)) / np.float32(p.temperature)
    weights = torch.exp(torch.from_numpy(z)).numpy().astype(np.float64)  # as `_draw` computes them, the best at 1
    total = float(weights.sum())
    if not total > 0:
        weights = np.zeros_like(weights)
        weights[int(row.argmax())] = 1.0
        return weights
    vocab = row.shape[0]
    top_k = p.top_k if 0 < p.top_k < vocab else vocab
    if top_k < vocab or p.top_p < 1:
        ids = _kept(weights.astype(np.float32), total, top_k, p.top_p)
        kept = np.zeros_like(weights)
        kept[ids] = weights[ids]
        weights = kept
    if p.min_p > 0:
        weights = np.where(weights >= p.min_p * weights.max(), weights, 0.0)
    return weights / weights.sum()


def pick(weights: np.ndarray, u: float) -> int:
    """The token a uniform draw u in [0, 1) lands on in unnormalized `weights` [vocab] (inverse CDF)."""
    cumulative = np.cumsum(weights, dtype=np.float64)
    return _possible(weights, int(np.searchsorted(cumulative, u * cumulative[-1], side="right")))


def _possible(weights: np.ndarray, pick: int) -> int:
    """`pick`, or the nearest token before it (else after it) whose weight is not 0: rounding in the
    sums can land a draw on a token that cannot come (one a grammar or min-p removed)."""
    pick = min(max(pick, 0), len(weights) - 1)
    if weights[pick] > 0:
        return pick
    before = np.flatnonzero(weights[:pick] > 0)
    return int(before[-1]) if len(before) else pick + 1 + int(np.flatnonzero(weights[pick + 1:] > 0)[0])


def _kept(weights: np.ndarray, total: float, top_k: int, top_p: float) -> np.ndarray:
    """The ids top-k and top-p keep: the top_k best, cut where the mass before a token (of the whole
    distribution) reaches top_p; at least the best token. Only candidates are sorted: the
    NUCLEUS_PROBES best while the nucleus fits in them; a wider one is found from the sorted values
    (every token at least as likely as the last one kept; the ids then unsorted)."""
    vocab = weights.shape[0]
    for probe in (n for n in (*NUCLEUS_PROBES, top_k) if n <= top_k and n < vocab):
        ids = np.argpartition(weights, vocab - probe)[vocab - probe:]
        ids = ids[np.argsort(-weights[ids], kind="stable")]  # best first
        if top_p >= 1:
            return ids
        before = (np.cumsum(weights[ids], dtype=np.float64) - weights[ids]) / total
        cut = int(np.searchsorted(before, top_p, side="left"))
        if cut < len(ids) or probe == top_k:
            return ids[:max(1, cut)]
    best = np.sort(weights)[::-1][:top_k]  # values only: a vectorized sort, far faster than argsort
    before = (np.cumsum(best, dtype=np.float64) - best) / total
    cut = max(1, int(np.searchsorted(before, top_p, side="left")))
    return np.flatnonzero(weights >= best[cut - 1])
