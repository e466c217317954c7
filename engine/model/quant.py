"""Block-quantized linears on the CPU: GGUF's quantized tensors kept as blocks, computed in C.

A GGUF model's quantized weights stay quantized in memory, as the panels of one of the kernels'
kinds (engine/model/gguf_blocks.py reads them, engine/model/panels.py lays them out; `rill_repack`
does both in C from the file's raw rows). The lean loader (engine/model/gguf.py) makes each linear
of such a tensor with `QuantLinear.from_gguf`; a safetensors model can be quantized at load the
same way (engine/model/quantize.py).

Activations stay float32, so a step computes the same products as the float32 model whose
weights are the de-quantized blocks, up to the order of the additions: greedy output matches HF
`generate` on that de-quantized model (the parity tests).
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from engine.kernels.linear import padded_bias
from engine.kernels.qlinear import QuantKernel
from engine.model.gguf_blocks import GGUF_BLOCKS, GGUF_TYPES, blocks_of_gguf, held_kind
from engine.model.panels import panels_of_blocks


class QuantLinear(nn.Module):
    """`nn.Linear` for inference on CPU with its weight kept as blocks of one of the kernels' kinds
    (Q8_0, Q4_0, Q4_1, Q5_1, Q6_K, Q4_K, Q6_KS: every type of GGUF_TYPES); `int8`: its input rounded to int8 per
    block of 32 (faster, lossy) instead of float32."""

    def __init__(self, q: np.ndarray, d: np.ndarray, m: np.ndarray | None, kind: str, bias: torch.Tensor | None,
                 kernel: QuantKernel, int8: bool = False):
        super().__init__()
        self._hold(panels_of_blocks(q, d, m, kind, int8), q.shape[0], q.shape[1] * 32, kind, bias, kernel, int8)

    def _hold(self, panels: torch.Tensor, out_features: int, in_features: int, kind: str,
              bias: torch.Tensor | None, kernel: QuantKernel, int8: bool, source: str | None = None):
        self.out_features, self.in_features = out_features, in_features
        self.kind, self.kernel, self.int8 = kind, kernel, int8
        self.source = source or kind  # the file's type of block (Q5_K is held as q5_1 blocks, Q6_K as q6_ks)
        self.panels = panels  # uint8 [ceil(out / 16), in / 32 * block bytes]
        self.bias = padded_bias(bias, panels.shape[0], out_features)

    @classmethod
    def from_gguf(cls, raw: np.ndarray, ggml_type: str, bias: torch.Tensor | None, kernel: QuantKernel | None,
                  int8: bool = False, order: np.ndarray | None = None) -> "QuantLinear":
        """The layer of a GGUF tensor's raw blocks (uint8 [out, row bytes], e.g. the file's memory
        map; `ggml_type` a key of GGUF_TYPES), rows in `order`: laid out by the kernel library's
        `rill_repack` (under a nanosecond a weight), or without it by numpy (`blocks_of_gguf`, then
        `panels_of_blocks`: the reference, equal byte for byte)."""
        if ggml_type not in GGUF_TYPES:
            raise ValueError(f"GGUF blocks kept as blocks: {', '.join(GGUF_TYPES)}. Given: {ggml_type!r}")
        kind = held_kind(ggml_type, int8)
        weights, size = GGUF_BLOCKS[ggml_type]
        if raw.ndim != 2 or raw.shape[1] % size:
            raise ValueError(f"{ggml_type} rows are whole blocks of {size} bytes; given raw of shape {raw.shape}")
        in_features = raw.shape[1] // size * weights
        if kernel is not None:
            panels = kernel.repack(raw, ggml_type, kind, in_features, order, int8)
        else:
            panels = panels_of_blocks(*blocks_of_gguf(raw, ggml_type, order), int8)
        layer = cls.__new__(cls)
        nn.Module.__init__(layer)
        layer._hold(panels, raw.shape[0] if order is None else len(order), in_features, kind, bias, kernel, int8,
                    ggml_type)
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        y = self.kernel(x.reshape(-1, self.in_features), self.panels, self.bias, self.out_features, self.kind,
                        self.int8)
        return y.view(*lead, self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.kind}" + \
            (f" (GGUF {self.source})" if self.source != self.kind else "") + (", int8 activations" if self.int8 else "")


class FusedProjections(nn.Module):
    """Several `QuantLinear`s of one input (q/k/v, gate/up) as one kernel call: their panels end to
    end. The model still calls each projection; the first call computes all of them for its input
    and the others return their columns of that result while the input is the same tensor."""

    def __init__(self, parts: list[QuantLinear]):
        super().__init__()
        first = parts[0]
        self.kind, self.kernel, self.in_features, self.int8 = first.kind, first.kernel, first.in_features, first.int8
        self.panels = torch.cat([part.panels for part in parts])
        self.bias = None
        if any(part.bias is not None for part in parts):
            self.bias = torch.cat([part.bias if part.bias is not None else torch.zeros(part.panels.shape[0] * 16)
                                   for part in parts])
        self.widths = [part.panels.shape[0] * 16 for part in parts]
        self.out_features = sum(self.widths)
        self._input: torch.Tensor | None = None  # the input of the last fused call
        self._outputs: list[torch.Tensor] = []

    def part(self, index: int, x: torch.Tensor) -> torch.Tensor:
        if index == 0 or x is not self._input:
            lead = x.shape[:-1]
            y = self.kernel(x.reshape(-1, self.in_features), self.panels, self.bias, self.out_features, self.kind,
                            self.int8)
            self._outputs = [piece.view(*lead, piece.shape[-1]) for piece in y.split(self.widths, dim=-1)]
            self._input = x
        out = self._outputs[index]
        if index == len(self.widths) - 1:  # the last part: forget the input (no reference kept past the step)
            self._input, self._outputs = None, []
        return out


class FusedPart(nn.Module):
    """One projection of a `FusedProjections` group, where the model expects its own linear."""

    def __init__(self, group: FusedProjections, index: int, out_features: int):
        super().__init__()
        self.group, self.index = group, index
        self.in_features, self.out_features = group.in_features, out_features
        self.kind = group.kind

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.group.part(self.index, x)
        return out if out.shape[-1] == self.out_features else out[..., :self.out_features]

    def extra_repr(self) -> str:
        return f"part {self.index} of {len(self.group.widths)}, out_features={self.out_features}, {self.kind}"


FUSABLE = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))  # the Llama family's names


def fuse_projections(model: nn.Module) -> int:
    """Group the `QuantLinear` projections that read one input (by their names in the Llama family:
    q/k/v in attention, gate/up in the MLP) into `FusedProjections`; returns the groups made.
    Only whole panels are fused (each part but the last a multiple of 16 outputs); each group's parts
    are freed as it is made (held to the end, they raised the load's peak memory by half)."""
    groups = 0
    # the modules that own projections (a list of every module would keep the replaced parts alive)
    owners = [module for module in model.modules() if any(hasattr(module, names[0]) for names in FUSABLE)]
    for module in owners:
        for names in FUSABLE:
            parts = [getattr(module, name, None) for name in names]
            if not all(type(part) is QuantLinear for part in parts):
                continue
            if len({(part.kind, part.in_features, part.int8) for part in parts}) != 1:
                continue
            if any(part.out_features % 16 for part in parts[:-1]):
                continue
            group = FusedProjections(parts)
            for index, (name, part) in enumerate(zip(names, parts)):
                setattr(module, name, FusedPart(group, index, part.out_features))
            module.add_module("fused_" + "_".join(n.removesuffix("_proj") for n in names), group)
            groups += 1
    return groups
