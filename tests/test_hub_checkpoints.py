"""A Hub checkpoint as users name it: a folder of bfloat16 (or float16) safetensors, served lean.

Its linears keep the checkpoint's 16-bit values in the C kernel's panels (widened exactly to
float32 as they are read), so greedy output equals `generate` on the float32 upcast model, alone
and inside a busy batch, on every architecture the paged path serves; `--dtype float32` keeps the
float32 model of before; `--quantize` quantizes tensor by tensor from the mapped file.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from engine import LLM, EngineConfig, SamplingParams
from engine.model.loading import load_model

MAX_TOKENS = 24


def _prompts(vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(7)
    return [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in (5, 17, 40, 9, 64, 3)]


def _generate_refs(path, prompts) -> list[list[int]]:
    """Hugging Face `generate`, greedy, on the checkpoint upcast to float32 (the exact reference)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    refs = []
    for prompt in prompts:
        out = model.generate(torch.tensor([prompt]), max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS,
                             do_sample=False, pad_token_id=0)
        refs.append(out[0, len(prompt):].tolist())
    return refs


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16bit_panels_give_the_float32_products(dtype):
    """The C linear over 16-bit panels equals F.linear on the same weights upcast: 1 to 13 rows
    (every tile), an odd input width (the two-inputs-at-a-time loop's remainder), a partial panel;
    and a decode batch's 7 to 64 rows over 601 inputs, which go a stretch of inputs at a time."""
    from engine.kernels.linear import linear_kernel, padded_bias, panels_of
    from engine.model.loading import rill_cache_dir

    kernel = linear_kernel(rill_cache_dir())
    assert kernel is not None
    gen = torch.Generator().manual_seed(1)
    for width, row_counts in ((75, range(1, 14)), (601, (7, 8, 13, 32, 64, 65))):
        weight = torch.randn(37, width, generator=gen).to(dtype)
        bias = torch.randn(37, generator=gen)
        panels = panels_of(weight, dtype)
        assert panels.dtype == dtype and panels.element_size() == 2
        for rows in row_counts:
            x = torch.randn(rows, width, generator=gen)
            got = kernel(x, panels, padded_bias(bias, panels.shape[0], 37), 37)
            # float32 sums in another order than torch's: the rounding grows with the width
            torch.testing.assert_close(got, F.linear(x, weight.float(), bias), atol=2e-5 * width / 75, rtol=2e-5)


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3norm", "gemma2"])
def test_a_bfloat16_checkpoint_keeps_its_weights_and_equals_generate(tiny_model, arch):
    path = tiny_model(arch, dtype="bfloat16")
    loaded = load_model(str(path))
    model = loaded.model
    assert loaded.weights.startswith("bfloat16 kept") and "C kernel" in loaded.weights
    assert not any(type(m) is nn.Linear for m in model.modules())  # every linear packed, none float32
    panels = [m.panels for m in model.modules() if getattr(m, "panels", None) is not None]
    assert panels and all(p.dtype == torch.bfloat16 for p in panels)
    prompts = _prompts(len(loaded.tokenizer))
    refs = _generate_refs(path, prompts)
    llm = LLM(loaded)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    together = [r.outputs[0].token_ids for r in llm.generate(prompts, params)]  # one busy batch
    assert together == refs
    alone = [llm.generate([p], params)[0].outputs[0].token_ids for p in prompts[:2]]
    assert alone == refs[:2]


def test_the_native_step_runs_the_16bit_panels(tiny_model):
    path = tiny_model("llama", dtype="bfloat16")
    llm = LLM(load_model(str(path)))
    assert llm.core.runner.native is not None, llm.core.runner_reason


def test_a_float16_checkpoint_is_kept_too(tiny_model):
    path = tiny_model("llama", dtype="float16")
    loaded = load_model(str(path))
    assert loaded.weights.startswith("float16 kept")
    prompts = _prompts(len(loaded.tokenizer))[:3]
    got = [r.outputs[0].token_ids for r in LLM(loaded).generate(
        prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))]
    assert got == _generate_refs(path, prompts)


@pytest.mark.parametrize("how", [dict(dtype="float32"), dict(dtype=torch.float32), dict(quantize="none")])
def test_dtype_float32_keeps_the_float32_model(tiny_model, how):
    path = tiny_model("llama", dtype="bfloat16")
    loaded = load_model(str(path), **how)
    assert loaded.weights == "float"
    assert type(loaded.model.model.embed_tokens) is nn.Embedding
    assert loaded.model.model.embed_tokens.weight.dtype == torch.float32


