"""A Hub checkpoint of a real shape without the Hub: a folder of random bfloat16 safetensors as
`save_pretrained` writes it (config.json, model.safetensors, generation_config.json, the
tokenizer), and GGUF files of the very same weights for llama-server.

    write_random_folder("smollm2-1.7b", out_dir, tokenizer_dir)   # 3.4 GB in a few seconds
    gguf_of_folder(out_dir, path, "bf16")                         # or "q8_0"

The weights are normal(0, 0.02) values cut from one pool at random offsets (as fast as a copy);
norms are ones. The GGUF writer is bench/gguf_file.py's (q and k rows in llama.cpp's order).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np

from bench.gguf_file import LlamaShape, Q, _write, encode, hf_name, parse_shape, permute_rows, tensor_shapes, \
    tokenizer_fields

_POOL = 1 << 24  # values in the random pool


def _config(shape: LlamaShape, tokenizer_dir: Path) -> dict:
    special = json.loads((tokenizer_dir / "config.json").read_text()) if (tokenizer_dir / "config.json").is_file() else {}
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": shape.hidden,
            "intermediate_size": shape.ffn, "num_hidden_layers": shape.layers, "num_attention_heads": shape.heads,
            "num_key_value_heads": shape.kv_heads, "vocab_size": shape.vocab, "tie_word_embeddings": shape.tied,
            "rope_theta": shape.rope_theta, "rms_norm_eps": shape.rms_eps,
            "max_position_embeddings": shape.context, "hidden_act": "silu", "torch_dtype": "bfloat16",
            "bos_token_id": special.get("bos_token_id", 1), "eos_token_id": special.get("eos_token_id", 2),
            "pad_token_id": special.get("pad_token_id")}


def write_random_folder(shape: str | LlamaShape, out_dir: str | os.PathLike, tokenizer_dir: str | os.PathLike,
                        seed: int = 0) -> Path:
    """The folder of `shape` (a name of bench/gguf_file.py's SHAPES or key=value pairs) with the
    tokenizer files of `tokenizer_dir` (a transformers folder); written under a temporary name,
    then renamed."""
    shape = parse_shape(shape) if isinstance(shape, str) else shape
    out, tokenizer_dir = Path(out_dir), Path(tokenizer_dir)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    rng = np.random.default_rng(seed)
    pool = (rng.standard_normal(_POOL, dtype=np.float32) * 0.02).view(np.uint32)
    pool = ((pool + 0x7FFF + ((pool >> 16) & 1)) >> 16).astype(np.uint16)  # to bfloat16, rounded to nearest even
    names = {hf_name(name): dims for name, dims in tensor_shapes(shape).items()}
    header, offset = {}, 0
    for name, dims in names.items():
        size = int(np.prod(dims)) * 2
        header[name] = {"dtype": "BF16", "shape": list(dims), "data_offsets": [offset, offset + size]}
        offset += size
    header["__metadata__"] = {"format": "pt"}
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)
    ones = np.full(max(shape.hidden, 1), 0x3F80, np.uint16)  # bfloat16 1.0
    with open(tmp / "model.safetensors", "wb") as handle:
        handle.write(len(blob).to_bytes(8, "little"))
        handle.write(blob)
        for name, dims in names.items():
            count = int(np.prod(dims))
            if len(dims) == 1:
                handle.write(ones[:count].tobytes())
                continue
            done = 0
            while done < count:
                start = int(rng.integers(0, _POOL))
                n = min(count - done, _POOL - start)
                handle.write(pool[start:start + n].tobytes())
                done += n
    config = _config(shape, tokenizer_dir)
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    (tmp / "generation_config.json").write_text(json.dumps(
        {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if config.get(k) is not None}))
    for item in tokenizer_dir.iterdir():
        if item.name.startswith(("tokenizer", "special_tokens", "chat_template")) or item.suffix == ".jinja":
            shutil.copy(item, tmp / item.name)
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)
    return out


def gguf_of_folder(folder: str | os.PathLike, path: str | os.PathLike, qtype: str = "bf16",
                   tokenizer_source: str | os.PathLike | None = None) -> Path:
    """A GGUF of a folder written by `write_random_folder` (a Llama), every matrix in `qtype`
    ("bf16": the values bit for bit; "q8_0"; "f16"), norms in float32."""
    import torch
    from safetensors import safe_open

    folder = Path(folder)
    config = json.loads((folder / "config.json").read_text())
    shape = LlamaShape(hidden=config["hidden_size"], layers=config["num_hidden_layers"],
                       ffn=config["intermediate_size"], heads=config["num_attention_heads"],
                       kv_heads=config["num_key_value_heads"], vocab=config["vocab_size"],
                       tied=config["tie_word_embeddings"], rope_theta=config["rope_theta"],
                       rms_eps=config["rms_norm_eps"], context=config["max_position_embeddings"])
    kind = {"bf16": Q.BF16, "q8_0": Q.Q8_0, "f16": Q.F16}[qtype]
    files = safe_open(str(folder / "model.safetensors"), "pt")  # torch tensors: numpy has no bfloat16

    def producer(name: str, dims) -> callable:
        def produce() -> np.ndarray:
            tensor = files.get_tensor(hf_name(name))
            if len(dims) == 1:
                return tensor.float().numpy()
            bits = tensor.view(torch.int16).numpy().view(np.uint16)  # the bfloat16 values' bits
            if ".attn_q." in name or ".attn_k." in name:
                bits = permute_rows(bits, shape.heads if ".attn_q." in name else shape.kv_heads)
            bits = np.ascontiguousarray(bits)
            if kind == Q.BF16:
                return bits.view(np.uint8).reshape(dims[0], -1)
            return encode((bits.astype(np.uint32) << 16).view(np.float32), kind)
        return produce

    tensors = [(name, dims, kind if len(dims) == 2 else Q.F32, producer(name, dims))
               for name, dims in tensor_shapes(shape).items()]
    return _write(Path(path), shape, qtype, f"rill random {qtype}",
                  tokenizer_fields(tokenizer_source), tensors)
