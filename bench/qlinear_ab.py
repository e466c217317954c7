"""The block kernels (csrc/qlinear.c, csrc/qlinear_i8.c, and csrc/qlinear_amx.c where the revision
has it) of a git revision against the working tree's, side by side in one C process: SmolLM2-135M's
four linear shapes (or --shapes), Q4_1, weights from memory, medians of 40 alternations (of about
0.1 s a build: seconds a shape).

    python -m bench.qlinear_ab 948ef9f [--rows 1,8] [--threads 2] [--int8] [--shapes 6144x2048,...] [--kinds 2:5]
                                       [--alternations 40] [--opt-level 3]

The revision's sources are compiled with their entry points renamed (`-Drill_qlinear=...`), so
both builds live in one binary and take turns under the same conditions; each source is compiled
apart, on every core, then linked once."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CSRC = ROOT / "engine" / "kernels" / "csrc"
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # fused q/k/v, o, fused gate/up, down
FLAGS = ["-march=native", "-fopenmp", "-std=gnu11"]  # and -O3 (the kernels' build), or --opt-level's
KERNELS = ("qlinear.c", "qlinear_i8.c", "qlinear_amx.c")  # the AMX tiles' file where a revision has it


def build(revision: str, where: Path, opt: str = "-O3") -> Path:
    old = where / "old"
    old.mkdir()
    folder = "engine/kernels/csrc"  # engine/csrc before the kernels had a package of their own
    listed = subprocess.run(["git", "ls-tree", "--name-only", f"{revision}:{folder}"], cwd=ROOT,
                            capture_output=True, text=True).stdout.split()
    if not listed:
        folder = "engine/csrc"
        listed = subprocess.run(["git", "ls-tree", "--name-only", f"{revision}:{folder}"], cwd=ROOT,
                                capture_output=True, text=True, check=True).stdout.split()
    for name in listed:
        if name in KERNELS or name.endswith(".h"):
            text = subprocess.run(["git", "show", f"{revision}:{folder}/{name}"], cwd=ROOT,
                                  capture_output=True, text=True, check=True).stdout
            (old / name).write_text(text)
    renamed = [f"-D{fn}={fn}_a" for fn in ("rill_qlinear", "rill_qlinear_i8", "rill_qlinear_vector_bits",
                                           "rill_qlinear_few_rows", "rill_qlinear_widen_rows",
                                           "rill_qlinear_amx", "rill_qlinear_amx_rows", "rill_qlinear_amx_ready")]
    jobs = [(old / name, where / f"old_{name}.o", renamed) for name in KERNELS if (old / name).exists()]
    jobs += [(CSRC / name, where / f"new_{name}.o", []) for name in KERNELS]
    jobs.append((ROOT / "bench" / "qlinear_ab.c", where / "qlinear_ab.o", [f"-I{CSRC}"]))
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        list(pool.map(lambda job: subprocess.run(["cc", opt, *FLAGS, "-c", str(job[0]), "-o", str(job[1]), *job[2]],
                                                 check=True), jobs))
    binary = where / "qlinear_ab"
    subprocess.run(["cc", opt, *FLAGS, *(str(obj) for _, obj, _ in jobs), "-o", str(binary), "-lm"], check=True)
    return binary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("revision", help="the git revision to compare with (its engine/kernels/csrc kernels)")
    parser.add_argument("--rows", default="1,8")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--int8", action="store_true", help="the int8-activation kernel (csrc/qlinear_i8.c)")
    parser.add_argument("--kinds", default="2", help="the kind (csrc/blocks.h: 2 Q4_1) or A:B, the revision's A "
                        "against the working tree's B (2:5: Q4_1 against Q4_K's super-blocks, 4:6: Q6_K against Q6_KS)")
    parser.add_argument("--shapes", default=",".join(f"{o}x{i}" for o, i in SHAPES),
                        help="OUTxIN,... (default SmolLM2-135M's; SmolLM2-1.7B's: 6144x2048,2048x2048,16384x2048,2048x8192)")
    parser.add_argument("--alternations", type=int, default=40, help="timed turns of each build a shape (medians)")
    parser.add_argument("--opt-level", type=int, default=3, choices=(1, 2, 3),
                        help="both builds' -O level (3: the kernels' own build)")
    args = parser.parse_args(argv)
    if args.alternations < 1:
        parser.error(f"--alternations: at least 1, given {args.alternations}")
    try:
        shapes = [tuple(int(n) for n in shape.split("x")) for shape in args.shapes.split(",")]
    except ValueError:
        parser.error(f"--shapes: OUTxIN pairs, comma-separated, given {args.shapes!r}")
    if any(len(shape) != 2 or shape[1] % 32 for shape in shapes):
        parser.error(f"--shapes: OUTxIN pairs with IN a multiple of 32, given {args.shapes!r}")
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), "?")
    print(f"{cpu}; {args.revision} -> working tree, kinds {args.kinds}, {'int8' if args.int8 else 'float32'} "
          f"activations, -O{args.opt_level}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        binary = build(args.revision, Path(tmp), f"-O{args.opt_level}")
        for rows in (int(r) for r in args.rows.split(",")):
            for out, inp in shapes:
                subprocess.run([str(binary), str(out), str(inp), str(rows), str(args.threads), args.kinds,
                                str(int(args.int8)), str(args.alternations)], check=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
