"""Where a CPU model's linears run, chosen once per model: C panels, oneDNN, or GGUF blocks.

`pack_linears(model, kernel)` swaps every plain `nn.Linear` of a CPU model for a `PanelLinear`
(float32, on `engine.kernels.linear`) or else a `PackedLinear` holding oneDNN's packed weight (the
original weight tensor is released unless something else, such as tied input embeddings, still
holds it). For oneDNN it checks one layer against `F.linear` first and leaves the model untouched
when oneDNN is missing or disagrees. `F.linear` (MKL sgemm) repacks the weight on every call,
which dominates at the few rows of a decode step.

The choice changes the model in place, so it is made once, by the first engine core built over a
model (`prepare_linears`), and carried in the model's own modules: `describe_linears` reads it
back from them, and a core rebuilt over the same model finds nothing left to pack and the same
label.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from engine.config import rill_cache_dir
from engine.kernels.linear import LinearKernel, linear_kernel, padded_bias, panels_of
from engine.model.quant import FusedProjections, QuantLinear

log = logging.getLogger("rill.engine")

_DTYPES = (torch.float32, torch.bfloat16)


def _linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


class PackedLinear(nn.Module):
    """`nn.Linear` for inference on CPU, the weight pre-packed in oneDNN's blocked layout."""

    kind = "oneDNN"  # where it runs, for `describe_linears`

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), None)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        y = _linear(x.reshape(-1, self.in_features), self.packed, self.bias)
        return y.view(*lead, self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


class PanelLinear(nn.Module):
    """`nn.Linear` for inference on CPU with float32 activations, on `LinearKernel` (csrc/linear.c):
    the weight held as panels of 16 output features, [ceil(out / 16), in, 16], the last one
    zero-padded; float32, or a checkpoint's bfloat16 / float16 weights kept as they are."""

    kind = "C kernel"  # where it runs, for `describe_linears`

    def __init__(self, linear: nn.Linear | None, kernel: LinearKernel, *, weight: torch.Tensor | None = None,
                 bias: torch.Tensor | None = None, dtype: torch.dtype = torch.float32,
                 order: torch.Tensor | None = None):
        super().__init__()
        if linear is not None:
            weight, bias = linear.weight, linear.bias
        self.in_features = weight.shape[1]
        self.out_features = weight.shape[0] if order is None else len(order)  # `order`: the rows kept (16-bit)
        self.kernel = kernel
        if dtype == weight.dtype and dtype != torch.float32:  # 16-bit values as they are: packed in C
            self.panels = kernel.panels16(weight.detach(), order)
        else:
            self.panels = panels_of(weight.detach() if order is None else weight.detach()[order], dtype)
        self.bias = padded_bias(bias, self.panels.shape[0], self.out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        y = self.kernel(x.reshape(-1, self.in_features), self.panels, self.bias, self.out_features)
        return y.view(*lead, self.out_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"weights={str(self.panels.dtype).removeprefix('torch.')}")


def _works(dtype: torch.dtype) -> bool:
    """oneDNN is present and agrees with F.linear on a small case of this dtype."""
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")):
        return False
    try:
        gen = torch.Generator().manual_seed(0)
        w = torch.randn(64, 32, generator=gen).to(dtype)
        x = torch.randn(3, 32, generator=gen).to(dtype)
        got = _linear(x, torch.ops.mkldnn._reorder_linear_weight(w, None), None)
        tol = 1e-4 if dtype == torch.float32 else 5e-2
        return bool(torch.allclose(got.float(), F.linear(x, w).float(), atol=tol, rtol=tol))
    except Exception as exc:  # an old or odd build
        log.info("packed linears unavailable: %s", exc)
        return False


def pack_linears(model: nn.Module, kernel: LinearKernel | None = None) -> tuple[int, str]:
    """Swap the model's plain CPU `nn.Linear`s for `PanelLinear` (float32 with `kernel`) or
    `PackedLinear`; returns how many were swapped and where they run ("C kernel" or "oneDNN")."""
    targets = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
               if type(child) is nn.Linear and child.weight.device.type == "cpu" and child.weight.dtype in _DTYPES]
    dtypes = {child.weight.dtype for _, _, child in targets}
    if len(dtypes) != 1:  # none, or a model of mixed precision: left as it is
        return 0, ""
    (dtype,) = dtypes
    if kernel is not None and dtype == torch.float32:
        kind, make = PanelLinear.kind, lambda linear: PanelLinear(linear, kernel)
    elif _works(dtype):
        kind, make = PackedLinear.kind, PackedLinear
    else:
        return 0, ""
    count = len(targets)
    while targets:  # each original weight can go as soon as its replacement exists
        parent, name, child = targets.pop()
        setattr(parent, name, make(child))
    return count, kind


def describe_linears(model: nn.Module) -> str:
    """Where the model's linears run, read from its modules: "torch", "C kernel", "oneDNN", or
    "<kinds> blocks (C kernel)" with ", the rest on the <C kernel | oneDNN>" when some are packed."""
    packed = sorted({m.kind for m in model.modules() if isinstance(m, (PanelLinear, PackedLinear))})
    rest = packed[0] if len(packed) == 1 else "torch"
    blocks = sorted({m.kind for m in model.modules() if isinstance(m, (QuantLinear, FusedProjections))})
    if not blocks:
        return rest
    return f"{'/'.join(blocks)} blocks (C kernel)" + (f", the rest on the {rest}" if packed else "")


def prepare_linears(model: nn.Module, packed_linears: bool, use_kernel: bool) -> int:
    """Pack a CPU model's plain linears once (`packed_linears`; on the C kernel when `use_kernel`
    and the model is float32, else oneDNN); returns how many this call packed (0 when an earlier
    core already did)."""
    if model.device.type != "cpu" or not packed_linears:
        return 0
    if not any(type(m) is nn.Linear for m in model.modules()):
        return 0  # packed before (or nothing to pack): the kernel is not built or probed again
    kernel = linear_kernel(rill_cache_dir()) if use_kernel and model.dtype == torch.float32 else None
    return pack_linears(model, kernel)[0]
