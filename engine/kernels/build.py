"""The kernels library: csrc/*.c compiled once per machine into `$RILL_CACHE/kernels`.

The system's C compiler builds every source into one shared library with OpenMP (the process's
own libgomp, torch's, so one thread pool) and `-march=native`: the file's name is a digest of the
sources, the headers, the compiler's version, this CPU's feature flags and the flags, so a build
for one host is never reused on another. Each kernel's binding (engine/kernels/*.py) takes its
entry point from `compiled_library` and is handed out by `checked_kernel` only once it agrees with
its torch reference on a small case; without a compiler, or on a mismatch, the caller keeps its
torch path and the log says why.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

log = logging.getLogger("rill.engine")

SOURCES = sorted((Path(__file__).parent / "csrc").glob("*.c"))
HEADERS = sorted((Path(__file__).parent / "csrc").glob("*.h"))  # in the build key, not on the command line
CFLAGS = ["-O3", "-march=native", "-fopenmp", "-std=gnu11", "-shared", "-fPIC"]


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")


def _cpu_flags() -> str:
    """This CPU's feature line (-march=native: a build is only good for this CPU)."""
    cpuinfo = Path("/proc/cpuinfo")
    if not cpuinfo.exists():
        return ""
    return next((line for line in cpuinfo.read_text().splitlines() if line.startswith(("flags", "Features"))), "")


def _build(cache_dir: Path) -> Path:
    """Compile the kernels unless these sources, compiler and CPU already have a build; returns the .so."""
    cc = _compiler()
    if cc is None:
        raise RuntimeError("no C compiler (cc, gcc or clang; or $CC)")
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    key = hashlib.sha256("\0".join([*(src.read_text() for src in (*SOURCES, *HEADERS)), version, _cpu_flags(),
                                    *CFLAGS]).encode())
    target = cache_dir / "kernels" / f"rill_kernels-{key.hexdigest()[:16]}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        built = Path(tmp) / target.name
        result = subprocess.run([cc, *CFLAGS, *map(str, SOURCES), "-o", str(built), "-lm"],
                                capture_output=True, text=True, timeout=120)
        if result.returncode != 0:
            raise RuntimeError(f"{cc} failed: {result.stderr.strip()[-500:]}")
        os.replace(built, target)  # atomic: another process may build the same file
    return target


_LIBRARIES: dict[Path, tuple[ctypes.CDLL, Path] | Exception] = {}  # cache folder -> (library, path) or the failure


def compiled_library(cache_dir: Path) -> tuple[ctypes.CDLL, Path]:
    """The compiled library and its path, built (or found) once per process and cache folder; a
    failed build is not tried again (its exception is raised again)."""
    if cache_dir not in _LIBRARIES:
        try:
            path = _build(cache_dir)
            _LIBRARIES[cache_dir] = (ctypes.CDLL(str(path)), path)
        except Exception as exc:
            _LIBRARIES[cache_dir] = exc
    found = _LIBRARIES[cache_dir]
    if isinstance(found, Exception):
        raise found
    return found


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
