"""A folder of safetensors loaded lean: tensors read where they lie in the mapped file, linears
packed straight into the C kernels' panels, one tensor at a time.

`load_safetensors` builds the transformers module tree with its parameters on the meta device (as
engine/model/gguf.py does), maps each `*.safetensors` file, and walks its tensors:

- the weight of a plain `nn.Linear` becomes a `PanelLinear` holding the checkpoint's own values
  (bfloat16 or float16 kept as they are, widened exactly by the kernel: the float32 model's
  products), or with `quantize` a `QuantLinear` of blocks quantized from that one tensor;
- a 16-bit input embedding of a plain `nn.Embedding` keeps its 16-bit table (`HalfEmbedding`);
- everything else (norms, biases, what has no kernel) becomes float32.

The file's pages under a packed tensor are released once its panels exist, so the load never holds
the checkpoint and the packed model at once, and no float32 copy of the model is ever made. Where
the checkpoint's names do not match the model's (a conversion transformers applies at load), it
says why with `LeanLoadUnsupported` and the caller takes `from_pretrained`.
"""

from __future__ import annotations

import json
import logging
import mmap
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch import nn

from engine.host import return_freed_memory
from engine.kernels.linear import panel_slots
from engine.model.meta import parameters_on_meta, set_tensor

log = logging.getLogger("rill.loading")

# safetensors dtype names -> (numpy storage, torch dtype)
_DTYPES = {"BF16": (np.uint16, torch.bfloat16), "F16": (np.float16, torch.float16), "F32": (np.float32, torch.float32)}
KEEP_DTYPES = (torch.bfloat16, torch.float16)  # kept as they are in the panels


class LeanLoadUnsupported(RuntimeError):
    """This checkpoint cannot be loaded lean; `str(error)` says why (the caller loads it in float)."""


@dataclass
class SafetensorsLoad:
    """What `load_safetensors` did, for the log and `/health`."""

    kept: dict[str, int] = field(default_factory=dict)  # dtype -> linears holding the checkpoint's values
    quantized: dict[str, int] = field(default_factory=dict)  # kind -> linears quantized at load
    int8: bool = False  # the quantized linears take int8 activations
    seconds: float = 0.0

    def describe(self) -> str:
        parts = [f"{dtype} kept ({count} linears, C kernel)" for dtype, count in sorted(self.kept.items())]
        parts += [f"{kind} blocks quantized at load ({count} linears)" + (", int8 activations" if self.int8 else "")
                  for kind, count in sorted(self.quantized.items())]
        return "; ".join(parts) or "float"


