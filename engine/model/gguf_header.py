"""A GGUF file's header, read fast: its metadata for transformers' config and tokenizer loading,
and its tensor table.

transformers reads a GGUF's metadata with gguf-py's reader, which builds a numpy view for every
string of the vocabulary (4-7 s for a 49k-token file), and rebuilds gguf-py's tensor-name map for
every module of the model (10 s for 30 layers); `fast_metadata` lends it transformers' newer
header reader (20 ms) and a name map built once, while a file is loaded. `tensor_table` reads
where each tensor lies (transformers' fast reader has no sizes for Q5_0 / Q5_1).
"""

from __future__ import annotations

import contextlib
import functools
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

_PARSED = object()  # the `types` of a metadata field whose `parts` hold parsed values


class _Field:
    """What transformers' legacy loader reads of a gguf-py ReaderField: `parts[i]` for `i` in
    `data`, parsed by `_gguf_parse_value(part, types)` (patched to pass these through)."""

    def __init__(self, name: str, value):
        self.name = name
        self.parts = value if isinstance(value, list) else [value]
        self.data = range(len(self.parts))
        self.types = _PARSED


class _Names:
    def __init__(self, name: str):
        self.name = name


class _MetadataReader:
    """gguf-py's `GGUFReader` as transformers' config loading uses it (fields and tensor names),
    read by transformers' fast header reader."""

    def __init__(self, path, mode: str = "r"):
        from transformers.integrations.gguf import reader

        metadata, names = reader.read_gguf_metadata(os.fspath(path), ("tokenizer.ggml.tokens",))
        self.fields = {key: _Field(key, value) for key, value in metadata.items()}
        self.tensors = [_Names(name) for name in names]


@contextlib.contextmanager
def fast_metadata():
    """While open, transformers' GGUF config and tokenizer loading read the header with
    `_MetadataReader`, each file's header is parsed once, and gguf-py's tensor-name map is built
    once per architecture (transformers rebuilds it for every module of the model: 10 s for a
    30-layer model). Pure functions of their arguments; the loading that uses them runs at start."""
    import gguf as gguf_lib
    import transformers.modeling_gguf_pytorch_utils as legacy
    from transformers.integrations.gguf import reader as fast_reader

    saved = (gguf_lib.GGUFReader, legacy._gguf_parse_value, fast_reader.read_gguf_metadata,
             gguf_lib.get_tensor_name_map)
    parse = saved[1]

    def parse_value(value, types):
        return value if types is _PARSED else parse(value, types)

    @functools.lru_cache(maxsize=8)
    def read_metadata(path, string_arrays=()):
        return saved[2](path, string_arrays)

    def read_metadata_once(path, string_arrays=()):
        return read_metadata(os.fspath(path), tuple(string_arrays))

    gguf_lib.GGUFReader, legacy._gguf_parse_value = _MetadataReader, parse_value
    fast_reader.read_gguf_metadata = read_metadata_once
    gguf_lib.get_tensor_name_map = functools.lru_cache(maxsize=None)(saved[3])
    try:
        yield
    finally:
        (gguf_lib.GGUFReader, legacy._gguf_parse_value, fast_reader.read_gguf_metadata,
         gguf_lib.get_tensor_name_map) = saved


def gguf_config(gguf: Path, trust_remote_code: bool = False):
    """The transformers config a GGUF file describes, and the parsed dict its tensor processor takes."""
    from transformers import AutoConfig
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    with fast_metadata():
        parsed = load_gguf_checkpoint(str(gguf), return_tensors=False)
        config = AutoConfig.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                            trust_remote_code=trust_remote_code)
    return config, parsed


def gguf_tokenizer(gguf: Path, trust_remote_code: bool = False):
    """The tokenizer in a GGUF file's metadata (transformers' conversion of it)."""
    from transformers import AutoTokenizer

    with fast_metadata():
        return AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                             trust_remote_code=trust_remote_code)


_SCALAR_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}  # GGUF value type -> bytes


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # in torch order (rows first)
    ggml_type: int
    start: int  # byte offset in the file
    nbytes: int


def tensor_table(blob: np.ndarray) -> list[TensorInfo]:
    """The tensors of a mapped GGUF file (v2/v3): the metadata walked past, the table read."""
    import struct

    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    if bytes(blob[:4]) != b"GGUF":
        raise ValueError("the file does not start with the GGUF magic bytes: it is not a GGUF file")
    _, tensor_count, kv_count = struct.unpack_from("<IQQ", blob, 4)
    pos, alignment = 24, 32

    def skip(pos: int, kind: int) -> int:
        if kind in _SCALAR_SIZES:
            return pos + _SCALAR_SIZES[kind]
        if kind == 8:
            return pos + 8 + struct.unpack_from("<Q", blob, pos)[0]
        element, count = struct.unpack_from("<IQ", blob, pos)
        pos += 12
        if element in _SCALAR_SIZES:
            return pos + count * _SCALAR_SIZES[element]
        for _ in range(count):
            pos = skip(pos, element)
        return pos

    for _ in range(kv_count):
        length = struct.unpack_from("<Q", blob, pos)[0]
        key = bytes(blob[pos + 8:pos + 8 + length])
        pos += 8 + length
        kind = struct.unpack_from("<I", blob, pos)[0]
        if key == b"general.alignment":
            alignment = struct.unpack_from("<I", blob, pos + 4)[0]
        pos = skip(pos + 4, kind)
    entries = []
    for _ in range(tensor_count):
        length = struct.unpack_from("<Q", blob, pos)[0]
        name = bytes(blob[pos + 8:pos + 8 + length]).decode()
        pos += 8 + length
        dims = struct.unpack_from(f"<{struct.unpack_from('<I', blob, pos)[0]}Q", blob, pos + 4)
        pos += 4 + 8 * len(dims)
        ggml_type, offset = struct.unpack_from("<IQ", blob, pos)
        pos += 12
        block, size = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
        entries.append((name, tuple(reversed(dims)), ggml_type, offset, int(np.prod(dims)) // block * size))
    data_start = -(-pos // alignment) * alignment
    return [TensorInfo(name, shape, kind, data_start + offset, nbytes)
            for name, shape, kind, offset, nbytes in entries]


def header_architecture(gguf: Path) -> str:
    from transformers.integrations.gguf import reader

    return reader.read_gguf_metadata(str(gguf))[0]["general.architecture"]
