"""bench/gguf_file.py: its encoders give ggml's blocks (gguf-py de-quantizes them back to the
weights), its files load in transformers with the weights they hold and SmolLM2's tokenizer, the
Q4_K_M recipe picks llama-quantize's types, and a random file of a real shape computes finite
numbers. No big files: the models here have hidden sizes of 64 and 256."""

from dataclasses import replace

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize

from bench import gguf_file
from bench.gguf_file import (
    SHAPES,
    TYPES,
    LlamaShape,
    encode,
    gguf_nbytes,
    parse_shape,
    permute_rows,
    tensor_types,
    use_more_bits,
    write_llama_gguf,
    write_random_gguf,
)
from engine.model.loading import embedded_gguf_path

QUESTION = "What is the capital of France?"
SMOLLM2_IDS = [1780, 314, 260, 3575, 282, 4649, 47]  # the question in SmolLM2's tokenizer
# the root-mean-square error of each type against the weights' spread, at most (a block in the
# wrong layout gives about 1)
RMS_ERROR = {"f32": 0.0, "f16": 1e-3, "bf16": 5e-3, "q8_0": 0.008, "q4_0": 0.1, "q4_1": 0.1, "q4_k": 0.1, "q5_0": 0.05,
             "q5_1": 0.05, "q5_k": 0.05, "q6_k": 0.025}


@pytest.fixture(scope="module", autouse=True)
def gguf_parsed_once():
    """gguf-py's reader parses SmolLM2's 150,000 tokenizer entries in seconds, and transformers
    reads a file two or three times: each file is parsed once in this module."""
    import gguf

    original, readers = gguf.GGUFReader, {}

    def shared(path, mode="r"):
        key = (str(path), mode)
        if key not in readers:
            readers[key] = original(path, mode)
        return readers[key]

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(gguf, "GGUFReader", shared)
        yield


def tiny_llama(hidden: int, ffn: int, tied: bool = True):
    """A random Llama with SmolLM2's vocabulary: 2 layers, 4 heads, 2 KV heads."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(hidden)
    config = LlamaConfig(vocab_size=49152, hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         tie_word_embeddings=tied, rms_norm_eps=1e-6, rope_theta=50000.0)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():  # norms other than ones, so that a misplaced norm would show
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)
    return model


def load_gguf(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()


def file_tensors(path) -> dict[str, tuple[Q, np.ndarray]]:
    """Each tensor of a GGUF: its type and gguf-py's de-quantization [rows, cols] (or [cols])."""
    import gguf

    return {t.name: (t.tensor_type, dequantize(t.data, t.tensor_type).reshape(tuple(reversed(t.shape.tolist()))))
            for t in gguf.GGUFReader(path).tensors}


def assert_weights_are_the_files(model, path, shape: LlamaShape) -> dict[str, Q]:
    """Every parameter transformers loaded equals gguf-py's de-quantization of the file's blocks
    (q and k rows in the file's order: the permutation is the only difference). Returns the types."""
    held = file_tensors(path)
    state = model.state_dict()
    for name, (_, values) in held.items():
        weight = state[gguf_file.hf_name(name)].numpy()
        if ".attn_q." in name:
            weight = permute_rows(weight, shape.heads)
        elif ".attn_k." in name:
            weight = permute_rows(weight, shape.kv_heads)
        np.testing.assert_array_equal(weight, values, err_msg=name)
    if shape.tied:
        assert torch.equal(state["lm_head.weight"], state["model.embed_tokens.weight"])
    return {name: qtype for name, (qtype, _) in held.items()}


