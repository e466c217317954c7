"""The C kernels: csrc/*.c (entry points declared in csrc/rill_kernels.h), built once per CPU by
`build`, each with a binding module: `linear` and `decode_attention` probe theirs against torch
before handing it out; `qlinear` (probed by engine/model/quant_probe.py) and `decode_step` (by
engine/runner/native.py) are checked beside the modules they run; `gpu` holds the Triton decode
kernel."""

from engine.kernels.build import compiled_library
from engine.kernels.decode_attention import decode_attention_kernel
from engine.kernels.linear import linear_kernel

__all__ = ["compiled_library", "decode_attention_kernel", "linear_kernel"]
