"""`rill_decode_step` (csrc/decode_layer.c): every layer of a Llama-family decode step in one C call.

The records it reads (`Lin`, `Layer`) mirror csrc/rill_kernels.h; `engine.runner.native.NativeDecoder`
fills them from a model. Like the other kernels, the step is checked at first build or load: a
tiny random float32 Llama with grouped queries, on the C linears, through
`NativeDecoder` against the same model's own modules; on a mismatch the engine keeps transformers'
modules and says so in its log.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from engine.kernels.build import checked_kernel


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


def _decode_step_agrees(kernel: DecodeStepKernel) -> bool:
    """A tiny random Llama (2 layers, grouped queries, 6 tokens) on the C linears: every token of
    a prompt run through the native step as a decode (each attending to the positions up to its
    own) gives the logits of the model's own forward over the whole prompt."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from engine.attention import PagedKVCache
    from engine.kernels.linear import LinearKernel
    from engine.model.linears import pack_linears
    from engine.runner.native import NativeDecoder

    torch.manual_seed(0)  # the model's initialisation; the caller's generator state is restored below
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         attn_implementation="eager")
    model = LlamaForCausalLM(config).eval()
    tokens = torch.randint(0, 64, (6,))
    with torch.inference_mode():
        want = model(input_ids=tokens[None], use_cache=False).logits[0].float()  # [6, vocab]
    pack_linears(model, LinearKernel(kernel.library, kernel.path))
    cache = PagedKVCache(2, 2, 8, 2, 8, torch.float32, torch.device("cpu"))
    positions = torch.arange(6)
    slots = positions.repeat(6, 1)  # [6, 6]: row r attends slots 0..r
    got = NativeDecoder(model, kernel).run(tokens, positions, cache, positions, slots, positions + 1)
    return bool(torch.allclose(got.logits, want, atol=1e-4, rtol=1e-4))


def decode_step_kernel(cache_dir: Path) -> DecodeStepKernel | None:
    """The compiled native decode step, or None (with the reason logged) when it cannot be used here."""
    rng = torch.random.get_rng_state()
    try:
        return checked_kernel(DecodeStepKernel, _decode_step_agrees, cache_dir, "native decode step",
                              "transformers' modules", "transformers' modules")
    finally:
        torch.random.set_rng_state(rng)