@pytest.mark.parametrize("name", list(TYPES))
def test_encoders_give_ggml_blocks(name):
    """gguf-py's de-quantization of our blocks is the weights within the type's precision; a row
    of zeros stays zeros, a row of one negative value stays close."""
    weight = np.random.default_rng(1).standard_normal((24, 512)).astype(np.float32) * 0.05
    weight[0] = 0
    weight[1] = -0.03
    raw = encode(weight, TYPES[name])
    block, size = gguf_file.GGML_QUANT_SIZES[TYPES[name]]
    if name not in ("f32", "f16"):
        assert raw.dtype == np.uint8 and raw.shape == (24, 512 // block * size)
    back = dequantize(raw, TYPES[name]).reshape(weight.shape)
    rms = np.sqrt(((back - weight) ** 2).mean()) / weight.std()
    assert rms <= RMS_ERROR[name], f"{name}: relative RMS error {rms:.4f}"
    assert not back[0].any()
    assert np.abs(back[1] + 0.03).max() < 0.03 * 0.1


def test_encoders_refuse_rows_that_do_not_fit_their_blocks():
    with pytest.raises(ValueError, match="Q4_K needs rows of a multiple of 256 values; this tensor's rows have 64"):
        encode(np.zeros((2, 64), np.float32), Q.Q4_K)


def test_q4_k_m_picks_llama_quantizes_layers_and_fallbacks():
    # llama.cpp's use_more_bits: half the layers, the first and last eighth and every third between
    assert [i for i in range(24) if use_more_bits(i, 24)] == [0, 1, 2, 5, 8, 11, 14, 17, 20, 21, 22, 23]
    assert sum(use_more_bits(i, 32) for i in range(32)) == 16
    types = tensor_types(SHAPES["smollm2-1.7b"], "q4_k_m")
    assert types["token_embd.weight"] == Q.Q6_K and "output.weight" not in types  # tied: the embedding is the head
    assert [types[f"blk.{i}.attn_v.weight"] for i in (0, 3, 5)] == [Q.Q6_K, Q.Q4_K, Q.Q6_K]
    assert [types[f"blk.{i}.ffn_down.weight"] for i in (0, 3, 5)] == [Q.Q6_K, Q.Q4_K, Q.Q6_K]
    assert {types[f"blk.{i}.{k}.weight"] for i in range(24) for k in ("attn_q", "attn_k", "attn_output", "ffn_gate",
                                                                        "ffn_up")} == {Q.Q4_K}
    assert types["blk.0.attn_norm.weight"] == Q.F32
    types = tensor_types(SHAPES["llama3-8b"], "q4_k_m")
    assert (types["token_embd.weight"], types["output.weight"]) == (Q.Q4_K, Q.Q6_K)  # untied, as Llama-3-8B's file
    # rows of 64 values hold no K super-block: llama-quantize's fallbacks
    tiny = tensor_types(LlamaShape(hidden=64, layers=2, ffn=128, heads=4, kv_heads=2), "q4_k_m")
    assert tiny["token_embd.weight"] == Q.Q8_0 and tiny["blk.0.attn_q.weight"] == Q.Q5_0
    assert tiny["blk.0.attn_v.weight"] == Q.Q5_0 and tiny["blk.1.attn_v.weight"] == Q.Q8_0  # Q6_K -> Q8_0


def test_sizes_of_the_real_shapes():
    assert 1.04e9 < gguf_nbytes(SHAPES["smollm2-1.7b"]) < 1.07e9  # SmolLM2-1.7B-Instruct-Q4_K_M.gguf: 1.06 GB
    assert 4.0e9 < gguf_nbytes(SHAPES["llama3-8b"]) < 4.5e9


def test_parse_shape():
    assert parse_shape("llama3-8b") is SHAPES["llama3-8b"]
    shape = parse_shape("hidden=256,layers=2,ffn=512,heads=4,kv_heads=2,tied=false")
    assert (shape.hidden, shape.layers, shape.ffn, shape.head_dim, shape.tied, shape.vocab) == (256, 2, 512, 64, False,
                                                                                                49152)
    assert shape.key == "h256-l2-f512-a4-kv2-v49152-untied"
    with pytest.raises(ValueError, match="lacks ffn, heads, kv_heads"):
        parse_shape("hidden=256,layers=2")
    with pytest.raises(ValueError, match="unknown shape 'llama-70b'"):
        parse_shape("llama-70b")


@pytest.mark.embedded
def test_a_tiny_llama_in_q4_k_m_loads_in_transformers_and_generates(tmp_path):
    """hidden 64: the recipe's Q4_K and Q6_K fall back to Q5_0 and Q8_0 as llama-quantize does."""
    model = tiny_llama(hidden=64, ffn=128)
    shape = LlamaShape.from_config(model.config)
    path = write_llama_gguf(model, None, tmp_path / "tiny-q4_k_m.gguf", types="q4_k_m")
    loaded = load_gguf(path)
    types = assert_weights_are_the_files(loaded, path, shape)
    assert types == tensor_types(shape, "q4_k_m") and set(types.values()) == {Q.F32, Q.Q5_0, Q.Q8_0}
    for name, param in model.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[name], param, atol=0.015, rtol=0.02)
    out = loaded.generate(torch.tensor([SMOLLM2_IDS]), max_new_tokens=4, do_sample=False)
    assert out.shape == (1, len(SMOLLM2_IDS) + 4)


