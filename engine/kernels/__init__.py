"""The C kernels: csrc/*.c (entry points declared in csrc/rill_kernels.h), built once per CPU by
`build`, each with a binding module that probes it against torch before handing it out:
`linear`, `qlinear`, `decode_attention`, `decode_step`; `gpu` holds the Triton decode kernel."""

from engine.kernels.build import compiled_library
from engine.kernels.decode_attention import decode_attention_kernel
from engine.kernels.decode_step import decode_step_kernel
from engine.kernels.linear import linear_kernel
from engine.kernels.qlinear import quant_kernel

__all__ = ["compiled_library", "decode_attention_kernel", "decode_step_kernel", "linear_kernel", "quant_kernel"]
