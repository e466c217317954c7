"""Speculative decoding (engine/speculative.py) with n-gram drafts and with a draft model
(engine/draft.py): exact, token for token, and sampled output with its distribution.

A random tiny model's greedy output almost never repeats itself, so nothing would be drafted, or
accepted. `few_token_model` keeps 12 rows of the output head (6 random ones and their negatives,
so that one of them always has a positive logit) and zeroes the rest: the model then speaks in
12 tokens, repeats n-grams of its own, and drafts are accepted and rejected in the same run. A
draft model is either the target itself (every guess accepted) or `other_draft`, another random
tiny Llama with the same tokenizer cut to the same 12 tokens (a guess accepted now and then).
"""

from __future__ import annotations

import random
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from engine import LLM, AsyncEngine, EngineConfig, SamplingParams
from engine.model.loading import load_model
from engine.request import Constraint
from engine.runner.step_output import StepOutput
from engine.sampler import Sampler
from engine.speculative import DraftState, NgramIndex, Speculator
from tests.test_app_cli import run_app
from tests.tiny_models import build_tiny_model

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


def perturbed_model(src: Path, dst: Path, noise: float = 0.1) -> Path:
    """`src` with gaussian noise of `noise` times each weight tensor's spread added (seeded): a draft
    that agrees with its target often but not always."""
    if not (dst / "config.json").exists():
        model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
        generator = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for param in model.parameters():
                if param.numel() > 1 and param.std() > 0:
                    param.add_(noise * param.std() * torch.randn(param.shape, generator=generator))
        model.save_pretrained(dst)
        AutoTokenizer.from_pretrained(src).save_pretrained(dst)
    return dst


@pytest.fixture(scope="module")
def near(few, tmp_path_factory):
    """`near(arch)`: the few-token `arch` model, its weights perturbed: a draft of the same family."""
    root = tmp_path_factory.mktemp("near_draft")
    return lambda arch="llama": perturbed_model(few(arch), root / arch)


@pytest.fixture(scope="module")
def other_draft(tiny_model, tmp_path_factory):
    """Another random tiny Llama (seed 1) with the tiny models' tokenizer, cut to the same 12 tokens."""
    root = tmp_path_factory.mktemp("other_draft")
    build_tiny_model("llama", root / "llama", tokenizer=AutoTokenizer.from_pretrained(tiny_model("llama")), seed=1)
    return few_token_model(root / "llama", root / "few")


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
    assert NgramIndex().propose([5, 6, 7, 5, 6, 7], 4) == [5, 6, 7]  # the continuation stops at the end
    # a match of the shortest length (2) guesses one token: in open-ended text it is mostly chance
    assert NgramIndex().propose([5, 6, 8, 9, 4, 5, 6], 4) == [8]


# the native step (Llama, Mistral's sliding window, Qwen2's q/k/v biases, Qwen3's q/k norms); the
# modules (GPT-2, Gemma 2's softcaps)
@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3norm", "gpt2", "gemma2"])
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


@pytest.mark.parametrize("mode", ["ngram", "draft"])
def test_drafts_stop_above_speculative_max_seqs(few, mode):
    path = few("llama")
    draft = {"draft_model": str(path)} if mode == "draft" else {}
    llm = LLM(load_model(str(path)), EngineConfig(speculative=mode, speculative_max_seqs=2, **draft))
    for i, prompt in enumerate(prompts_of((40, 40, 40))):
        llm.core.add_request(f"r{i}", prompt, SamplingParams(max_tokens=30, temperature=0))
    for _ in range(20):
        llm.core.step()
    assert llm.core.stats().spec_draft_tokens == 0  # three running: each token took its own step
    if mode == "draft":  # nor did the draft model compute anything
        assert not llm.core.speculator.drafter.shadows


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


