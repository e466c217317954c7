"""The sampler's C kernel (engine/kernels/sampling.py): the tokens of the numpy reference from the
same seeds over random rows and settings, and what each setting does on the kernel's path."""

import math

import numpy as np
import pytest
import torch

from engine.request import SamplingParams, Sequence
from engine.sampler import Sampler

VOCAB = 49152
EOS = 7


def _native(seed: int = 0) -> Sampler:
    sampler = Sampler([EOS], seed=seed)
    assert sampler.kernel is not None, "the sampling kernel did not build or disagreed with the reference"
    return sampler


def _seq(name: str, history: list[int], prompt: int, **params) -> Sequence:
    return Sequence(name, "r", 0, list(history), prompt, SamplingParams(max_tokens=64, **params))


def test_tokens_equal_the_reference_over_random_rows_and_settings():
    rng = np.random.default_rng(7)
    native, reference = _native(seed=3), Sampler([EOS], seed=3, use_kernel=False)
    for batch in range(80):
        rows, vocab = int(rng.integers(1, 6)), int(rng.choice([64, 3000, VOCAB]))
        logits = torch.from_numpy((rng.standard_normal((rows, vocab)) * rng.choice([1, 3, 8])).astype(np.float32))
        seqs = []
        for i in range(rows):
            params = dict(
                temperature=float(rng.choice([0, 0.05, 0.3, 0.7, 1.0, 1.5])),
                top_k=int(rng.choice([0, 0, 1, 5, 50, 300, 5000])), top_p=float(rng.choice([1, 1, 0.5, 0.9, 0.999])),
                min_p=float(rng.choice([0, 0, 0.05, 0.3])), repetition_penalty=float(rng.choice([1, 1.3])),
                frequency_penalty=float(rng.choice([0, 0.5])), presence_penalty=float(rng.choice([0, -0.3])),
                seed=None if rng.random() < 0.5 else int(rng.integers(1000)), min_tokens=int(rng.choice([0, 0, 50])))
            seqs.append(_seq(f"b{batch}r{i}", rng.integers(0, vocab, 40).tolist(), 25, **params))
        assert native.sample(logits, seqs).token_ids == reference.sample(logits, seqs).token_ids, \
            [s.params for s in seqs]
    # the kernel drew (nearly) every row itself: the reference settled a handful at most
    assert native.resolved > 150 and native.unresolved <= native.resolved // 50, (native.resolved, native.unresolved)


def test_a_seeded_request_draws_the_same_tokens_with_and_without_the_kernel():
    logits = torch.randn(VOCAB, generator=torch.Generator().manual_seed(1)) * 3
    tokens = []
    for sampler in (_native(), Sampler([EOS], use_kernel=False)):
        seq = _seq("s", [1, 2, 3], 3, temperature=0.8, top_p=0.95, seed=1234)
        drawn = []
        for step in range(12):  # each step's row shifted a little, the output growing
            row = (logits + step * 0.01).unsqueeze(0)
            drawn.append(sampler.sample(row, [seq]).token_ids[0])
            seq.token_ids.append(drawn[-1])
        tokens.append(drawn)
    assert tokens[0] == tokens[1]


@pytest.mark.parametrize("params", [dict(top_k=1), dict(top_p=1e-6), dict(min_p=1.0)])
def test_top_k_1_a_tiny_top_p_and_min_p_1_draw_the_argmax(params):
    sampler = _native()
    logits = torch.randn(8, VOCAB, generator=torch.Generator().manual_seed(2)) * 2
    seqs = [_seq(f"s{i}", [1], 1, temperature=1.5, seed=i, **params) for i in range(8)]
    assert sampler.sample(logits, seqs).token_ids == logits.argmax(dim=1).tolist()
    assert sampler.resolved == 8


def _four_tokens() -> torch.Tensor:
    """Probabilities 0.5, 0.3, 0.15, 0.05 on tokens 10-13 at temperature 1; every other token never comes."""
    row = torch.full((VOCAB,), -1e9)
    row[10:14] = torch.tensor([math.log(p) for p in (0.5, 0.3, 0.15, 0.05)])
    return row


@pytest.mark.parametrize("params, kept", [(dict(min_p=0.5), {10, 11}), (dict(top_k=3), {10, 11, 12}),
                                          (dict(top_p=0.7), {10, 11}), (dict(), {10, 11, 12, 13})])
def test_each_filter_keeps_its_tokens(params, kept):
    sampler = _native()
    rows = 400
    seqs = [_seq(f"s{i}", [1], 1, temperature=1.0, **params) for i in range(rows)]
    drawn = sampler.sample(_four_tokens().expand(rows, -1).contiguous(), seqs).token_ids
    assert set(drawn) == kept
    assert sampler.resolved == rows


def test_penalties_and_the_min_tokens_ban_move_a_greedy_row_off_its_argmax():
    sampler = _native()
    logits = torch.zeros(5, VOCAB)
    logits[:, 100], logits[:, 200], logits[:, EOS] = 5.0, 4.0, 3.0
    logits[4, EOS] = 9.0
    seqs = [
        _seq("repeated", [100, 1, 2], 3, temperature=0, repetition_penalty=2.0),  # 5 / 2 < 4
        _seq("present", [1, 100], 1, temperature=0, presence_penalty=1.5),  # 5 - 1.5 < 4
        _seq("frequent", [1, 100, 100], 1, temperature=0, frequency_penalty=0.6),  # 5 - 2 * 0.6 < 4
        _seq("only in the prompt", [100, 1], 2, temperature=0, presence_penalty=1.5),  # not an output token
        _seq("too short to end", [1, 2], 2, temperature=0, min_tokens=3),  # EOS hidden
    ]
    assert sampler.sample(logits, seqs).token_ids == [200, 200, 200, 100, 100]
    # the same with sampling at a low temperature: the penalized token no longer comes
    hot = [_seq(f"t{i}", [100], 0, temperature=0.05, repetition_penalty=3.0, seed=i) for i in range(20)]
    assert set(sampler.sample(logits[:1].expand(20, -1).contiguous(), hot).token_ids) == {200}
