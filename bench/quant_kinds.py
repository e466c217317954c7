"""Each GGUF type's blocks through the block kernels, side by side in one run: the kind that holds
it, its bytes per weight, and at one row (a decode step) the time, the GB/s of panels read and the
weights per second, with its ratio to Q4_1's and Q8_0's; then the load: QuantLinear.from_gguf's C
repack against the numpy path, in nanoseconds per weight.

    .venv/bin/python -m bench.quant_kinds [--types q8_0,q4_1,q5_k,q6_k] [--rows 1] [--threads 2] [--int8]
                                          [--shapes 8192x2048,2048x8192] [--rounds 40]

Random raw blocks (valid for any type) of an 8192 x 2048 and a 2048 x 8192 layer, four copies of
each so that the weights come from memory as a model's do, every type's layers taking turns;
the 20th percentile of 40 rounds (other processes on the host slow some calls a lot).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
import torch

from engine.model.gguf_blocks import GGUF_TYPES, random_gguf_blocks
from engine.model.loading import rill_cache_dir
from engine.model.quant import QuantLinear
from engine.model.quant_probe import quant_kernel

SHAPES = [(8192, 2048), (2048, 8192)]  # out x in
COPIES, ROUNDS = 4, 40


def decode_times(kernel, types: list[str], out: int, inputs: int, rows: int, int8: bool,
                 rounds: int = ROUNDS) -> dict[str, float]:
    """Seconds per call (20th percentile) of each type's layer at `rows` rows, the types interleaved."""
    layers = {t: [QuantLinear.from_gguf(random_gguf_blocks(t, out, inputs, seed=c), t, None, kernel, int8)
                  for c in range(COPIES)] for t in types}
    x = torch.randn(rows, inputs)
    times: dict[str, list[float]] = {t: [] for t in types}
    for _ in range(rounds):
        for t in types:
            for layer in layers[t]:
                start = time.perf_counter()
                layer(x)
                times[t].append(time.perf_counter() - start)
    return {t: float(np.percentile(times[t], 20)) for t in types}


def repack_ns(kernel, ggml_type: str, int8: bool, numpy_path: bool, size: int = 4096) -> float:
    """Nanoseconds per weight of from_gguf on a `size` x `size` tensor, rows reordered (best of 3)."""
    raw = random_gguf_blocks(ggml_type, size, size, seed=1)
    order = np.random.default_rng(0).permutation(size)
    best = float("inf")
    for _ in range(1 if numpy_path else 3):
        start = time.perf_counter()
        QuantLinear.from_gguf(raw, ggml_type, None, None if numpy_path else kernel, int8, order)
        best = min(best, time.perf_counter() - start)
    return best / size / size * 1e9


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--types", default="q8_0,q4_1,q4_k,q5_k,q6_k,q5_0,q3_k,iq4_xs")
    parser.add_argument("--rows", type=int, default=1)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--int8", action="store_true", help="int8 activations (csrc/qlinear_i8.c)")
    parser.add_argument("--no-numpy", action="store_true", help="skip the numpy repack (slow: 5-25 ns a weight)")
    parser.add_argument("--shapes", default=",".join(f"{o}x{i}" for o, i in SHAPES), help="OUTxIN,... of the layers")
    parser.add_argument("--rounds", type=int, default=ROUNDS, help="calls of each layer (the 20th percentile is kept)")
    parser.add_argument("--repack-size", type=int, default=4096, help="the load's square tensor")
    args = parser.parse_args(argv)
    try:
        shapes = [tuple(int(n) for n in shape.split("x")) for shape in args.shapes.split(",")]
    except ValueError:
        parser.error(f"--shapes: OUTxIN pairs, comma-separated, given {args.shapes!r}")
    if any(len(shape) != 2 or shape[1] % 256 for shape in shapes) or args.repack_size % 256:
        parser.error(f"--shapes and --repack-size: IN a multiple of 256 (a super-block), given {args.shapes!r} "
                     f"and {args.repack_size}")
    types = [t for t in ("q4_1", "q8_0") if t not in args.types.split(",")] + args.types.split(",")
    kernel = quant_kernel(rill_cache_dir())
    if kernel is None:
        raise SystemExit("the block kernels are not built here (see the log)")
    kernel.threads = args.threads
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), "?")
    print(f"{cpu}, {kernel.isa}, {args.threads} threads; {args.rows} row(s), "
          f"{'int8' if args.int8 else 'float32'} activations")
    for out, inputs in shapes:
        times = decode_times(kernel, types, out, inputs, args.rows, args.int8, args.rounds)
        print(f"\n{out} x {inputs}   type    kind   bytes/weight      ms     GB/s  Gweights/s  vs q4_1  vs q8_0")
        for t in types:
            kind = GGUF_TYPES[t][1]
            panel_bytes = QuantLinear.from_gguf(random_gguf_blocks(t, 16, inputs), t, None, kernel).panels.numel() / 16
            per_weight = panel_bytes / inputs
            seconds = times[t]
            print(f"{'':13s}{t:8s}{kind:7s}{per_weight:9.3f}{seconds * 1e3:12.3f}{out * panel_bytes / seconds / 1e9:9.1f}"
                  f"{out * inputs / seconds / 1e9:12.1f}{times['q4_1'] / seconds:9.2f}{times['q8_0'] / seconds:9.2f}")
    print(f"\nload (from_gguf, {args.repack_size} x {args.repack_size}, rows reordered): ns per weight")
    print("type     C float  C int8" + ("   numpy" if not args.no_numpy else ""))
    for t in types:
        size = args.repack_size
        line = f"{t:8s}{repack_ns(kernel, t, False, False, size):8.2f}{repack_ns(kernel, t, True, False, size):8.2f}"
        if not args.no_numpy:
            line += f"{repack_ns(kernel, t, False, True, size):8.2f}"
        print(line, flush=True)


if __name__ == "__main__":
    main()
