"""Greedy output of the engine equals Hugging Face `model.generate`, token for token (fp32, CPU).

16 prompts of 1 to 300 tokens run together through the engine (chunked prefill mixed with
decodes) and are compared with `generate(do_sample=False)` run on each prompt alone.
"""

import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine import LLM, EngineConfig, SamplingParams
from engine.model.loading import load_model

PROMPT_LENGTHS = [1, 2, 3, 5, 8, 13, 21, 34, 55, 89, 120, 150, 200, 233, 270, 300]
MAX_TOKENS = 24
NATIVE_ARCHS = ("llama", "mistral", "qwen2", "qwen3norm")  # their steps run in csrc/decode_layer.c


def make_prompts(vocab_size: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab_size) for _ in range(n)] for n in PROMPT_LENGTHS]  # 0..2 are special


def reference_outputs(path, prompts, device: str = "cpu", dtype=torch.float32) -> list[list[int]]:
    """`generate(do_sample=False)` on each prompt alone."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    outs = []
    for prompt in prompts:
        ids = torch.tensor([prompt], device=device)
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_TOKENS,
                                 do_sample=False)
        outs.append(out[0, len(prompt):].tolist())
    return outs


def engine_outputs(llm: LLM, prompts) -> list[list[int]]:
    results = llm.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0))
    return [r.token_ids for r in results]


_refs: dict[str, tuple] = {}


def prompts_and_refs(tiny_model, arch):
    if arch not in _refs:
        path = tiny_model(arch)
        loaded = load_model(str(path))
        prompts = make_prompts(len(loaded.tokenizer))
        _refs[arch] = (path, prompts, reference_outputs(path, prompts))
    return _refs[arch]


@pytest.mark.parametrize("arch, path_kind", [("llama", "paged"), ("mistral", "paged"), ("qwen2", "paged"),
                                             ("qwen3norm", "paged"), ("gpt2", "paged"), ("gemma2", "paged"),
                                             ("bloom", "fallback")])
def test_batched_greedy_equals_generate(tiny_model, arch, path_kind):
    path, prompts, refs = prompts_and_refs(tiny_model, arch)
    llm = LLM(load_model(str(path)), EngineConfig(max_num_batched_tokens=128))
    assert llm.core.attention_path == path_kind
    if path_kind == "paged":  # decodes go through the C kernel (needs a C compiler, as CI has)
        assert llm.core.runner.decode_kernel is not None, "the decode attention kernel was not built"
    assert llm.core.linears == "C kernel"  # every linear (needs the C compiler too)
    assert (getattr(llm.core.runner, "native", None) is not None) == (arch in NATIVE_ARCHS)
    assert llm.core.decode_attention == ("C (the native decode step)" if arch in NATIVE_ARCHS else
                                         "C kernel" if path_kind == "paged" else "transformers' own (the fallback path)")
    got = engine_outputs(llm, prompts)
    for n, g, r in zip(PROMPT_LENGTHS, got, refs):
        assert g == r, f"{arch}: prompt of {n} tokens diverged"
    assert llm.core.allocator.num_free == llm.core.num_kv_blocks  # every block came back


@pytest.mark.parametrize("native, limit", [(True, 1024), (True, 128), (False, 128)])
def test_native_decode_steps_equal_generate(tiny_model, native, limit):
    """Llama's steps in csrc/decode_layer.c (one C call per layer: decodes and prompt chunks of up
    to `native_prefill_tokens`), or through transformers' modules: the same tokens as `generate`,
    16 prompts at once (prefill chunks beside decodes). A limit of 128 (a step's prompt tokens
    attending to at most 128 x 128 positions in all) sends the longer prompts' later chunks to the
    modules, beside native steps; 1024 takes every step."""
    path, prompts, refs = prompts_and_refs(tiny_model, "llama")
    llm = LLM(load_model(str(path)), EngineConfig(max_num_batched_tokens=128, native_decode=native,
                                                  native_prefill_tokens=limit))
    assert (llm.core.runner.native is not None) == native
    assert engine_outputs(llm, prompts) == refs
    runner = llm.core.runner
    assert runner.prompt_tokens >= sum(PROMPT_LENGTHS) - 16  # chunks of one token count as decodes
    if native and limit < 1024:
        assert 0 < runner.native_prompt_tokens < runner.prompt_tokens
    else:
        assert runner.native_prompt_tokens == (runner.prompt_tokens if native else 0)
    assert engine_outputs(llm, prompts[:1]) == refs[:1]  # alone
    # the longest alone: its decode attention in ranges of positions over whole cache rows
    assert engine_outputs(llm, prompts[-1:]) == refs[-1:]


def test_the_kernels_portable_paths_equal_generate(tiny_model, portable_cache, monkeypatch, portable_kernels):
    """A CPU without AVX2 builds the same sources to GCC's generic vectors (`-march=x86-64`): the
    native steps, the linears and decode attention on those paths give `generate`'s tokens too."""
    cpu = portable_kernels
    monkeypatch.setenv("RILL_CACHE", str(portable_cache))
    path, prompts, refs = prompts_and_refs(tiny_model, "llama")
    llm = LLM(load_model(str(path)), EngineConfig(max_num_batched_tokens=128))
    assert llm.core.linears == "C kernel" and llm.core.runner.native is not None
    assert llm.core.runner.decode_kernel is not None
    kernel = llm.core.runner.decode_kernel
    assert portable_cache in kernel.path.parents  # the session's portable build, not found in the usual cache
    assert cpu.compiled_library(portable_cache)[0].rill_qlinear_vector_bits() == 0  # generic vectors, not this CPU's
    assert engine_outputs(llm, prompts) == refs


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3norm"])
def test_the_native_steps_rotary_table_holds_what_the_model_computes(tiny_model, arch):
    """The native step reads cos/sin from a table the model's rotary module filled once (growing
    past its first 512 positions): bit for bit what the module gives for the step's positions."""
    llm = LLM(load_model(str(tiny_model(arch))))
    native, rotary = llm.core.runner.native, llm.core.model.model.rotary_emb
    x = torch.zeros(1, llm.core.model.config.hidden_size)
    for positions in ([0], [7, 3, 511], [600, 2, 1500]):
        index = torch.tensor(positions)
        cos, sin = native._rope(x, index)
        want_cos, want_sin = rotary(x[None], index[None])
        assert torch.equal(cos, want_cos[0]) and torch.equal(sin, want_sin[0])
    assert native._rope_table[0].shape[0] >= 1501


