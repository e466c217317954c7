"""A GGUF file loaded lean: its blocks read where they lie in the file, never copied to float32 on disk.

`load_gguf` builds the transformers module tree with its parameters on the meta device (no memory),
then walks the file's tensors once. A linear whose type has a block kernel (engine/model/gguf_blocks.py)
becomes a `QuantLinear` made straight from its rows in the file (q/k rows in llama.cpp's order put
back by the same transformers tensor processor the float path uses, applied to row numbers); every
other tensor (norms, biases, embeddings, types without a kernel, or every tensor with `blocks`
off: `--quantize none`, a GPU, a 16-bit dtype) is de-quantized in memory by gguf-py, exactly as
transformers' own GGUF loading computes it. Nothing is written to disk, so a restart costs no
conversion.

The header (metadata, tensor table) is read by engine/model/gguf_header.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch import nn

from engine.config import rill_cache_dir
from engine.model.errors import ModelLoadError
from engine.model.gguf_header import fast_metadata, gguf_config, gguf_tokenizer, header_architecture, tensor_table
from engine.model.meta import parameters_on_meta, set_tensor

class GgufEmbedding(nn.Module):
    """`nn.Embedding` over a GGUF tensor's blocks: a lookup de-quantizes only the rows it reads,
    with gguf-py, so each row equals the float embedding transformers would hold (a 49152 x 2048
    Q6_K table: 82 MB instead of 400 MB of float32)."""

    def __init__(self, raw: np.ndarray, ggml_type, embedding_dim: int, dtype: torch.dtype):
        super().__init__()
        self.rows = torch.from_numpy(np.array(raw, copy=True))  # uint8 [vocab, row bytes]
        self.ggml_type, self.dtype = ggml_type, dtype
        self.num_embeddings, self.embedding_dim = self.rows.shape[0], embedding_dim

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        import gguf as gguf_lib

        rows = self.rows[input_ids.reshape(-1)].numpy()
        values = torch.from_numpy(gguf_lib.quants.dequantize(rows, self.ggml_type)).to(self.dtype)
        return values.view(*input_ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, {self.ggml_type.name} blocks"


@dataclass
class _Blocks:
    """A linear to make from the file's blocks once every float tensor (its bias) is in place."""

    raw: np.ndarray  # uint8 [out, row bytes], a view of the mapped file
    ggml_type: str
    order: np.ndarray | None


@dataclass
class GgufLoad:
    """What `load_gguf` did with the file's tensors, for the log and `/health`."""

    kept: dict[str, int] = field(default_factory=dict)  # block type -> linears kept as blocks
    dequantized: dict[str, int] = field(default_factory=dict)  # quantized type -> linears made float
    seconds: float = 0.0
    routes: object | None = None  # engine.model.activation_routes.ActivationRoutes, timed on the file's blocks

    def describe(self) -> str:
        parts = []
        blocks = {kind: n for kind, n in self.kept.items() if kind not in HALF_TYPES}
        halves = {kind: n for kind, n in self.kept.items() if kind in HALF_TYPES}
        if blocks:
            parts.append(f"{'/'.join(sorted(blocks))} blocks from the GGUF ({sum(blocks.values())} linears)")
        if halves:
            parts.append(f"{'/'.join(sorted(halves))} kept from the GGUF ({sum(halves.values())} linears, C kernel)")
        if self.dequantized:
            parts.append(f"float from {'/'.join(sorted(self.dequantized))} ({sum(self.dequantized.values())} "
                         f"linears: no block kernel for that type)")
        return "; ".join(parts) or "float"


def _row_order(processor, name: str, rows: int, mapping: dict) -> np.ndarray | None:
    """The rows of the file's tensor `name`, in the order the model wants them: the tensor
    processor (llama.cpp's q/k permutation undone) applied to the row numbers; None when it does
    more than reorder rows."""
    numbers = np.arange(rows, dtype=np.float64).reshape(rows, 1)
    result = processor.process(weights=numbers, name=name, tensor_key_mapping=mapping,
                               parsed_parameters={"tensors": {}, "config": {}})
    order = np.asarray(result.weights)
    if result.name != name or order.shape != (rows, 1):
        return None
    order = order[:, 0].astype(np.int64)
    if not np.array_equal(np.sort(order), np.arange(rows)):
        return None
    return order


def _is_embedding(model: nn.Module, target: str, shape) -> bool:
    """`target` is the weight of a plain `nn.Embedding` of this shape (and not also a linear's)."""
    module = model.get_submodule(target.removesuffix(".weight"))
    return type(module) is nn.Embedding and tuple(module.weight.shape) == tuple(shape)


