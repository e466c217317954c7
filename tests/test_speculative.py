"""Speculative decoding with n-gram drafts (engine/speculative.py): exact, token for token.

A random tiny model's greedy output almost never repeats itself, so nothing would be drafted, or
accepted. `few_token_model` keeps 12 rows of the output head (6 random ones and their negatives,
so that one of them always has a positive logit) and zeroes the rest: the model then speaks in
12 tokens, repeats n-grams of its own, and drafts are accepted and rejected in the same run.
"""

from __future__ import annotations

import random
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from engine import LLM, EngineConfig, SamplingParams
from engine.model.loading import load_model
from engine.request import Constraint
from engine.runner.step_output import StepOutput
from engine.sampler import Sampler
from engine.speculative import NgramIndex, Speculator

FEW = 6  # the kept head rows are ids 3..3+2*FEW-1


def few_token_model(src: Path, dst: Path, scale: float = 3.0) -> Path:
    if not (dst / "config.json").exists():
        model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
        head = model.get_output_embeddings().weight
        with torch.no_grad():
            keep = head[3:3 + FEW].clone() * scale
            head.zero_()
            head[3:3 + FEW] = keep
            head[3 + FEW:3 + 2 * FEW] = -keep
        model.save_pretrained(dst)
        AutoTokenizer.from_pretrained(src).save_pretrained(dst)
    return dst


@pytest.fixture(scope="module")
def few(tiny_model, tmp_path_factory):
    root = tmp_path_factory.mktemp("few_token")
    return lambda arch="llama": few_token_model(tiny_model(arch), root / arch)


def prompts_of(lengths=(5, 30, 100, 200), seed=0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 3 + 2 * FEW) for _ in range(n)] for n in lengths]


def generate_reference(path: Path, prompts, max_tokens: int) -> list[list[int]]:
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    outs = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens, do_sample=False)
        outs.append(out[0, len(prompt):].tolist())
    return outs


def run(path, prompts, params, **config) -> tuple[list[list[int]], LLM]:
    llm = LLM(load_model(str(path)), EngineConfig(**config))
    results = llm.generate(prompts, params)
    return [r.token_ids for r in results], llm


def test_the_ngram_index_proposes_what_followed_the_longest_suffix():
    index = NgramIndex()
    tokens = [1, 2, 3, 4, 9, 2, 3, 5, 7, 1, 2, 3]
    assert index.propose(tokens, 3) == [4, 9, 2]  # (1, 2, 3) beats (2, 3), which last came before 5
    tokens += [9, 2, 3]  # the suffix (9, 2, 3) occurred once, (2, 3) last before 9
    assert index.propose(tokens, 3) == [5, 7, 1]
    assert index.propose(tokens + [8, 8], 3) == []  # (4, 8) and (8, 8) never occurred before
    assert NgramIndex().propose([5, 6, 5, 6], 4) == [5, 6]  # the continuation stops at the end


@pytest.mark.parametrize("arch", ["llama", "gpt2", "mistral"])  # the native step; the modules; a sliding window
def test_greedy_with_drafts_equals_generate_alone_and_in_a_busy_batch(few, arch):
    path = few(arch)
    prompts = prompts_of((5, 30, 100, 200, 3, 64, 17, 150))
    refs = generate_reference(path, prompts, 40)
    params = SamplingParams(max_tokens=40, temperature=0)
    # 8 at once, prompt chunks of 64 tokens beside the others' verified drafts
    got, llm = run(path, prompts, params, speculative="ngram", speculative_max_seqs=8, max_num_batched_tokens=64)
    for n, g, r in zip(map(len, prompts), got, refs):
        assert g == r, f"{arch}: prompt of {n} tokens diverged with drafts"
    stats = llm.core.stats()
    assert 0 < stats.spec_accepted_tokens < stats.spec_draft_tokens  # drafts kept and drafts rolled back
    assert llm.core.allocator.num_free == llm.core.num_kv_blocks  # every block came back
    accepted = 0
    for prompt, ref in zip(prompts[:3], refs):  # alone
        alone, llm = run(path, [prompt], params, speculative="ngram")
        assert alone == [ref]
        accepted += llm.core.stats().spec_accepted_tokens
    assert accepted > 0


