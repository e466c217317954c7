"""Which activations route runs a GGUF's block linears faster on this CPU, timed at load.

The exact default (float32 activations, engine/kernels/csrc/qlinear.c) and `--activations int8`
(each block of 32 inputs rounded to int8 as llama.cpp does, csrc/qlinear_i8.c) read the same
blocks; which is faster depends on the CPU (byte products against float32 multiply-adds, AMX
tiles) and on the rows a call multiplies. One of the file's tensors is held both ways and
timed at one row (a visitor's decode step) and at a prompt chunk's rows, so the log and /health
tell the owner of this host which route pays here, by how much, and what int8 costs in exactness.
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass

import numpy as np
import torch

log = logging.getLogger("rill.loading")

PREFILL_ROWS = 64  # a prompt chunk's rows, for the prefill ratio
MIN_SECONDS = 0.002  # each timing repeats its call until it spans at least this long
ROUNDS = 7  # alternations of the two routes
# measured with `python -m bench.divergence` on the embedded SmolLM2 (docs/benchmarks-history.md)
INT8_DIVERGENCE = "on the embedded SmolLM2 int8 activations pick float32's next token 96.9% of the time (mean KL 0.004)"


@dataclass(frozen=True, slots=True)
class ActivationRoutes:
    """int8's speed over the exact route on this CPU: above 1, int8 is faster."""

    in_use: str  # "float32" (exact, the default) or "int8"
    one_row: float  # at one row: one visitor's decode step
    prefill: float  # at PREFILL_ROWS rows: a prompt's chunk
    timed: str  # the tensor timed and its type

    def advice(self) -> str:
        """One line for the log and /health: what to pick on this host, and what int8 costs."""
        speeds = (f"int8 activations run one visitor's linears {self.one_row:.2f}x and a prompt's "
                  f"{self.prefill:.2f}x the exact route's speed on this CPU")
        if self.in_use == "int8":
            if self.one_row < 1 and self.prefill < 1:
                return f"{speeds}: the exact default (no --activations) is faster here, and exact"
            return f"{speeds}; {INT8_DIVERGENCE}"
        if self.one_row > 1.1 or self.prefill > 1.1:
            return (f"{speeds}: --activations int8 is faster here, lossy as llama.cpp ({INT8_DIVERGENCE}; "
                    f"python -m bench.divergence --model M measures yours)")
        return f"{speeds}: the exact default is as fast here"

    def as_dict(self) -> dict:
        return {**asdict(self), "advice": self.advice()}


def _seconds(fn) -> float:
    """Seconds one call of fn takes, over enough calls to span MIN_SECONDS."""
    calls, start = 0, time.perf_counter()
    while True:
        fn()
        calls += 1
        spent = time.perf_counter() - start
        if spent >= MIN_SECONDS:
            return spent / calls


def _both_ways(blocks, kernel) -> tuple:
    """A GGUF tensor (`_Blocks`) held for float32 activations and for int8 ones."""
    from engine.model.quant import QuantLinear

    raw = np.asarray(blocks.raw)
    return tuple(QuantLinear.from_gguf(raw, blocks.ggml_type, None, kernel, int8, blocks.order) for int8 in (False, True))


def _ratio(exact, int8, rows: int) -> float:
    """The exact route's time over int8's, each the least of ROUNDS alternated timings (a busy host
    only adds time)."""
    x = torch.randn(rows, exact.in_features, generator=torch.Generator().manual_seed(0))
    exact(x), int8(x)  # first calls allocate the kernels' buffers
    times = [(_seconds(lambda: exact(x)), _seconds(lambda: int8(x))) for _ in range(ROUNDS)]
    return min(t[0] for t in times) / min(t[1] for t in times)


def compare_activations(pending: dict, kernel, int8_in_use: bool) -> ActivationRoutes | None:
    """Time block tensors of `pending` (target -> engine/model/gguf.py's `_Blocks`) of the layers' type,
    held with float32 and with int8 activations; None when there is none to time (16-bit or no kernel)."""
    from engine.model.gguf_blocks import GGUF_TYPES

    blocks = [b for b in pending.values() if b.ggml_type in GGUF_TYPES]
    if kernel is None or not blocks:
        return None
    types = [b.ggml_type for b in blocks]
    common = max(set(types), key=types.count)  # the layers' type (a head may have its own)
    of_type = sorted((b for b in blocks if b.ggml_type == common), key=lambda b: b.raw.nbytes)
    started = time.perf_counter()
    try:
        with torch.inference_mode():
            # one row on the largest tensor (its reads count, as in a step), a prompt's rows on the smallest
            one_row = _ratio(*_both_ways(of_type[-1], kernel), 1)
            prefill = _ratio(*_both_ways(of_type[0], kernel), PREFILL_ROWS)
    except (ValueError, MemoryError, RuntimeError) as error:  # the load goes on without the comparison
        log.warning("could not time the activations routes: %s", error)
        return None
    shape = tuple(np.asarray(of_type[-1].raw).shape)
    routes = ActivationRoutes("int8" if int8_in_use else "float32", round(one_row, 2), round(prefill, 2),
                              f"{common} tensors of {shape[0]} rows and less")
    log.info("activations: %s (%s timed in %.2f s)", routes.advice(), routes.timed, time.perf_counter() - started)
    return routes