def test_the_native_decoder_takes_only_what_it_computes(tiny_model):
    from engine.runner.native import why_not_native

    for arch in ("gemma2", "gpt2"):  # softcaps, norms around each block / LayerNorm, GELU, fused c_attn
        name = type(load_model(str(tiny_model(arch))).model).__name__
        assert why_not_native(load_model(str(tiny_model(arch))).model) == (
            f"{name} is not one of LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM")
    llama = LLM(load_model(str(tiny_model("llama"))), EngineConfig(linear_kernel=False))  # oneDNN linears
    assert llama.core.runner.native is None
    assert "is not on a C kernel" in why_not_native(llama.core.model)


@pytest.mark.parametrize("arch", ["llama", "mistral", "gemma2"])
def test_torch_decode_path_equals_generate(tiny_model, arch):
    """Without the C kernels (CUDA, bfloat16, no compiler): decode attention on the torch path,
    every linear on oneDNN: the same tokens."""
    path, prompts, refs = prompts_and_refs(tiny_model, arch)
    llm = LLM(load_model(str(path)), EngineConfig(max_num_batched_tokens=128, decode_kernel=False,
                                                  linear_kernel=False))
    assert llm.core.runner.decode_kernel is None and llm.core.linears == "oneDNN"
    assert llm.core.decode_attention == "torch (gathered per step)"
    assert engine_outputs(llm, prompts) == refs


class BlockTableAttention:
    """What the GPU's decode attention (engine/gpu.py) is handed, block tables rather than a slot
    per position, turned into attention in torch here (in the inputs' dtype and device): CI has no
    GPU, and this checks that the runner hands each decode its own blocks, length, query row and the
    step's longest context; tests/test_gpu.py holds the Triton kernel to it in float64."""

    reads = "blocks"
    path = "block tables, in torch (test)"

    def __init__(self):
        self.calls = 0

    def __call__(self, query, out, k_cache, v_cache, token_index, block_tables, block_size, context_lens,
                 scaling, window, softcap, max_context):
        assert max_context == int(context_lens.max()) and block_tables.dtype == torch.int32
        groups = query.shape[1] // k_cache.shape[1]
        for row in range(token_index.shape[0]):
            length, tok = int(context_lens[row]), int(token_index[row])
            pos = torch.arange(length, device=query.device)
            slots = block_tables[row].long()[pos // block_size] * block_size + pos % block_size
            k = k_cache[slots].repeat_interleave(groups, dim=1)  # [length, heads, D]
            v = v_cache[slots].repeat_interleave(groups, dim=1)
            scores = torch.einsum("hd,lhd->hl", query[0, :, tok], k) * scaling
            if softcap:
                scores = torch.tanh(scores / softcap) * softcap
            if window:
                scores[:, pos < length - window] = float("-inf")
            out[tok] = torch.einsum("hl,lhd->hd", torch.softmax(scores, dim=-1), v)
        self.calls += 1


@pytest.mark.parametrize("arch", ["llama", "mistral", "gemma2"])
def test_a_kernel_that_reads_block_tables_gets_each_decodes_own(tiny_model, arch):
    """The runner's side of the GPU kernel's interface, on the CPU: the same tokens as `generate`."""
    path, prompts, refs = prompts_and_refs(tiny_model, arch)
    llm = LLM(load_model(str(path)), EngineConfig(max_num_batched_tokens=128, native_decode=False))
    runner = llm.core.runner
    runner.decode_kernel, runner.kernel_reads_blocks = BlockTableAttention(), True
    assert engine_outputs(llm, prompts) == refs
    assert runner.decode_kernel.calls >= MAX_TOKENS * 2  # every decode step, in each of the 2 layers


@pytest.mark.parametrize("arch", ["llama", "mistral", "bloom"])
def test_parity_survives_preemption(tiny_model, arch):
    path, prompts, refs = prompts_and_refs(tiny_model, arch)
    # 40 blocks of 16 tokens: far less than 16 prompts need at once, so sequences get preempted
    llm = LLM(load_model(str(path)), EngineConfig(num_kv_blocks=40, block_size=16, max_num_batched_tokens=256))
    got = engine_outputs(llm, prompts)
    assert llm.core.scheduler.num_preemptions > 0
    assert got == refs
    assert llm.core.allocator.num_free == 40
    stats = llm.core.stats()  # recomputed prompt tokens are not counted twice
    assert stats.prompt_tokens_total == sum(len(p) for p in prompts), (stats.prefix_cache_hit_tokens, stats)


def test_mistral_sliding_window_is_exercised(tiny_model):
    """The window (32) really matters: full attention gives other tokens for long prompts."""
    path, prompts, refs = prompts_and_refs(tiny_model, "mistral")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model.config.sliding_window = None
    for layer in model.model.layers:
        layer.self_attn.sliding_window = None
    long_prompt = prompts[-1]
    ids = torch.tensor([long_prompt])
    with torch.no_grad():
        full = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_TOKENS, do_sample=False)
    assert full[0, len(long_prompt):].tolist() != refs[-1]