@pytest.fixture(scope="module")
def tied_llama(tiny_model, tmp_path_factory):
    """A bfloat16 Llama with tied embeddings (SmolLM2's layout: no lm_head tensor in the file)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    source = tiny_model("llama", dtype="bfloat16")
    config = AutoConfig.from_pretrained(source)
    config.tie_word_embeddings = True
    out = tmp_path_factory.mktemp("tied-llama")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(3)
        AutoModelForCausalLM.from_config(config).to(torch.bfloat16).save_pretrained(out)
    AutoTokenizer.from_pretrained(source).save_pretrained(out)
    return out


def test_the_tied_head_and_embedding_come_from_the_one_table(tied_llama):
    from safetensors import safe_open

    with safe_open(str(tied_llama / "model.safetensors"), "pt") as f:
        assert "lm_head.weight" not in f.keys()
        table = f.get_tensor("model.embed_tokens.weight")
    loaded = load_model(str(tied_llama))
    model = loaded.model
    assert loaded.weights.startswith("bfloat16 kept")
    ids = torch.tensor([[3, 9, 400]])
    torch.testing.assert_close(model.model.embed_tokens(ids), table[ids].float(), atol=0, rtol=0)
    assert model.lm_head.panels.dtype == torch.bfloat16
    assert model.model.embed_tokens.table is None and model.model.embed_tokens.panels is model.lm_head.panels
    x = torch.randn(2, table.shape[1])
    torch.testing.assert_close(model.lm_head(x), F.linear(x, table.float()), atol=2e-5, rtol=2e-5)
    prompts = _prompts(len(loaded.tokenizer))[:3]
    got = [r.outputs[0].token_ids for r in LLM(loaded).generate(
        prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))]
    assert got == _generate_refs(tied_llama, prompts)


@pytest.mark.parametrize("kind", ["q8_0", "q4_0", "q4_1", "q4_k", "q6_k"])
def test_quantize_at_load_streams_from_the_checkpoint(tiny_model, kind):
    """`--quantize` on a bfloat16 checkpoint: every linear quantized from its own tensor (the K
    types in llama.cpp's block layout, read by the same repack as a downloaded GGUF's, with
    llama-quantize's fallback where a row is no whole super-block), each layer computing exactly
    the de-quantized weights' products."""
    from safetensors import safe_open

    from engine.model.quant_probe import quant_kernel
    from engine.model.loading import rill_cache_dir
    from engine.model.quant import QuantLinear
    from engine.model.quantize import quantize_linear

    path = tiny_model("llama", dtype="bfloat16")
    loaded = load_model(str(path), quantize=kind)
    assert f"{kind} blocks quantized at load" in loaded.weights
    assert not any(type(m) is nn.Linear for m in loaded.model.modules())
    layer = loaded.model.model.layers[0].mlp.down_proj  # 128 inputs: no whole super-block of 256
    assert isinstance(layer, QuantLinear) or type(layer).__name__ == "FusedPart"
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        weight = f.get_tensor("model.layers.0.mlp.down_proj.weight").float()
    x = torch.randn(3, weight.shape[1])
    want = F.linear(x, quantize_linear(weight, None, kind, quant_kernel(rill_cache_dir()), dequantized=True))
    torch.testing.assert_close(layer(x), want, atol=1e-4, rtol=1e-4)
    out = LLM(loaded, EngineConfig()).generate([[1, 5, 9]], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 8


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_c_quantizer_writes_the_blocks_quantize_blocks_rounds(dtype):
    """`--quantize q8_0|q4_0|q4_1` quantizes in C from the mapped 16-bit rows: the same bytes as
    `quantize_blocks`' float32 rounding, including an all-zero block, a flat one and a tie in magnitude."""
    import numpy as np

    from engine.kernels.linear import linear_kernel
    from engine.model.loading import rill_cache_dir
    from engine.model.gguf_blocks import unpack_raw
    from engine.model.quantize import quantize_blocks

    kernel = linear_kernel(rill_cache_dir())
    gen = torch.Generator().manual_seed(3)
    for kind in ("q8_0", "q4_0", "q4_1"):
        weight = (torch.randn(37, 320, generator=gen) * torch.rand(37, 1, generator=gen) * 4).to(dtype)
        weight[0, :32], weight[1, :32] = 0, 0.5
        weight[2, 7] = -weight[2, :32].abs().max()
        got, want = unpack_raw(kernel.quantize(weight, kind), kind), quantize_blocks(weight.float(), kind)
        for part_got, part_want in zip(got, want):
            assert (part_got is None and part_want is None) or np.array_equal(part_got, part_want), kind


def test_k_quants_at_load_hold_llama_cpps_blocks():
    """A weight of whole super-blocks quantized to q4_k / q6_k at load is held as the GGUF types
    (`source`), and its products are those of the blocks' de-quantized values."""
    from engine.model.quant_probe import quant_kernel
    from engine.model.loading import rill_cache_dir
    from engine.model.quantize import quantize_linear

    kernel = quant_kernel(rill_cache_dir())
    weight = torch.randn(48, 512) * 0.05
    x = torch.randn(5, 512)
    for kind in ("q4_k", "q6_k"):
        layer = quantize_linear(weight, None, kind, kernel)
        assert layer.source == kind
        dequantized = quantize_linear(weight, None, kind, kernel, dequantized=True)
        assert 0 < (dequantized - weight).abs().max() < 0.05  # lossy, and close
        torch.testing.assert_close(layer(x), F.linear(x, dequantized), atol=1e-4, rtol=1e-4)


def test_a_hub_id_in_the_cache_is_loaded_lean(tiny_model, tmp_path, monkeypatch):
    """`--model owner/name` as users name it: the snapshot in the Hub cache (here offline) is read
    like a folder, its 16-bit weights kept."""
    import shutil

    from huggingface_hub import constants

    source = tiny_model("qwen2", dtype="bfloat16")
    repo = tmp_path / "hub" / "models--someone--tiny-qwen2"
    snapshot = repo / "snapshots" / ("0" * 40)
    shutil.copytree(source, snapshot)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0" * 40)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    loaded = load_model("someone/tiny-qwen2")
    assert loaded.weights.startswith("bfloat16 kept") and loaded.name == "tiny-qwen2"
    prompts = _prompts(len(loaded.tokenizer))[:2]
    got = [r.outputs[0].token_ids for r in LLM(loaded).generate(
        prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))]
    assert got == _generate_refs(source, prompts)


def test_bench_divergence_reports_a_checkpoints_paths(tiny_model):
    """`python -m bench.divergence --model M`: each lean path of a checkpoint against it in float32
    (the kept 16-bit weights exact, each quantize lossy), one row each."""
    import subprocess
    import sys
    from pathlib import Path

    path = tiny_model("llama", dtype="bfloat16")
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, "-m", "bench.divergence", "--model", str(path), "--tokens", "48"],
                          cwd=root, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = [line for line in done.stdout.splitlines() if line.startswith("| ") and "%" in line]
    assert [row.split(" | ")[0] for row in rows] == ["| its 16-bit weights kept (--dtype auto)"] + [
        f"| quantized at load to {kind}" for kind in ("q8_0", "q6_k", "q4_k", "q4_0")]
    kept = rows[0].split(" | ")
    assert kept[1].startswith("bfloat16 kept") and kept[2] == "100.00%" and float(kept[3]) < 1e-8