class HalfEmbedding(nn.Module):
    """`nn.Embedding` over a 16-bit table kept as it is: a lookup widens only the rows it reads
    (exactly: every bfloat16 and float16 is a float32). Tied to an output head of 16-bit panels
    ([vocab / 16, hidden, 16]), it reads its rows out of those panels and holds no table of its own."""

    def __init__(self, table: torch.Tensor, dtype: torch.dtype, padding_idx: int | None,
                 scale: torch.Tensor | None = None):
        super().__init__()
        self.register_buffer("table", table, persistent=False)
        self.panels: torch.Tensor | None = None
        self.scale = scale  # Gemma 3's embed_scale: rows times it, in float32, as its module computes
        self.dtype, self.padding_idx = dtype, padding_idx
        self.num_embeddings, self.embedding_dim = table.shape

    def share_panels(self, panels: torch.Tensor) -> None:
        """Read the rows from a tied head's panels from now on; the table is dropped."""
        self.panels, self.table = panels, None
        self.slots = panel_slots(panels.dtype)  # token t: output t % 16 of panel t // 16, at its slot

    @property
    def weight(self) -> torch.Tensor:  # what code reading `embed_tokens.weight` expects (its dtype, device)
        return self.table if self.table is not None else self.panels

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.table is not None:
            rows = self.table[input_ids].to(self.dtype)
        else:
            ids = input_ids.reshape(-1)
            rows = self.panels[ids // 16, :, self.slots[ids % 16]]
            rows = rows.to(self.dtype).view(*input_ids.shape, self.embedding_dim)
        return rows if self.scale is None else rows * self.scale.to(self.dtype)

    def extra_repr(self) -> str:
        held = "the head's panels" if self.table is None else str(self.table.dtype).removeprefix("torch.")
        return f"{self.num_embeddings}, {self.embedding_dim}, {held} kept"


def _scaled_embedding(model: nn.Module, name: str, tensor) -> nn.Embedding | None:
    """The module of `name` when it is a scaled word embedding (Gemma 3's: the rows times
    `embed_scale`), which a `HalfEmbedding` with that scale computes the same; else None."""
    owner = name.removesuffix(".weight")
    if owner == name or tensor.values.dim() != 2:
        return None
    module = model.get_submodule(owner)
    is_scaled = isinstance(module, nn.Embedding) and type(module).__name__.endswith("ScaledWordEmbedding")
    return module if is_scaled and hasattr(module, "embed_scale") else None


def _embed_scale(module) -> torch.Tensor | None:
    if module is None:
        return None
    scale = module.embed_scale
    return (scale if isinstance(scale, torch.Tensor) else torch.tensor(scale)).detach().float().to("cpu").clone()


@dataclass
class _Tensor:
    """One tensor of a mapped file: its values as a torch view of the mapping (no copy)."""

    name: str
    values: torch.Tensor
    file: "_Mapped"
    start: int
    nbytes: int


def _read_header(path: Path) -> tuple[dict, int]:
    """A `.safetensors` file's tensor table (8 bytes of length, then JSON; its metadata left out) and
    where the data starts."""
    with open(path, "rb") as handle:
        length = int.from_bytes(handle.read(8), "little")
        if length <= 0 or 8 + length > path.stat().st_size:
            raise LeanLoadUnsupported(f"{path.name} is not a safetensors file (its header length is {length})")
        header = json.loads(handle.read(length))
    header.pop("__metadata__", None)
    return header, 8 + length


class _Mapped:
    """A `.safetensors` file mapped read-only; its header parsed (8 bytes of length, then JSON)."""

    def __init__(self, path: Path):
        self.path = path
        self.header, self.data_start = _read_header(path)
        with open(path, "rb") as handle:
            self.map = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
        self.buffer = np.frombuffer(self.map, dtype=np.uint8)

    def tensors(self):
        for name, info in self.header.items():
            kind = _DTYPES.get(info["dtype"])
            if kind is None:
                raise LeanLoadUnsupported(f"tensor {name!r} is {info['dtype']}; the lean loader reads "
                                          f"{', '.join(_DTYPES)}")
            start, end = (self.data_start + offset for offset in info["data_offsets"])
            with warnings.catch_warnings():  # a read-only mapping: nothing here writes to it
                warnings.simplefilter("ignore", UserWarning)
                values = torch.from_numpy(self.buffer[start:end].view(kind[0])).view(kind[1])
            values = values.view(*info["shape"]) if info["shape"] else values[0]
            yield _Tensor(name, values, self, start, end - start)

    def release(self, tensor: _Tensor) -> None:
        """The pages under `tensor` out of the process's resident memory (read again from the file
        if anything touches them later)."""
        first = tensor.start - tensor.start % mmap.PAGESIZE
        end = min(tensor.start + tensor.nbytes, len(self.map))
        if end > first:
            self.map.madvise(mmap.MADV_DONTNEED, first, end - first)


def checkpoint_files(folder: Path) -> list[Path]:
    """The folder's safetensors files (one, or the shards its index names), or [] when it has none."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [folder / shard for shard in shards]
    single = folder / "model.safetensors"
    return [single] if single.is_file() else []


def checkpoint_dtype(files: list[Path]) -> torch.dtype | None:
    """The dtype most of the checkpoint's two-dimensional tensors hold (by count), or None."""
    counts: dict[torch.dtype, int] = {}
    for path in files:
        try:
            header = _read_header(path)[0]
        except (LeanLoadUnsupported, ValueError):  # not readable here: from_pretrained says why
            return None
        for info in header.values():
            if len(info.get("shape", ())) == 2 and info["dtype"] in _DTYPES:
                dtype = _DTYPES[info["dtype"]][1]
                counts[dtype] = counts.get(dtype, 0) + 1
    return max(counts, key=counts.get) if counts else None


def _linear_make(tensor: torch.Tensor, bias: torch.Tensor | None, kernel, quant_kernel, quantize: str | None,
                 int8: bool, report: SafetensorsLoad) -> nn.Module:
    from engine.kernels.linear import QUANTIZE_KINDS
    from engine.model.linears import PanelLinear
    from engine.model.quant import QuantLinear
    from engine.model.quantize import quantize_linear

    if quantize and tensor.shape[1] % 32 == 0:
        report.quantized[quantize] = report.quantized.get(quantize, 0) + 1
        if quantize in QUANTIZE_KINDS:  # in C, row by row from the mapped file
            return QuantLinear.from_gguf(kernel.quantize(tensor, quantize), quantize, bias, quant_kernel, int8)
        return quantize_linear(tensor.float(), bias, quantize, quant_kernel, int8)  # this tensor in float32, never the model
    dtype = tensor.dtype if tensor.dtype in KEEP_DTYPES else torch.float32
    if dtype in KEEP_DTYPES:
        name = str(dtype).removeprefix("torch.")
        report.kept[name] = report.kept.get(name, 0) + 1
    return PanelLinear(None, kernel, weight=tensor, bias=bias, dtype=dtype)


def load_safetensors(folder: Path, *, kernel, quant_kernel=None, quantize: str | None = None, int8: bool = False,
                     trust_remote_code: bool = False, attn_implementation: str | None = None):
    """The model of a safetensors folder on the CPU, lean: returns (model, tokenizer, SafetensorsLoad).
    `kernel`: the C linear (engine/kernels/linear.py); `quantize` (one of quantize.py's LOAD_KINDS) with
    `quant_kernel`: the linears quantized at load instead. Raises LeanLoadUnsupported when the
    checkpoint's tensors do not map onto the model one to one."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    started = time.monotonic()
    files = checkpoint_files(folder)
    if not files:
        raise LeanLoadUnsupported("no model.safetensors (or its index) in the folder")
    config = AutoConfig.from_pretrained(folder, trust_remote_code=trust_remote_code)
    tokenizer = AutoTokenizer.from_pretrained(folder, trust_remote_code=trust_remote_code)
    kwargs = {"dtype": torch.float32, "trust_remote_code": trust_remote_code}
    if attn_implementation is not None:
        kwargs["attn_implementation"] = attn_implementation
    with parameters_on_meta():
        model = AutoModelForCausalLM.from_config(config, **kwargs)
    params = dict(model.named_parameters(remove_duplicate=False))
    linears = {name + ".weight": module for name, module in model.named_modules() if type(module) is nn.Linear}
    embeddings = {name + ".weight": module for name, module in model.named_modules() if type(module) is nn.Embedding}
    mapped = [_Mapped(path) for path in files]
    tensors = {t.name: t for m in mapped for t in m.tensors()}
    unknown = [name for name in tensors if name not in params]
    if unknown:
        raise LeanLoadUnsupported(f"{len(unknown)} checkpoint tensors have other names than the model's "
                                  f"parameters ({', '.join(unknown[:3])}{', ...' if len(unknown) > 3 else ''})")
    report = SafetensorsLoad(int8=bool(quantize) and int8)
    output, inputs = model.get_output_embeddings(), model.get_input_embeddings()
    input_name = next((name + ".weight" for name, module in model.named_modules() if module is inputs), None)
    head_name = next((key for key, module in linears.items() if module is output), None)
    tied = head_name is not None and head_name not in tensors
    deferred = None  # a tied 16-bit embedding, made after its head (whose panels it may read)
    # every float tensor first, so that each linear finds its bias in place
    for name, tensor in tensors.items():
        if name in linears and tensor.values.dim() == 2:
            continue
        module = embeddings.get(name)
        if module is not None and tensor.values.dtype in KEEP_DTYPES and tied and name == input_name and not quantize:
            deferred = (name, tensor, module)
            continue
        scaled = _scaled_embedding(model, name, tensor)
        if (module is not None or scaled is not None) and tensor.values.dtype in KEEP_DTYPES:
            owner, _, leaf = name.removesuffix(".weight").rpartition(".")
            padding = (module or scaled).padding_idx
            setattr(model.get_submodule(owner), leaf,
                    HalfEmbedding(tensor.values.clone(), torch.float32, padding, _embed_scale(scaled)))
        else:
            values = tensor.values.float()  # a 16-bit tensor: already a copy; a float32 one: the mapping
            set_tensor(model, name, values.clone() if values.data_ptr() == tensor.values.data_ptr() else values)
        tensor.file.release(tensor)
    for name, module in linears.items():
        tensor = tensors.get(name)
        if tensor is None:
            if not (tied and name == head_name):
                continue
            tensor = tensors.get(input_name)  # the tied input embedding's table
            if tensor is None:
                continue
        owner, _, leaf = name.removesuffix(".weight").rpartition(".")
        bias = module.bias if module.bias is not None and module.bias.device.type != "meta" else None
        setattr(model.get_submodule(owner), leaf, _linear_make(tensor.values, bias, kernel, quant_kernel, quantize,
                                                               int8, report))
        tensor.file.release(tensor)
    if deferred is not None:
        name, tensor, module = deferred
        head = model.get_output_embeddings()
        shared = getattr(head, "panels", None) is not None and head.panels.dtype == tensor.values.dtype \
            and head.bias is None
        embedding = HalfEmbedding(tensor.values if shared else tensor.values.clone(), torch.float32,
                                  module.padding_idx)
        if shared:
            embedding.share_panels(head.panels)  # one copy of the tied table
        owner, _, leaf = name.removesuffix(".weight").rpartition(".")
        setattr(model.get_submodule(owner), leaf, embedding)
        tensor.file.release(tensor)
    if not any(param.is_floating_point() for param in model.parameters()):
        # every weight packed (OLMo's norms hold none): transformers reads the model's dtype and device
        # from its parameters, so an empty float32 one says them
        model.register_parameter("rill_compute_dtype", nn.Parameter(torch.empty(0), requires_grad=False))
    missing = [name for name, param in model.named_parameters() if param.device.type == "meta"]
    if missing:
        raise LeanLoadUnsupported(f"the checkpoint has no tensor for {len(missing)} of the model's weights "
                                  f"({', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''})")
    del tensors, mapped
    return_freed_memory()
    if (folder / "generation_config.json").is_file():  # what from_pretrained reads beside the weights
        from transformers import GenerationConfig
        model.generation_config = GenerationConfig.from_pretrained(folder)
    model.eval()
    report.seconds = time.monotonic() - started
    return model, tokenizer, report