@pytest.mark.embedded
def test_a_llama_in_every_type_loads_in_transformers_with_smollm2s_tokenizer(tmp_path):
    """hidden 256: every type in one file (layer 0's q and k in F32: transformers gets the model's
    own weights back, so the q/k permutation is llama.cpp's); the tokenizer is SmolLM2's."""
    from transformers import AutoTokenizer

    model = tiny_llama(hidden=256, ffn=512, tied=False)
    shape = LlamaShape.from_config(model.config)
    matrices = [n for n, dims in gguf_file.tensor_shapes(shape).items() if len(dims) == 2]
    exact = ["blk.0.attn_q.weight", "blk.0.attn_k.weight"]
    others = [name for name in matrices if name not in exact]
    types = dict.fromkeys(exact, "f32") | {name: list(TYPES)[1 + i % (len(TYPES) - 1)] for i, name in enumerate(others)}
    path = write_llama_gguf(model, None, tmp_path / "every-type.gguf", types=types)
    loaded = load_gguf(path)
    held_shape = LlamaShape.from_config(loaded.config)  # the metadata: sizes, heads, rope theta, epsilon, context
    assert held_shape.rms_eps == pytest.approx(1e-6) and replace(held_shape, rms_eps=1e-6) == shape
    held = assert_weights_are_the_files(loaded, path, shape)
    assert {q.name.lower() for q in held.values()} == set(TYPES)
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight"):
        assert torch.equal(loaded.state_dict()[name], model.state_dict()[name])
    for name, param in model.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[name], param, atol=0.015, rtol=0.02)
    ids = torch.tensor([SMOLLM2_IDS])
    with torch.no_grad():
        ours, reference = loaded(ids).logits.flatten(), model(ids).logits.flatten()
    assert torch.corrcoef(torch.stack([ours, reference]))[0, 1] > 0.98
    assert loaded.generate(ids, max_new_tokens=4, do_sample=False).shape == (1, len(SMOLLM2_IDS) + 4)

    tokenizer = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    source = embedded_gguf_path()
    reference = AutoTokenizer.from_pretrained(str(source.parent), gguf_file=source.name)
    assert tokenizer.encode(QUESTION) == reference.encode(QUESTION) == SMOLLM2_IDS
    assert tokenizer.chat_template == reference.chat_template and tokenizer.eos_token == "<|im_end|>"


@pytest.mark.embedded
def test_a_random_gguf_of_a_tiny_shape_computes_finite_logits(tmp_path):
    shape = parse_shape("hidden=256,layers=2,ffn=512,heads=4,kv_heads=2,tied=false,context=1024")
    path = write_random_gguf(shape, tmp_path / "random.gguf")
    assert gguf_nbytes(shape) < path.stat().st_size < gguf_nbytes(shape) + (2 << 20)  # + metadata
    held = file_tensors(path)
    assert {name: qtype for name, (qtype, _) in held.items()} == tensor_types(shape, "q4_k_m")
    for name, (_, values) in held.items():
        assert np.isfinite(values).all(), name
        if values.ndim == 2:
            assert 0.005 < values.std() < 0.1, (name, values.std())
    loaded = load_gguf(path)
    assert loaded.config.hidden_size == 256 and not loaded.config.tie_word_embeddings
    with torch.no_grad():
        logits = loaded(torch.tensor([SMOLLM2_IDS])).logits
    assert torch.isfinite(logits).all() and logits.std() > 0.1
    assert loaded.generate(torch.tensor([SMOLLM2_IDS]), max_new_tokens=4, do_sample=False).shape[1] == 11
