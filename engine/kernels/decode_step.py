"""`rill_decode_step` (csrc/decode_layer.c): every layer of a Llama-family decode step in one C call.

The records it reads (`Lin`, `Layer`) mirror csrc/rill_kernels.h; `engine.runner.native.NativeDecoder`
fills them from a model, and probes the step before it is used (`native_decode_kernel`).
"""

from __future__ import annotations

import ctypes
from pathlib import Path


class Lin(ctypes.Structure):
    """csrc/rill_kernels.h's rill_lin: a linear as the kernels hold it (kind -1 float32 panels, 0-4 blocks,
    16 + 0-4 blocks with int8 activations: engine/kernels/qlinear.py's KINDS and INT8_KIND)."""

    _fields_ = [("panels", ctypes.c_void_p), ("bias", ctypes.c_void_p), ("out", ctypes.c_int64),
                ("in_", ctypes.c_int64), ("kind", ctypes.c_int64)]


class Layer(ctypes.Structure):
    """csrc/rill_kernels.h's rill_layer: one decoder layer's weights and K/V cache."""

    _fields_ = [("norm1", ctypes.c_void_p), ("norm2", ctypes.c_void_p), ("qkv", ctypes.POINTER(Lin)),
                ("o", ctypes.POINTER(Lin)), ("gate_up", ctypes.POINTER(Lin)), ("down", ctypes.POINTER(Lin)),
                ("q_norm", ctypes.c_void_p), ("k_norm", ctypes.c_void_p), ("k_cache", ctypes.c_void_p),
                ("v_cache", ctypes.c_void_p), ("n_qkv", ctypes.c_int64), ("q_off", ctypes.c_int64),
                ("k_off", ctypes.c_int64), ("v_off", ctypes.c_int64), ("n_gu", ctypes.c_int64),
                ("up_off", ctypes.c_int64), ("window", ctypes.c_int64), ("eps", ctypes.c_float),
                ("scale", ctypes.c_float)]


class DecodeStepKernel:
    """`rill_decode_step` from the compiled library, its argument types set (called by `NativeDecoder`)."""

    def __init__(self, library: ctypes.CDLL, path: Path):
        self.library, self.path = library, path
        self.fn = library.rill_decode_step
        ptr, i64, i32, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
        self.fn.argtypes = [ctypes.POINTER(Layer), i32, ptr, i64, i64, i64, ptr, ptr, ptr, ptr, i64, ptr, i32, i32,
                            i32, ptr, i32, ptr, i64, ptr, f32, ctypes.POINTER(Lin), ptr, ptr,
                            ctypes.POINTER(Lin), ptr, ctypes.POINTER(ctypes.c_int64), ctypes.POINTER(ctypes.c_int)]
        self.fn.restype = i32