def test_the_engine_config_checks_the_draft_model_setting():
    with pytest.raises(ValueError, match="speculative='draft' needs draft_model"):
        EngineConfig(speculative="draft")
    with pytest.raises(ValueError, match="draft_model is only used with speculative='draft'"):
        EngineConfig(speculative="ngram", draft_model="x")
    with pytest.raises(ValueError, match="speculative must be one of off, ngram, draft"):
        EngineConfig(speculative="eagle")


@pytest.mark.parametrize("mode", ["ngram", "draft"])
def test_greedy_over_http_equals_the_server_without_drafts(server_with, few, other_draft, mode):
    path = few("llama")
    flags = ("--speculative", "ngram") if mode == "ngram" else \
        ("--speculative", "draft", "--draft-model", str(other_draft), "--num-speculative-tokens", "2")
    spec = server_with(*flags, model=path)
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
    assert health["speculative"]["mode"] == mode
    assert health["speculative"]["draft_model"] == (None if mode == "ngram" else "few")
    assert health["speculative"]["accepted_tokens"] == values["rill_spec_accepted_tokens_total"]
    assert health["speculative"]["draft_prefix_cache_hit_tokens"] == (None if mode == "ngram" else 0)
    if mode == "draft":  # the same prompt again: the draft starts from its own cached blocks of it
        again = httpx.post(f"{spec.url}/v1/completions", timeout=120, json={
            "prompt": prompts_of((30, 100))[1], "max_tokens": 40, "temperature": 0}).json()
        assert again["choices"][0]["text"] == texts["plain"][1]
        health = httpx.get(f"{spec.url}/health", timeout=30).json()
        assert health["speculative"]["draft_prefix_cache_hit_tokens"] >= 96  # 6 full blocks of 16 of 100 tokens


# ---- drafts from a second model ---------------------------------------------------------------


@pytest.mark.parametrize("arch, drafter", [
    ("llama", "itself"), ("llama", "near"), ("llama", "other"),  # the native step, for the target and the draft
    ("qwen3norm", "near"), ("mistral", "near"),  # Qwen3's q/k norms; a sliding window
    ("gpt2", "itself"), ("gpt2", "near"),  # the target and the draft through their modules
])
def test_greedy_with_a_draft_model_equals_generate(few, near, other_draft, arch, drafter):
    """Four prompts at once (prompt chunks of 64 tokens beside verified drafts, the draft computing
    a long prompt over several steps): the tokens of `generate`. A model drafting for itself has
    every guess accepted; a perturbed copy of it many, another random model few, the rest rolled
    back in both KV caches."""
    path = few(arch)
    draft = {"itself": path, "near": near(arch), "other": other_draft}[drafter]
    prompts = prompts_of((5, 30, 100, 200))
    refs = generate_reference(path, prompts, 40)
    got, llm = run(path, prompts, SamplingParams(max_tokens=40, temperature=0), speculative="draft",
                   draft_model=str(draft), speculative_max_seqs=8, max_num_batched_tokens=64)
    for n, g, r in zip(map(len, prompts), got, refs):
        assert g == r, f"{arch} drafted for by {drafter}: prompt of {n} tokens diverged"
    stats = llm.core.stats()
    if drafter == "itself":
        assert stats.spec_accepted_tokens == stats.spec_draft_tokens > 80
    elif drafter == "near":
        assert 0 < stats.spec_accepted_tokens < stats.spec_draft_tokens
    else:
        assert stats.spec_accepted_tokens < stats.spec_draft_tokens / 3
    drafter = llm.core.speculator.drafter
    assert llm.core.allocator.num_free == llm.core.num_kv_blocks  # every block came back, in both pools
    assert drafter.allocator.num_free == drafter.num_kv_blocks and not drafter.shadows


def as_bfloat16(src: Path, dst: Path) -> Path:
    """`src` saved with bfloat16 weights, as a Hub checkpoint is published."""
    if not (dst / "config.json").exists():
        AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).to(torch.bfloat16).save_pretrained(dst)
        AutoTokenizer.from_pretrained(src).save_pretrained(dst)
    return dst


