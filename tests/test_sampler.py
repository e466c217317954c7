"""The batched sampler's draws: what temperature, top-k, top-p and min-p keep, and how often each
kept token comes (seeded, so every count below is the same on every run)."""

import math
from collections import Counter

import pytest
import torch

from engine.request import SamplingParams, Sequence
from engine.sampler import NUCLEUS_PROBES, Sampler

# probabilities 0.5, 0.3, 0.15, 0.05 at temperature 1, then tokens that never come (logits of -1e9: exp underflows to 0)
PROBS = [0.5, 0.3, 0.15, 0.05]


def _draws(logits: torch.Tensor, rows: int, engine_seed: int = 0, **params) -> Counter:
    """Token counts of `rows` draws from one row of logits [vocab]."""
    sampler = Sampler([logits.shape[0] - 1], seed=engine_seed)
    seqs = [Sequence(f"s{i}", "r", 0, [1, 2, 3], 3, SamplingParams(max_tokens=4, **params)) for i in range(rows)]
    return Counter(sampler.sample(logits.expand(rows, -1).contiguous(), seqs).token_ids)


def _four_tokens(vocab: int = 64, temperature: float = 1.0) -> torch.Tensor:
    logits = torch.full((vocab,), -1e9)
    logits[10:14] = torch.tensor([math.log(p) for p in PROBS]) * temperature
    return logits


def _close(counts: Counter, expected: dict[int, float], rows: int) -> None:
    assert set(counts) <= set(expected), f"drew tokens outside {sorted(expected)}: {counts}"
    for token, p in expected.items():
        # 4.5 standard deviations of a binomial count: a seeded draw, so it passes or fails every time
        assert abs(counts[token] - p * rows) <= 4.5 * math.sqrt(rows * p * (1 - p)) + 1, (token, counts, expected)


def test_temperature_draws_each_token_as_often_as_its_probability():
    rows = 4000
    _close(_draws(_four_tokens(), rows, temperature=1.0), dict(zip(range(10, 14), PROBS)), rows)
    # temperature 0.5 squares the probabilities before normalizing
    squared = [p * p for p in PROBS]
    expected = {10 + i: q / sum(squared) for i, q in enumerate(squared)}
    _close(_draws(_four_tokens(), rows, temperature=0.5), expected, rows)


@pytest.mark.parametrize("params, kept", [
    (dict(top_k=2), [10, 11]),
    (dict(top_p=0.7), [10, 11]),  # the mass before token 12 is 0.8 >= 0.7: it and the rest are dropped
    (dict(top_p=0.85), [10, 11, 12]),
    (dict(min_p=0.5), [10, 11]),  # 0.15 < 0.5 * 0.5
    (dict(top_k=1), [10]),
])
def test_top_k_top_p_and_min_p_keep_the_best_tokens_in_their_proportions(params, kept):
    rows = 3000
    total = sum(PROBS[t - 10] for t in kept)
    _close(_draws(_four_tokens(), rows, temperature=1.0, **params), {t: PROBS[t - 10] / total for t in kept}, rows)


def test_a_nucleus_wider_than_the_probe_keeps_every_token_of_it():
    # 49152 tokens, the first 8000 ten times as likely as the rest: top_p=0.5 keeps about 4,400 of
    # them (more than every probe: the sorted-values way), and never one of the unlikely ones
    vocab, likely = 49152, 8000
    logits = torch.zeros(vocab)
    logits[:likely] = math.log(10.0)
    counts = _draws(logits, 600, temperature=1.0, top_p=0.5)
    assert max(counts) < likely
    assert len(counts) > NUCLEUS_PROBES[0]  # drawn from well beyond the first probe


def test_seeded_rows_repeat_and_unseeded_rows_vary():
    logits = torch.randn(49152) * 3
    seeded = [_draws(logits, 1, engine_seed=s, temperature=1.0, top_p=0.95, seed=7) for s in range(3)]
    assert seeded[0] == seeded[1] == seeded[2]  # its own generator: the engine's seed does not matter
    unseeded = {tuple(_draws(logits, 1, engine_seed=s, temperature=1.0, top_p=0.95)) for s in range(12)}
    assert len(unseeded) > 1


def test_a_draw_never_lands_on_a_token_that_cannot_come():
    # every other token removed (as a grammar mask does, -inf), and draws at the very ends of [0, 1):
    # rounding in the sums must not pick a removed token
    from engine.sampler import _draw

    row = torch.randn(49152).numpy() * 3
    row[1::2] = float("-inf")
    for kw in (dict(), dict(top_p=0.9), dict(min_p=0.3), dict(top_k=7)):
        params = SamplingParams(max_tokens=4, temperature=0.8, **kw)
        for u in (0.0, 1e-300, 0.5, 1 - 1e-16, 0.9999999999):
            assert _draw(row, params, u) % 2 == 0, (kw, u)