def _as_tensor(weights, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    tensor = weights if isinstance(weights, torch.Tensor) else torch.from_numpy(np.array(weights, copy=True))
    if tensor.is_floating_point():
        tensor = tensor.to(dtype)
    return tensor.to(device)


def _tie_output(model: nn.Module, embedding: _Blocks | None, pending: dict, linears: dict, read: set[str],
                blocks_ok: bool, dtype: torch.dtype, device: torch.device) -> None:
    """A tied output head (no `output.weight` in the file) reads the file's input embedding: as
    blocks when the kernel has its type, else the float embedding's weight (or its own copy of
    the de-quantized table, when the input embedding kept its blocks)."""
    import gguf as gguf_lib

    from engine.model.gguf_blocks import GGUF_TYPES

    output, inputs = model.get_output_embeddings(), model.get_input_embeddings()
    name = next((key for key, module in linears.items() if module is output), None)
    if not isinstance(output, nn.Linear) or name in read or embedding is None:  # the file has its own head
        return
    if blocks_ok and embedding.ggml_type in (*GGUF_TYPES, *HALF_TYPES) and name is not None:
        pending[name] = embedding
    elif isinstance(inputs, nn.Embedding) and inputs.weight.device.type != "meta":
        output.weight = inputs.weight
    else:
        kind = gguf_lib.GGMLQuantizationType[embedding.ggml_type.upper()]
        weights = gguf_lib.quants.dequantize(np.asarray(embedding.raw), kind)
        output.weight = nn.Parameter(_as_tensor(weights, dtype, device), requires_grad=False)


def _model_kwargs(dtype, trust_remote_code, attn_implementation) -> dict:
    kwargs = {"dtype": dtype, "trust_remote_code": trust_remote_code}
    if attn_implementation is not None:
        kwargs["attn_implementation"] = attn_implementation
    return kwargs


def _release(blob: np.memmap, raw: np.ndarray) -> None:
    """The mapped file's pages under `raw` out of the process's memory once their panels are made:
    mapped pages count in its RSS until the kernel evicts them, so the file and the panels made of
    it were both held at the load's peak (an 8B Q4_K_M: 8.7 GiB). A page read again (a tied head's
    table, a neighbour tensor's first page) is read again from the file."""
    import mmap

    start = raw.ctypes.data - blob.ctypes.data
    first = start - start % mmap.PAGESIZE
    end = min(start + raw.nbytes, len(blob))
    if end > first:
        blob._mmap.madvise(mmap.MADV_DONTNEED, first, end - first)


HALF_TYPES = {"bf16": torch.bfloat16, "f16": torch.float16}  # GGUF types the C linear holds as they are


def _half_linear(blocks: _Blocks, bias: torch.Tensor | None) -> nn.Module:
    """A `PanelLinear` of a bf16 / f16 tensor's rows in the file (in `blocks.order`), widened
    exactly by the kernel as they are read."""
    from engine.kernels.linear import linear_kernel
    from engine.model.linears import PanelLinear

    kernel = linear_kernel(rill_cache_dir())
    if kernel is None:
        raise ModelLoadError("the C linear for 16-bit weights is unavailable here (see the log); use quantize=none")
    dtype = HALF_TYPES[blocks.ggml_type]
    values = torch.from_numpy(np.asarray(blocks.raw).view(np.int16)).view(dtype)
    order = None if blocks.order is None else torch.from_numpy(blocks.order)  # the C packer takes the rows in it
    return PanelLinear(None, kernel, weight=values, bias=bias, dtype=dtype, order=order)


def _make_block_linears(model: nn.Module, pending: dict[str, _Blocks], kernel, int8: bool, report: GgufLoad,
                        blob: np.memmap) -> None:
    """Each pending linear as a `QuantLinear` of its rows in the file, with its (now loaded) bias;
    the file's pages it was made from released."""
    from engine.model.quant import QuantLinear

    for target, blocks in pending.items():
        owner, _, leaf = target.removesuffix(".weight").rpartition(".")
        parent = model.get_submodule(owner)
        linear = getattr(parent, leaf)
        bias = linear.bias if linear.bias is not None and linear.bias.device.type != "meta" else None
        if blocks.ggml_type in HALF_TYPES:  # 16-bit values kept as they are, in the C linear's panels
            setattr(parent, leaf, _half_linear(blocks, bias))
            _release(blob, blocks.raw)
            report.kept[blocks.ggml_type] = report.kept.get(blocks.ggml_type, 0) + 1
            continue
        setattr(parent, leaf, QuantLinear.from_gguf(np.asarray(blocks.raw), blocks.ggml_type, bias, kernel, int8,
                                                    blocks.order))
        _release(blob, blocks.raw)
        report.kept[blocks.ggml_type] = report.kept.get(blocks.ggml_type, 0) + 1


def load_gguf(gguf: Path, *, device: torch.device, dtype: torch.dtype, trust_remote_code: bool = False,
              attn_implementation: str | None = None, kernel=None, int8: bool = False):
    """The model of a GGUF file, lean: returns (model, tokenizer, GgufLoad). `kernel`: the block
    kernel (engine/kernels/qlinear.py) that keeps the linears of the types it has as blocks; None
    de-quantizes every tensor in memory. Raises ModelLoadError."""
    import time

    import gguf as gguf_lib
    from transformers import AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor, get_gguf_hf_weights_map

    from engine.model.activation_routes import compare_activations
    from engine.model.gguf_blocks import GGUF_TYPES

    started = time.monotonic()
    with fast_metadata():
        config, parsed = gguf_config(gguf, trust_remote_code)
        tokenizer = gguf_tokenizer(gguf, trust_remote_code)
        with parameters_on_meta():
            model = AutoModelForCausalLM.from_config(config, **_model_kwargs(dtype, trust_remote_code,
                                                                             attn_implementation))
        architecture = header_architecture(gguf)
        processor = TENSOR_PROCESSORS.get(architecture, TensorProcessor)(config=parsed["config"])
        mapping = get_gguf_hf_weights_map(model, processor)
    blob = np.memmap(gguf, mode="r", dtype=np.uint8)
    linears = {name + ".weight": module for name, module in model.named_modules() if type(module) is nn.Linear}
    blocks_ok = kernel is not None and device.type == "cpu" and dtype == torch.float32
    pending: dict[str, _Blocks] = {}
    state = {"tensors": {}, "config": parsed["config"]}  # what MoE processors collect across tensors
    report = GgufLoad()
    embedding: _Blocks | None = None
    read: set[str] = set()  # the model's weights the file has a tensor for
    for info in tensor_table(blob):
        ggml_type = gguf_lib.GGMLQuantizationType(info.ggml_type)
        type_name = ggml_type.name.lower()
        data = blob[info.start:info.start + info.nbytes]
        rows = info.shape[0] if info.shape else 1
        raw = data.reshape(*info.shape[:-1], -1) if len(info.shape) > 1 else data
        target = mapping.get(info.name)
        read.add(target)
        linear = linears.get(target) if target else None
        quantized = type_name not in ("f32", "f16", "bf16")
        if info.name == "token_embd.weight":
            embedding = _Blocks(raw, type_name, None)  # a tied output head reads these
        if (blocks_ok and quantized and target is not None and _is_embedding(model, target, info.shape)
                and _row_order(processor, info.name, rows, mapping) is not None):
            owner, _, leaf = target.removesuffix(".weight").rpartition(".")
            setattr(model.get_submodule(owner), leaf, GgufEmbedding(raw, ggml_type, info.shape[1], dtype))
            continue
        if linear is not None and len(info.shape) == 2 and tuple(info.shape) == tuple(linear.weight.shape):
            if blocks_ok and type_name in HALF_TYPES and _row_order(processor, info.name, rows, mapping) is not None:
                pending[target] = _Blocks(raw, type_name, _row_order(processor, info.name, rows, mapping))
                continue
            if blocks_ok and type_name in GGUF_TYPES:
                order = _row_order(processor, info.name, rows, mapping)
                if order is not None:
                    plain = np.array_equal(order, np.arange(rows))
                    pending[target] = _Blocks(raw, type_name, None if plain else order)
                    continue
            if quantized and blocks_ok:  # a type the kernel lacks (else every tensor is float by choice)
                report.dequantized[type_name] = report.dequantized.get(type_name, 0) + 1
        try:
            weights = gguf_lib.quants.dequantize(np.asarray(raw), ggml_type)
        except NotImplementedError as error:
            raise ModelLoadError(f"the GGUF tensor {info.name!r} is of type {ggml_type.name}, which gguf-py "
                                 f"{gguf_lib.__version__ if hasattr(gguf_lib, '__version__') else ''} cannot "
                                 f"de-quantize: {error}") from error
        result = processor.process(weights=weights, name=info.name, tensor_key_mapping=mapping,
                                   parsed_parameters=state)
        if result.name in mapping:
            set_tensor(model, mapping[result.name], _as_tensor(result.weights, dtype, device))
    for name, tensor in state["tensors"].items():  # MoE experts, stacked by their processor
        set_tensor(model, name, _as_tensor(tensor, dtype, device))
    _tie_output(model, embedding, pending, linears, read, blocks_ok, dtype, device)
    report.routes = compare_activations(pending, kernel, int8)
    _make_block_linears(model, pending, kernel, int8, report, blob)
    missing = [name for name, param in model.named_parameters() if param.device.type == "meta"]
    if missing:
        raise ModelLoadError(f"the GGUF file {str(gguf)!r} has no tensor for {len(missing)} of the model's weights "
                             f"({', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''}): the file is "
                             f"incomplete or its architecture {architecture!r} is read differently by transformers")
    del blob
    model.eval()
    report.seconds = time.monotonic() - started
    return model, tokenizer, report