def test_a_bfloat16_checkpoint_drafts_for_one_with_its_weights_kept(few, near, tmp_path):
    """Target and draft both bfloat16 folders: both loaded lean onto the 16-bit panels, the
    tokens of `generate` on the target (its bfloat16 weights widened, exactly), guesses accepted and
    rolled back."""
    target, draft = as_bfloat16(few(), tmp_path / "target"), as_bfloat16(near(), tmp_path / "draft")
    prompts = prompts_of((5, 30, 100, 200))
    refs = generate_reference(target, prompts, 40)
    got, llm = run(target, prompts, SamplingParams(max_tokens=40, temperature=0), speculative="draft",
                   draft_model=str(draft), speculative_max_seqs=8, max_num_batched_tokens=64)
    assert got == refs
    drafter = llm.core.speculator.drafter
    for model in (llm.core.model, drafter.runner.model):
        panels = [m.panels for m in model.modules() if getattr(m, "panels", None) is not None]
        assert panels and all(p.dtype == torch.bfloat16 for p in panels)
    stats = llm.core.stats()
    assert 0 < stats.spec_accepted_tokens < stats.spec_draft_tokens


def test_the_draft_model_computes_each_prompt_once_beside_the_target(few):
    """A prompt's tokens go through the draft in the steps the target computes them (chunks of the
    step's budget), never again: after that each step's first draft forward takes only the tokens
    the target added (1 or 2)."""
    path = few("llama")
    llm = LLM(load_model(str(path)), EngineConfig(speculative="draft", draft_model=str(path),
                                                  max_num_batched_tokens=64))
    runner, chunks = llm.core.speculator.drafter.runner, []
    run_draft = runner.run
    runner.run = lambda plan: (chunks.extend((c.start, c.num_tokens) for c in plan), run_draft(plan))[1]
    steps = []
    run_target = llm.core.runner.run
    llm.core.runner.run = lambda plan: (steps.append(len(chunks)), run_target(plan))[1]
    prompt = prompts_of((150,), seed=2)[0]
    llm.generate([prompt], SamplingParams(max_tokens=20, temperature=0))
    assert [c for c in chunks if c[1] > 2] == [(0, 64), (64, 64), (128, 21)]  # the prompt but its last token
    assert steps[:3] == [1, 2, 3]  # each chunk in the step the target computed the same tokens
    assert sum(n for _, n in chunks) < 150 + 20 + 20  # each token computed once, and each guess


