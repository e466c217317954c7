"""On a CUDA GPU: decode attention read from the paged cache in place (engine/gpu.py, Triton), and
greedy output equal to `generate` there (float32, no TF32). Skipped on a machine without CUDA, as
CI is; `bench/gpu_check.sh` runs them on the GPU machine, with the bfloat16 figures beside them.
"""

import pytest
import torch
from engine import LLM, EngineConfig, SamplingParams
from engine.model.loading import load_model
from tests.test_engine_parity import (MAX_TOKENS, PROMPT_LENGTHS, BlockTableAttention, make_prompts,
                                      reference_outputs)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="needs a CUDA GPU (bench/gpu_check.sh runs these on the GPU machine)")


@pytest.mark.parametrize("dtype, tol, splits", [
    *[(torch.float32, 1e-5, splits) for splits in (None, 1, 3, 8)],  # None: the kernel's choice
    (torch.bfloat16, 2e-2, 1), (torch.bfloat16, 2e-2, 3), (torch.float16, 2e-3, 3),
])
@pytest.mark.parametrize("heads, kv_heads, dim, window, softcap", [
    (9, 3, 64, None, None),  # SmolLM2's geometry
    (8, 8, 128, None, None),  # no GQA, a wide head
    (8, 2, 80, 7, None),  # a head size that is no power of two, a sliding window
    (4, 2, 16, 5, 50.0),  # Gemma-2: window and soft cap
])
def test_the_kernel_reads_each_decodes_blocks_in_place(dtype, tol, heads, kv_heads, dim, window, softcap, splits):
    """Each decode's attention over its own blocks, whole or in shares of its positions whose
    softmax states are merged (as a step of few sequences is split to fill the GPU)."""
    from engine.kernels.gpu import paged_decode_kernel

    kernel = paged_decode_kernel(torch.device("cuda"))
    assert kernel is not None, "Triton is missing: the GPU would take the torch path"
    kernel.splits = splits
    gen = torch.Generator(device="cuda").manual_seed(0)
    block_size, blocks, tokens = 16, 64, 7
    k_cache = torch.randn(blocks * block_size, kv_heads, dim, device="cuda", generator=gen).to(dtype)
    v_cache = torch.randn(blocks * block_size, kv_heads, dim, device="cuda", generator=gen).to(dtype)
    # the step's query as transformers passes it: [1, heads, tokens, D], a transposed view
    query = torch.randn(1, tokens, heads, dim, device="cuda", generator=gen).to(dtype).transpose(1, 2)
    index = torch.tensor([0, 3, 4, 6], device="cuda")  # rows 1, 2 and 5 are prompt tokens: untouched
    lens = torch.tensor([1, 16, 17, 300], device="cuda", dtype=torch.int32)
    order = torch.randperm(blocks, device="cuda", generator=gen).int()
    tables = torch.zeros(4, 19, dtype=torch.int32, device="cuda")  # 0-padded, as the runner pads them
    taken = 0
    for row, length in enumerate(lens.tolist()):  # 1 + 1 + 2 + 19 blocks, scattered over the cache
        need = -(-length // block_size)
        tables[row, :need] = order[taken:taken + need]
        taken += need
    out = torch.full((tokens, heads, dim), 7.0, dtype=dtype, device="cuda")
    scaling = dim ** -0.5
    kernel(query, out, k_cache, v_cache, index, tables, block_size, lens, scaling, window, softcap, 300)
    want = torch.zeros(tokens, heads, dim, dtype=torch.float64, device="cuda")  # the same gathered in float64
    BlockTableAttention()(query.double(), want, k_cache.double(), v_cache.double(), index, tables, block_size, lens,
                          scaling, window, softcap, 300)
    got = out.double()
    err = (got[index] - want[index]).abs().max().item()
    assert err <= tol * max(1.0, want[index].abs().max().item()), f"max error {err:.2e} against float64"
    assert (out[[1, 2, 5]] == 7.0).all(), "the kernel wrote rows that are no decode's"


@pytest.mark.parametrize("arch, kernel, splits", [
    *[(arch, kernel, None) for arch in ("llama", "mistral", "qwen2", "qwen3norm", "gemma2", "gpt2")
      for kernel in (True, False)],
    ("llama", True, 4), ("gemma2", True, 4),  # every decode's positions in 4 shares, merged
])
def test_greedy_on_cuda_equals_generate(tiny_model, arch, kernel, splits):
    """16 prompts of 1 to 300 tokens batched together (chunked prefill beside decodes), float32:
    the same tokens as `generate` on the same GPU, with the Triton decode attention and without."""
    assert not torch.backends.cuda.matmul.allow_tf32, "TF32 matmuls would change float32's sums"
    path = tiny_model(arch)
    loaded = load_model(str(path), device="cuda", dtype="float32")
    llm = LLM(loaded, EngineConfig(max_num_batched_tokens=128, decode_kernel=kernel))
    runner = llm.core.runner
    assert llm.core.attention_path == "paged" and runner.device.type == "cuda"
    assert (type(runner.decode_kernel).__name__ == "PagedDecodeKernel") == kernel
    assert llm.core.decode_attention == ("Triton (the paged cache in place)" if kernel else "torch (gathered per step)")
    if splits:
        runner.decode_kernel.splits = splits
    prompts = make_prompts(len(loaded.tokenizer))
    results = llm.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0))
    refs = reference_outputs(path, prompts, device="cuda")
    for n, got, want in zip(PROMPT_LENGTHS, [r.token_ids for r in results], refs):
        assert got == want, f"{arch}: prompt of {n} tokens diverged"
    if kernel:
        assert runner.decode_kernel.calls > 0, "no decode step went through the Triton kernel"
    assert llm.core.allocator.num_free == llm.core.num_kv_blocks
