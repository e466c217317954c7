"""The block kernels' AVX-512 paths (and AVX-VNNI's) run on an AVX2 host, against their references:
csrc/qlinear.c and csrc/qlinear_i8.c compiled with those instruction sets emulated on AVX2
(bench/avx512_on_avx2.h, bench/avxvnni_on_avx2.h), every source for x86-64-v3 (AVX2, FMA, F16C).

    .venv/bin/python -m bench.avx512_check [--vbmi] [--vnni256] [--types q4_k,...] [--rows 1,7,300] [--opt-level 3]

Checks the start-up probe (`quant_agrees`: every kind, float32 and int8 activations, and the
repack), then every GGUF type's blocks (or --types') at 1 to 300 rows (or --rows: the row-by-row
path, the tiles, sets of rows) against F.linear of gguf-py's weight (int8: of the rounded inputs).
Builds only the sources those entry points live in, each apart on every core. Slow (the emulation
and a compile of a few minutes at -O3); for changes to the AVX-512 code on a host without it.
Exit status 1 on any disagreement; 0, saying why, on a CPU without AVX2 (nothing to emulate on).
"""

from __future__ import annotations

import argparse
import ctypes
import os
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import gguf
import torch
import torch.nn.functional as F

from engine.kernels import build
from engine.kernels.qlinear import QuantKernel
from engine.model.gguf_blocks import GGUF_TYPES, random_gguf_blocks
from engine.model.quant import QuantLinear
from engine.model.quant_probe import quant_agrees, quantize_activations

HERE = Path(__file__).resolve().parent
EMULATED = ("qlinear.c", "qlinear_i8.c")
# the sources of QuantKernel's entry points (the AMX tiles' switches, the repack); the rest of the
# library has no AVX-512 code of its own to check here
BUILT = (*EMULATED, "qlinear_amx.c", "repack.c")
MARCH = "x86-64-v3"  # the AVX2 the emulation is written in, on any x86 CPU that has it
ROWS = (1, 2, 3, 4, 7, 8, 9, 13, 17, 64, 300)


def emulated_library(folder: Path, vbmi: bool, vnni256: bool, opt: str = "-O3") -> Path:
    """A library of QuantKernel's sources, the two block kernels built for the emulated instruction set."""
    if vnni256:
        extra = ["-D__AVXVNNI__", "-include", str(HERE / "avxvnni_on_avx2.h")]
    else:
        extra = ["-include", str(HERE / "avx512_on_avx2.h")] + (["-DRILL_EMULATE_VBMI"] if vbmi else [])
    flags = [opt if f == "-O3" else f for f in build.CFLAGS if f != "-shared"] + [f"-march={MARCH}"]
    sources = [source for source in build.SOURCES if source.name in BUILT]

    def compile_one(source: Path) -> str:
        obj = folder / f"{source.stem}.o"
        done = subprocess.run(["cc", *flags, "-c", str(source), "-o", str(obj),
                               *(extra if source.name in EMULATED else [])], capture_output=True, text=True)
        if done.returncode:  # the warnings of a good compile are not shown
            raise SystemExit(f"compiling {source.name} failed:\n{done.stderr[-3000:]}")
        return str(obj)

    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:  # the largest first
        objects = list(pool.map(compile_one, sorted(sources, key=lambda source: -source.stat().st_size)))
    library = folder / "rill_kernels_emulated.so"
    subprocess.run(["cc", "-shared", "-fopenmp", *objects, "-o", str(library), "-lm"], check=True)
    return library


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vbmi", action="store_true", help="AVX-512 with VBMI (the byte-permutation paths)")
    parser.add_argument("--vnni256", action="store_true", help="AVX2 with AVX-VNNI instead of AVX-512")
    parser.add_argument("--types", default=",".join(GGUF_TYPES), help="the GGUF types checked (default: every one)")
    parser.add_argument("--rows", default=",".join(map(str, ROWS)), help="the rows of each check")
    parser.add_argument("--opt-level", type=int, default=3, choices=(0, 1, 2, 3),
                        help="the build's -O level (3: the kernels' own build)")
    args = parser.parse_args(argv)
    types = [t.strip() for t in args.types.split(",") if t.strip()]
    if not types or set(types) - set(GGUF_TYPES):
        parser.error(f"--types: of {', '.join(GGUF_TYPES)}; given {args.types!r}")
    try:
        rows_checked = [int(r) for r in args.rows.split(",")]
    except ValueError:
        rows_checked = []
    if not rows_checked or min(rows_checked) < 1:
        parser.error(f"--rows: positive numbers, comma-separated; given {args.rows!r}")
    cpu_flags = set(build._cpu_flags().split())
    if not {"avx2", "fma", "f16c"} <= cpu_flags:
        print(f"This CPU lacks AVX2, FMA or F16C ({MARCH}), which the emulation runs on: nothing checked.")
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        library = emulated_library(Path(tmp), args.vbmi, args.vnni256, f"-O{args.opt_level}")
        kernel = QuantKernel(ctypes.CDLL(str(library)), library)
        failures = cases = 0
        if not args.vnni256:  # its emulated vpdpbusd saturates on Q8_0, which the probe includes
            agrees = quant_agrees(kernel)
            failures += not agrees
            print(f"{kernel.isa}: the start-up probe {'agrees' if agrees else 'DISAGREES'}")
        for ggml_type in types:
            kind = GGUF_TYPES[ggml_type][1]
            raw = random_gguf_blocks(ggml_type, 45, 512, seed=3)
            weight = torch.from_numpy(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[ggml_type.upper()]))
            bias = torch.randn(45, generator=torch.Generator().manual_seed(0))
            for int8 in (False, True):
                if args.vnni256 and (kind == "q8_0" or not int8):
                    continue
                layer = QuantLinear.from_gguf(raw, ggml_type, bias, kernel, int8)
                for rows in rows_checked:
                    cases += 1
                    x = torch.randn(rows, 530, generator=torch.Generator().manual_seed(rows))[:, :512]
                    expected = F.linear(quantize_activations(x.contiguous()) if int8 else x, weight, bias)
                    if not torch.allclose(layer(x), expected, atol=1e-4, rtol=1e-4):
                        failures += 1
                        print(f"{ggml_type} ({kind}), {'int8' if int8 else 'float32'} activations, {rows} rows: "
                              f"off by {(layer(x) - expected).abs().max().item():.3g}")
        print(f"{'AVX-VNNI' if args.vnni256 else 'AVX-512' + (' VBMI' if args.vbmi else '')} emulated: "
              f"{failures} disagreements in {cases} checks")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