def test_a_cached_prefix_never_holds_a_rejected_token(few):
    """A follow-up whose prompt is the first answer's context reuses its cached blocks (hashed only
    once drafts are settled): its tokens are the ones an engine without drafts gives."""
    path = few("llama")
    first = prompts_of((90,), seed=3)[0]
    params = SamplingParams(max_tokens=70, temperature=0)
    llm = LLM(load_model(str(path)), EngineConfig(speculative="ngram", block_size=4))
    answer = llm.generate([first], params)[0].token_ids
    follow_up = first + answer + prompts_of((7,), seed=4)[0]
    again = llm.generate([follow_up], params)[0].token_ids
    stats = llm.core.stats()
    assert stats.prefix_cache_hit_tokens >= len(first) + len(answer) - 8
    assert stats.spec_draft_tokens > stats.spec_accepted_tokens > 0
    plain, _ = run(path, [first, follow_up], params, block_size=4)
    assert [answer, again] == plain


def test_drafts_stop_above_speculative_max_seqs(few):
    path = few("llama")
    llm = LLM(load_model(str(path)), EngineConfig(speculative="ngram", speculative_max_seqs=2))
    for i, prompt in enumerate(prompts_of((40, 40, 40))):
        llm.core.add_request(f"r{i}", prompt, SamplingParams(max_tokens=30, temperature=0))
    for _ in range(20):
        llm.core.step()
    assert llm.core.stats().spec_draft_tokens == 0  # three running: each token took its own step


def test_requests_drawn_step_by_step_are_not_drafted_and_keep_their_tokens(few):
    """logprobs, penalties, min_tokens and a grammar read more than the logits at each position:
    they are not drafted, and give the tokens they give without speculation."""
    path = few("llama")
    prompts = prompts_of((60,), seed=5)
    cases = [SamplingParams(max_tokens=30, temperature=0, logprobs=2),
             SamplingParams(max_tokens=30, temperature=0, repetition_penalty=1.3),
             SamplingParams(max_tokens=30, temperature=0, presence_penalty=0.5),
             SamplingParams(max_tokens=30, temperature=0, min_tokens=30, ignore_eos=False),
             SamplingParams(max_tokens=30, temperature=0, constraint=Constraint("regex", "[^x]*"))]
    for params in cases:
        got, llm = run(path, prompts, params, speculative="ngram")
        assert llm.core.stats().spec_draft_tokens == 0, params
        assert got == run(path, prompts, params)[0], params