def _more_configs(vocab: int) -> dict:
    """Tiny configs of the other families people publish in bfloat16 (hidden 64, 2 layers)."""
    import transformers as tf

    common = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=1024, initializer_range=0.2, vocab_size=vocab,
                  bos_token_id=1, eos_token_id=2, pad_token_id=0)
    return {"phi3": tf.Phi3Config(**common), "olmo": tf.OlmoConfig(**common), "olmo2": tf.Olmo2Config(**common),
            "granite": tf.GraniteConfig(**common), "glm4": tf.Glm4Config(head_dim=16, **common),
            "gemma3": tf.Gemma3TextConfig(head_dim=16, sliding_window=32, query_pre_attn_scalar=16, **common)}


@pytest.mark.parametrize("arch", ["phi3", "olmo", "olmo2", "granite", "glm4", "gemma3"])
def test_more_families_in_bfloat16_equal_generate(tiny_model, tmp_path, arch):
    """Phi-3 (fused q/k/v and gate/up), OLMo (norms without weights: nothing float32 left), OLMo 2,
    Granite, GLM-4, Gemma 3: kept in bfloat16, greedy equal to `generate` in a busy batch."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model("llama", dtype="bfloat16"))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(_more_configs(len(tokenizer))[arch]).to(torch.bfloat16).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    loaded = load_model(str(tmp_path))
    assert loaded.weights.startswith("bfloat16 kept")
    prompts = _prompts(len(tokenizer))[:4]
    got = [r.outputs[0].token_ids for r in LLM(loaded).generate(
        prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))]
    assert got == _generate_refs(tmp_path, prompts)


def test_panels_are_asked_of_huge_pages():
    """A large panel tensor sits in a mapping of its own, 2 MiB aligned, zero-filled, and (where the
    system has transparent huge pages on `madvise` or `always`) backed by huge pages once written."""
    import re
    from pathlib import Path

    from engine.kernels.pages import HUGE_PAGE, empty_huge

    panels = empty_huge((64, 8192, 16), torch.bfloat16)  # 16 MiB
    assert panels.shape == (64, 8192, 16) and panels.dtype == torch.bfloat16
    assert panels.data_ptr() % HUGE_PAGE == 0 and not panels.any()
    panels.fill_(1.5)
    mode = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if not mode.is_file() or "[never]" in mode.read_text():
        pytest.skip("transparent huge pages are off on this system")
    huge_kb, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        span = re.match(r"^([0-9a-f]+)-([0-9a-f]+) ", line)
        if span:
            inside = int(span[1], 16) <= panels.data_ptr() < int(span[2], 16)
        elif inside and line.startswith("AnonHugePages:"):
            huge_kb = int(line.split()[1])
    assert huge_kb >= 8 * 1024, f"{huge_kb} kB of the 16 MiB panels on huge pages"
    assert float(panels[63, 8191, 15]) == 1.5