@pytest.mark.parametrize("arch", ["llama", "mistral"])
def test_prefix_cache_parity(tiny_model, arch):
    """Prompts sharing a 70-token prefix (longer than Mistral's window): later ones reuse the
    cached blocks of earlier ones, and the tokens still equal `generate`; with a pool too small
    for all of them, blocks are evicted and recomputed, and the tokens still equal it."""
    path = tiny_model(arch)
    loaded = load_model(str(path))
    rng = random.Random(5)
    vocab = len(loaded.tokenizer)
    system = [rng.randrange(3, vocab) for _ in range(70)]
    prompts = [system + [rng.randrange(3, vocab) for _ in range(n)] for n in (0, 1, 9, 10, 26)]
    prompts += [system[:64], system[:33]]  # block-aligned, and all but the last token cached
    refs = reference_outputs(path, prompts)

    llm = LLM(loaded, EngineConfig(max_num_batched_tokens=128, block_size=16))
    got = engine_outputs(llm, prompts[:1]) + engine_outputs(llm, prompts[1:])
    assert got == refs
    hits = llm.core.stats().prefix_cache_hit_tokens
    assert hits >= 64 * 4 + 48 + 32  # the second wave found the first prompt's 4 full blocks
    assert engine_outputs(llm, prompts) == refs  # a third time, everything it can is cached
    assert llm.core.stats().prefix_cache_hit_tokens > hits

    small = LLM(load_model(str(path)), EngineConfig(num_kv_blocks=14, block_size=16, max_num_batched_tokens=256))
    assert engine_outputs(small, prompts) == refs
    assert engine_outputs(small, prompts[::-1]) == refs[::-1]
    assert small.core.scheduler.num_preemptions > 0 and small.core.stats().prefix_cache_hit_tokens > 0
    assert small.core.allocator.num_free == 14


def test_prompts_arriving_together_compute_their_shared_prefix_once(tiny_model):
    """Seven prompts sharing a 70-token prefix, added at once: the later ones wait for the first to
    compute the shared blocks instead of computing them too, and the tokens equal `generate`."""
    path = tiny_model("llama")
    loaded = load_model(str(path))
    rng = random.Random(6)
    vocab = len(loaded.tokenizer)
    system = [rng.randrange(3, vocab) for _ in range(70)]
    prompts = [system + [rng.randrange(3, vocab) for _ in range(n)] for n in (0, 1, 9, 10, 26)]
    prompts += [system[:64], system[:33]]
    llm = LLM(loaded, EngineConfig(max_num_batched_tokens=128, block_size=16))
    assert engine_outputs(llm, prompts) == reference_outputs(path, prompts)
    # every prompt after the first found the shared blocks it could use: 4 full ones, or 3 and 2
    assert llm.core.stats().prefix_cache_hit_tokens == 64 * 4 + 48 + 32


def test_prefix_cache_can_be_turned_off(tiny_model):
    path, prompts, refs = prompts_and_refs(tiny_model, "llama")
    llm = LLM(load_model(str(path)), EngineConfig(max_num_batched_tokens=128, prefix_caching=False))
    assert engine_outputs(llm, prompts[-2:] * 2) == refs[-2:] * 2
    assert llm.core.stats().prefix_cache_hit_tokens == 0