def test_stop_strings_and_max_tokens_inside_a_draft(few):
    path = few("llama")
    prompts = prompts_of((100, 200))
    plain = LLM(load_model(str(path))).generate(prompts, SamplingParams(max_tokens=50, temperature=0))
    stops = tuple(r.text[len(r.text) // 2:][:6] for r in plain)  # somewhere in the middle of each answer
    for max_tokens in (7, 50):
        params = SamplingParams(max_tokens=max_tokens, temperature=0, stop=stops)
        want = LLM(load_model(str(path))).generate(prompts, params)
        llm = LLM(load_model(str(path)), EngineConfig(speculative="ngram"))
        got = llm.generate(prompts, params)
        assert [(r.text, r.token_ids, r.finish_reason) for r in got] == \
            [(r.text, r.token_ids, r.finish_reason) for r in want]
        assert llm.core.allocator.num_free == llm.core.num_kv_blocks


@pytest.mark.parametrize("temperature, top_k, top_p", [(0.7, 0, 1.0), (1.0, 5, 0.9)])
def test_a_seeded_request_gives_the_same_tokens_with_drafts(few, temperature, top_k, top_p):
    """Each emitted token takes one draw of the request's generator, drafted or not, through the
    same inverse CDF: the same seed gives the same tokens."""
    path = few("llama")
    prompts = prompts_of((50, 120))
    params = [SamplingParams(max_tokens=40, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
              for seed in range(8) for _ in prompts]
    both = prompts * 8
    plain, _ = run(path, both, params, max_num_seqs=4)
    drafted, llm = run(path, both, params, speculative="ngram", max_num_seqs=4)
    assert drafted == plain
    assert llm.core.stats().spec_accepted_tokens > 0


class _Seq:
    """What `Speculator.verify` reads of a sequence."""

    def __init__(self, params):
        self.params, self.seq_id, self.index = params, "s#0", 0


@pytest.mark.parametrize("temperature, top_k, top_p", [(1.0, 0, 1.0), (0.8, 6, 0.9)])
def test_the_acceptance_rule_keeps_the_target_distribution(temperature, top_k, top_p):
    """Unseeded draws of a 1-token draft over fixed logits (10 tokens): the first emitted token
    follows the processed distribution p0 (the draft's first token accepted with probability
    p0(d0), else a token from p0 without d0), and the token after an accepted d0 follows p1."""
    logits = torch.tensor([[2.0, 1.5, 1.0, 0.5, 0.0, -0.5, 1.2, 0.3, -1.0, 0.8],
                           [0.0, 1.0, 2.0, 0.5, 1.5, -0.5, 0.2, 0.3, 1.1, -2.0]])
    draft = (1,)  # two rows: the last token's and the draft's
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, max_tokens=8)
    sampler, spec = Sampler([], seed=1), Speculator(2, 4)
    want = [_processed(row, params) for row in logits.numpy()]
    trials = 20000
    first, second = np.zeros(10), np.zeros(10)
    for _ in range(trials):
        tokens = spec.verify(StepOutput(logits.clone()), _Seq(params), draft, sampler)
        first[tokens[0]] += 1
        if tokens[0] == draft[0]:
            second[tokens[1]] += 1
    assert 0.5 * np.abs(first / trials - want[0]).sum() < 0.015  # total variation, 20000 draws
    assert 0.5 * np.abs(second / second.sum() - want[1]).sum() < 0.03
    assert spec.accepted_tokens_total / spec.draft_tokens_total > 0.1


def _processed(row: np.ndarray, params) -> np.ndarray:
    """The distribution the sampler draws from: temperature, then top-k, then top-p of the whole."""
    p = np.exp((row - row.max()) / params.temperature)
    p /= p.sum()
    order = np.argsort(-p, kind="stable")
    keep = order[:params.top_k] if params.top_k else order
    before = np.cumsum(p[keep]) - p[keep]
    keep = keep[:max(1, int(np.searchsorted(before, params.top_p, side="left")))]
    out = np.zeros_like(p)
    out[keep] = p[keep]
    return out / out.sum()


def test_the_engine_config_refuses_a_draft_model_for_now():
    with pytest.raises(ValueError, match="draft model .* not built yet"):
        EngineConfig(speculative="draft")
    with pytest.raises(ValueError, match="speculative must be one of off, ngram"):
        EngineConfig(speculative="eagle")


def test_greedy_over_http_equals_the_server_without_drafts(server_with, few):
    path = few("llama")
    spec = server_with("--speculative", "ngram", model=path)
    plain = server_with(model=path)
    texts = {}
    for name, server in (("spec", spec), ("plain", plain)):
        bodies = [httpx.post(f"{server.url}/v1/completions", timeout=120, json={
            "prompt": prompt, "max_tokens": 40, "temperature": 0}).json() for prompt in prompts_of((30, 100))]
        texts[name] = [b["choices"][0]["text"] for b in bodies]
    assert texts["spec"] == texts["plain"]
    metrics = httpx.get(f"{spec.url}/metrics", timeout=30).text
    values = {line.split()[0]: float(line.split()[1]) for line in metrics.splitlines()
              if line.startswith("rill_spec_")}
    assert values["rill_spec_accepted_tokens_total"] > 0
    assert values["rill_spec_draft_tokens_total"] > values["rill_spec_accepted_tokens_total"]
    health = httpx.get(f"{spec.url}/health", timeout=30).json()
    assert health["speculative"]["mode"] == "ngram"
    assert health["speculative"]["accepted_tokens"] == values["rill_spec_accepted_tokens_total"]
