"""The kernels library: csrc/*.c compiled once per machine into `$RILL_CACHE/kernels`.

The system's C compiler builds every source into one shared library with OpenMP (the process's
own libgomp, torch's, so one thread pool) and `-march=native`, or the instruction set named by
`RILL_KERNEL_MARCH` (`x86-64-v3`: the AVX2 route on a CPU that has more; the kernels choose their
routes by what the build was compiled for, so no AVX-512 instruction runs in that build): the
file's name is the march and a digest of the sources, the headers, the compiler's version, this
CPU's feature flags and the flags, so a build for one host or march is never reused for another.
The library reports what it was built for (`built_for`). Each kernel's binding (engine/kernels/*.py) takes its
entry point from `compiled_library` and is handed out by `checked_kernel` only once it agrees with
its torch reference on a small case; without a compiler, or on a mismatch, the caller keeps its
torch path and the log says why.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import re
import shutil
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

log = logging.getLogger("rill.engine")

SOURCES = sorted((Path(__file__).parent / "csrc").glob("*.c"))
HEADERS = sorted((Path(__file__).parent / "csrc").glob("*.h"))  # in the build key, not on the command line
CFLAGS = ["-O3", "-fopenmp", "-std=gnu11", "-shared", "-fPIC"]
BUILD_TIMEOUT_S = 600  # per compiler call; csrc/qlinear.c alone took over 120 s on a busy core


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")


def _cpu_flags() -> str:
    """This CPU's feature line (-march=native: a build is only good for this CPU)."""
    cpuinfo = Path("/proc/cpuinfo")
    if not cpuinfo.exists():
        return ""
    return next((line for line in cpuinfo.read_text().splitlines() if line.startswith(("flags", "Features"))), "")


def kernel_march() -> str:
    """The -march of the kernels' build: $RILL_KERNEL_MARCH (e.g. x86-64-v3), else native."""
    march = os.environ.get("RILL_KERNEL_MARCH", "").strip() or "native"
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._+-]{0,63}", march):
        raise ValueError(f"RILL_KERNEL_MARCH must be a compiler -march value such as x86-64-v3 or native; "
                         f"given {march!r}")
    return march


def _flags(march: str) -> list[str]:
    return [*CFLAGS, f"-march={march}", f'-DRILL_BUILD_MARCH="{march}"']


def library_path(cache_dir: Path, cc: str, march: str) -> Path:
    """Where the build of these sources for `march` with compiler `cc` lives in the cache."""
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    key = hashlib.sha256("\0".join([*(src.read_text() for src in (*SOURCES, *HEADERS)), version, _cpu_flags(),
                                    *_flags(march)]).encode())
    return cache_dir / "kernels" / f"rill_kernels-{march}-{key.hexdigest()[:16]}.so"


def _build(cache_dir: Path, march: str) -> Path:
    """Compile the kernels unless these sources, compiler, CPU and march already have a build; returns the .so."""
    cc = _compiler()
    if cc is None:
        raise RuntimeError("no C compiler (cc, gcc or clang; or $CC)")
    target = library_path(cache_dir, cc, march)
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        built = Path(tmp) / target.name
        objects = [Path(tmp) / f"{src.stem}.o" for src in SOURCES]
        # each source compiled apart (as one cc call does in turn), on every core, the largest first; one link
        jobs = sorted(zip(SOURCES, objects), key=lambda job: -job[0].stat().st_size)
        with ThreadPoolExecutor(max_workers=_cores()) as pool:
            list(pool.map(lambda job: _run_cc(cc, [*_flags(march), "-c", str(job[0]), "-o", str(job[1])]), jobs))
        _run_cc(cc, [*_flags(march), *map(str, objects), "-o", str(built), "-lm"])
        os.replace(built, target)  # atomic: another process may build the same file
    return target


def _run_cc(cc: str, arguments: list[str]) -> None:
    result = subprocess.run([cc, *arguments], capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
    if result.returncode != 0:
        raise RuntimeError(f"{cc} failed: {result.stderr.strip()[-500:]}")


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


# (cache folder, march) -> (library, path) or the failure
_LIBRARIES: dict[tuple[Path, str], tuple[ctypes.CDLL, Path] | Exception] = {}


def compiled_library(cache_dir: Path) -> tuple[ctypes.CDLL, Path]:
    """The compiled library and its path, built (or found) once per process, cache folder and
    march; a failed build is not tried again (its exception is raised again)."""
    march = kernel_march()
    if (cache_dir, march) not in _LIBRARIES:
        try:
            path = _build(cache_dir, march)
            _LIBRARIES[cache_dir, march] = (ctypes.CDLL(str(path)), path)
        except Exception as exc:
            _LIBRARIES[cache_dir, march] = exc
    found = _LIBRARIES[cache_dir, march]
    if isinstance(found, Exception):
        raise found
    return found


ISA_BITS = {"AVX2": 1, "FMA": 2, "AVX-512": 4, "AVX-512 VNNI": 8, "AVX-512 BF16": 16, "AMX": 32, "AVX-VNNI": 64,
            "AES": 128}


def built_for(library: ctypes.CDLL) -> tuple[str, list[str]]:
    """(the -march the library was compiled with, the x86 extensions that build could use:
    csrc/build_info.c)."""
    library.rill_build_march.restype = ctypes.c_char_p
    library.rill_build_isa.restype = ctypes.c_int
    bits = library.rill_build_isa()
    return library.rill_build_march().decode(), [name for name, bit in ISA_BITS.items() if bits & bit]


def checked_kernel(kind, agrees, cache_dir: Path, what: str, reference: str, instead: str):
    """`kind(library, path)` from the compiled library if `agrees(kernel)` with the reference, else
    None, with the reason logged: "<what>: <instead> (...)"."""
    try:
        kernel = kind(*compiled_library(cache_dir))
        if agrees(kernel):
            return kernel
        log.warning("%s: the C kernel disagrees with %s; using %s", what, reference, instead)
    except Exception as exc:  # no compiler, no OpenMP, a read-only cache, an old library without the symbol, ...
        log.warning("%s: %s (the C kernel is unavailable: %s)", what, instead, exc)
    return None
