"""The peak multiply-add rates of this CPU's AVX2 routes (bench/peak_rates.c): float32 multiply-adds
against the integer byte and word products, and what the exact integer routes (an activation in
three int8 or two int16 pieces) would reach. What bounds a prefill or a batched step on this host.

    python -m bench.peak_rates [--iterations 300000000]

Every thread (OMP_NUM_THREADS, else every core); a few seconds. Needs a C compiler with AVX2."""

from __future__ import annotations

import argparse
import subprocess
import tempfile
from pathlib import Path

from bench.peers import cpu_line

SOURCE = Path(__file__).with_name("peak_rates.c")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.peak_rates", description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=300_000_000, help="loop trips per route and thread")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as where:
        binary = Path(where) / "peak_rates"
        subprocess.run(["cc", "-O3", "-march=native", "-fopenmp", "-o", str(binary), str(SOURCE)], check=True)
        print(f"CPU: {cpu_line()}")
        print(subprocess.run([str(binary), str(args.iterations)], check=True, capture_output=True, text=True).stdout,
              end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
