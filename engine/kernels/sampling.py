"""`rill_sample` (csrc/sampling.c): a step's next tokens in C on the step's threads.

Penalties, the min_tokens ban, the argmax or temperature, top-k, top-p, min-p and the inverse CDF,
one row per thread, with the uniform draws engine/sampler.py takes from the same generators in the
same order: the tokens of the reference (`_apply_penalties`, `_draw`). A row whose choice a last-bit
difference of exp or of a float64 sum could flip comes back unresolved, and the sampler draws it
with the reference.
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

import numpy as np
import torch

from engine.kernels.build import checked_kernel, compiled_library

SKIP, ARGMAX, DRAW = 0, 1, 2  # a row's mode: the caller has its token / the argmax / a draw
DRAWN, AMBIGUOUS, TOO_FLAT = 0, 1, 2  # a row's status: resolved / the reference decides (two reasons)


class SamplingKernel:
    """`rill_sample` from the compiled library, called with numpy arrays."""

    def __init__(self, library: ctypes.CDLL, path: Path):
        self.path = path
        self._fn = library.rill_sample
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        self._fn.argtypes = [ptr, i64, i64, i64, ptr, ptr, ptr, ptr, ptr, ctypes.c_int]
        self._fn.restype = None
        self._scratch_bytes = library.rill_sample_scratch
        self._scratch_bytes.argtypes = [i64]
        self._scratch_bytes.restype = i64
        self.threads = torch.get_num_threads()
        self._scratch = np.zeros(0, dtype=np.uint8)  # per thread: the kernel's buffers (kept zeroed where it counts)
        self._vocab = 0

    def __call__(self, logits: np.ndarray, fparams: np.ndarray, iparams: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """logits: float32 [rows, vocab] (rows contiguous); fparams: float64 [rows, 7] (temperature, top_p,
        min_p, u, repetition, frequency, presence); iparams: int64 [rows, 7] (mode, history pointer,
        its length, prompt length, banned pointer, their count, top_k). Returns (tokens [rows] int64,
        status [rows] int32)."""
        rows, vocab = logits.shape
        if vocab != self._vocab:
            self._scratch = np.zeros(self._scratch_bytes(vocab) * self.threads, dtype=np.uint8)
            self._vocab = vocab
        tokens = np.zeros(rows, dtype=np.int64)
        status = np.zeros(rows, dtype=np.int32)
        self._fn(logits.ctypes.data, logits.strides[0] // 4, rows, vocab, fparams.ctypes.data, iparams.ctypes.data,
                 tokens.ctypes.data, status.ctypes.data, self._scratch.ctypes.data, self.threads)
        return tokens, status


def _kernel_agrees(kernel: SamplingKernel, draw) -> bool:
    """The kernel's tokens against the reference `draw` (engine/sampler.py's) on random rows: each setting,
    with penalties and a ban, at draws spread over [0, 1); rows it leaves to the reference don't count."""
    from engine.request import SamplingParams

    gen = np.random.default_rng(0)
    vocab = 6000
    settings = [dict(), dict(top_p=0.9), dict(top_k=40), dict(min_p=0.1), dict(top_k=300, top_p=0.95, min_p=0.02),
                dict(top_p=0.999)]
    logits = (gen.standard_normal((len(settings) * 4, vocab)) * 3).astype(np.float32)
    history = np.array([5, 9, 9, 17], dtype=np.int64)
    fparams, iparams, params = [], [], []
    for i in range(len(logits)):
        p = SamplingParams(max_tokens=4, temperature=(0.3, 0.7, 1.0, 1.5)[i % 4], **settings[i // 4])
        u = float(gen.random())
        params.append((p, u))
        fparams.append((p.temperature, p.top_p, p.min_p, u, 1.3, 0.5, 0.25))
        iparams.append((DRAW, history.ctypes.data, len(history), 2, 0, 0, p.top_k))
    tokens, status = kernel(logits, np.array(fparams), np.array(iparams, dtype=np.int64))
    for i, (p, u) in enumerate(params):
        row = logits[i].copy()
        for t in (5, 9, 17):  # repetition 1.3 over all; frequency 0.5 and presence 0.25 over the output (9, 17)
            row[t] = row[t] / np.float32(1.3) if row[t] > 0 else row[t] * np.float32(1.3)
        for t in (9, 17):
            row[t] = (row[t] - np.float32(0.5)) - np.float32(0.25)
        if status[i] == DRAWN and tokens[i] != draw(row, p, u):
            return False
    return int((status == DRAWN).sum()) >= len(params) - 2


_AGREED: dict[tuple[Path, str], bool] = {}  # (cache folder, $RILL_KERNEL_MARCH) -> the library's kernel agreed


def sampling_kernel(cache_dir: Path, draw) -> SamplingKernel | None:
    """A sampling kernel of its own (its scratch is the caller's alone), or None (with the reason logged)
    when it cannot be used here; the library is checked against the reference `draw(row, params, u)`
    (engine/sampler.py's) once per process."""
    key = (cache_dir, os.environ.get("RILL_KERNEL_MARCH", ""))
    if key not in _AGREED:
        kernel = checked_kernel(SamplingKernel, lambda made: _kernel_agrees(made, draw), cache_dir, "sampling",
                                "engine/sampler.py's reference", "the numpy sampler")
        _AGREED[key] = kernel is not None
        return kernel
    return SamplingKernel(*compiled_library(cache_dir)) if _AGREED[key] else None