def test_the_draft_model_starts_a_later_turn_from_its_own_cached_prefix(few):
    """A request that starts with an earlier one's prompt and answer (a chat's next turn): the draft
    takes the blocks it computed for them from its own prefix cache and computes only the rest; a
    request with another cache salt shares none of them. The tokens are generate's either way."""
    path = few("llama")
    llm = LLM(load_model(str(path)), EngineConfig(speculative="draft", draft_model=str(path),
                                                  max_num_batched_tokens=64))
    drafter = llm.core.speculator.drafter
    runner, chunks = drafter.runner, []
    run_draft = runner.run
    runner.run = lambda plan: (chunks.extend((c.start, c.num_tokens) for c in plan), run_draft(plan))[1]
    greedy = SamplingParams(max_tokens=20, temperature=0)
    first = prompts_of((150,), seed=2)[0]
    answer = llm.generate([first], greedy)[0].token_ids
    second = first + answer + prompts_of((30,), seed=3)[0]
    block = llm.core.config.block_size
    for salt, cached in ((None, (len(first) + len(answer) - 1) // block * block), ("another visitor", 0)):
        chunks.clear()
        hits = drafter.allocator.hit_tokens
        params = SamplingParams(max_tokens=20, temperature=0, cache_salt=salt)
        assert llm.generate([second], params)[0].token_ids == generate_reference(path, [second], 20)[0]
        assert drafter.allocator.hit_tokens - hits == cached
        assert min(start for start, _ in chunks) == cached  # the draft computed from there on only
    assert drafter.allocator.num_free == drafter.num_kv_blocks and not drafter.shadows  # cached blocks are free to take


def test_a_seeded_request_gives_the_same_tokens_with_a_draft_model(few, other_draft):
    """Seeded rows take the draft's argmax as a point mass: the target's own draws decide, as without."""
    path = few("llama")
    prompts = prompts_of((50, 120))
    params = [SamplingParams(max_tokens=40, temperature=1.0, top_k=5, top_p=0.9, seed=seed)
              for seed in range(3) for _ in prompts]
    plain, _ = run(path, prompts * 3, params, max_num_seqs=3)
    for draft in (path, other_draft):
        drafted, llm = run(path, prompts * 3, params, max_num_seqs=3, speculative="draft", draft_model=str(draft))
        assert drafted == plain
        assert llm.core.stats().spec_accepted_tokens > 0


def test_the_rejection_rule_with_draft_probabilities_keeps_the_target_distribution():
    """A 1-token draft drawn from q0 (unlike p0) over fixed logits: the first emitted token follows
    p0 (the guess kept with probability min(1, p0/q0), else a draw from max(0, p0 - q0)), the token
    after a kept guess follows p1, and guesses are kept at the rate sum(min(p0, q0))."""
    logits = torch.tensor([[2.0, 1.5, 1.0, 0.5, 0.0, -0.5, 1.2, 0.3, -1.0, 0.8],
                           [0.0, 1.0, 2.0, 0.5, 1.5, -0.5, 0.2, 0.3, 1.1, -2.0]])
    params = SamplingParams(temperature=1.0, top_k=8, max_tokens=8)
    want = [_processed(row, params) for row in logits.numpy()]
    q0 = _processed(np.array([0.0, 2.5, 0.5, 1.5, 0.0, 1.0, -1.0, 0.0, 0.5, 2.0]), params)
    sampler, spec, seq, rng = Sampler([], seed=1), Speculator(2, 4), _Seq(params), np.random.default_rng(0)
    trials = 20000
    first, second = np.zeros(10), np.zeros(10)
    for _ in range(trials):
        guess = int(rng.choice(10, p=q0))
        spec.states[seq.seq_id] = DraftState(draft_probs=[q0])
        tokens = spec.verify(StepOutput(logits.clone()), seq, (guess,), sampler)
        first[tokens[0]] += 1
        if len(tokens) == 2:
            second[tokens[1]] += 1
    assert 0.5 * np.abs(first / trials - want[0]).sum() < 0.015  # total variation, 20000 draws
    assert 0.5 * np.abs(second / second.sum() - want[1]).sum() < 0.03
    assert abs(spec.accepted_tokens_total / trials - np.minimum(want[0], q0).sum()) < 0.015


def test_sampled_tokens_with_a_draft_model_keep_their_distribution(few, other_draft):
    """Unseeded sampling with guesses drawn from another model (most rejected, the residual drawn
    instead): over 600 requests the 2nd and 3rd tokens' frequencies fit the exact marginals of the
    target, computed with transformers (chi-square, p > 1e-4; the engine's seed makes it repeatable)."""
    path = few("llama")
    prompt = prompts_of((12,), seed=7)[0]
    params = SamplingParams(max_tokens=3, temperature=1.0, top_k=6)
    trials = 600
    got, llm = run(path, [prompt] * trials, params, max_num_seqs=4, speculative="draft",
                   draft_model=str(other_draft), num_speculative_tokens=2)
    stats = llm.core.stats()
    assert 0 < stats.spec_accepted_tokens < stats.spec_draft_tokens
    marginals = _exact_marginals(path, prompt, params, 3)
    for position in (1, 2):
        counts = np.bincount([tokens[position] for tokens in got], minlength=len(marginals[position]))
        expected = trials * marginals[position]
        assert counts[expected == 0].sum() == 0, f"token {position + 1}: a token the target cannot draw"
        big = expected >= 5  # the rarer tokens pooled into one cell, as the chi-square test needs
        observed = np.append(counts[big], counts[~big].sum())
        expected = np.append(expected[big], expected[~big].sum())
        statistic = float(((observed - expected) ** 2 / expected).sum())
        assert statistic < _chi2_bound(int(big.sum())), f"token {position + 1}: chi-square {statistic:.1f}"


def test_a_model_drafting_for_itself_keeps_its_sampled_guesses(few):
    """q = p (up to a batched forward's rounding): min(1, p/q) keeps every drawn guess, where a point
    mass would keep only p(guess) of them."""
    path = few("llama")
    params = SamplingParams(max_tokens=30, temperature=1.0, top_k=6)
    _, llm = run(path, prompts_of((20, 40, 60, 80)), params, speculative="draft", draft_model=str(path))
    stats = llm.core.stats()
    assert stats.spec_draft_tokens > 40 and stats.spec_accepted_tokens >= 0.98 * stats.spec_draft_tokens


def test_a_rebuilt_engine_drafts_with_the_same_draft_model(few, near):
    """After a death the core is rebuilt over the same loaded draft: the old draft's KV pool let go,
    a new one drafting, the tokens those of a plain engine."""
    path = few("llama")
    prompt = prompts_of((60,), seed=9)[0]
    params = SamplingParams(max_tokens=30, temperature=0)
    engine = AsyncEngine(load_model(str(path)), EngineConfig(speculative="draft", draft_model="near"),
                         load_model(str(near("llama"))))  # not started: the test steps its core
    old = engine.core.speculator.drafter
    assert engine._restart()
    assert old.runner is None and engine.core.speculator.drafter is not old
    engine.core.add_request("r", prompt, params)
    tokens = []
    while engine.core.has_work():
        tokens += [t for out in engine.core.step() for t in out.token_ids]
    assert tokens == run(path, [prompt], params)[0][0]
    assert engine.core.stats().spec_accepted_tokens > 0


def test_a_draft_model_with_another_tokenizer_is_refused(tiny_model, few):
    """The tiny "qwen3" adds 4 tokens to the tiny models' tokenizer: load_draft refuses it in one
    line, and app.py exits 2 with that line, as for any model that does not load."""
    from engine.draft import load_draft
    from engine.model.loading import ModelLoadError

    with pytest.raises(ModelLoadError, match="same tokenizer"):
        load_draft(str(tiny_model("qwen3")), load_model(str(few("llama"))))
    result = run_app("--model", str(few("llama")), "--speculative", "draft", "--draft-model",
                     str(tiny_model("qwen3")), "--port", "7999", timeout=120)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("app.py: error:")]
    assert len(errors) == 1 and "--draft-model" in errors[0] and "same tokenizer" in errors[0], result.stderr


def _exact_marginals(path: Path, prompt: list[int], params, num_tokens: int) -> list[np.ndarray]:
    """The distribution of each of the first `num_tokens` sampled tokens, summed over the paths
    before it, from the model's own forward (every path at once: the few-token head keeps them few)."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    paths = {(): 1.0}
    marginals = []
    for _ in range(num_tokens):
        contexts = list(paths)
        with torch.no_grad():
            rows = model(torch.tensor([prompt + list(c) for c in contexts])).logits[:, -1].numpy()
        marginal = np.zeros(rows.shape[1])
        following = {}
        for context, row in zip(contexts, rows):
            p = _processed(row, params)
            marginal += paths[context] * p
            for token in np.flatnonzero(p):
                following[context + (int(token),)] = paths[context] * p[token]
        marginals.append(marginal)
        paths = following
    return marginals


def _chi2_bound(df: int, z: float = 3.72) -> float:
    """The chi-square value with upper tail about 1e-4 for `df` degrees of freedom (Wilson-Hilferty)."""
    return df * (1 - 2 / (9 * df) + z * (2 / (9 * df)) ** 0.5) ** 3
