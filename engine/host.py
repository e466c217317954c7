"""The process's CPU side: glibc malloc's thresholds, and threads that own no OpenMP pool once done.

`keep_freed_memory()`: glibc serves allocations above 128 KiB-32 MiB with fresh `mmap`s and
returns them on free, so every step's multi-megabyte activations and KV gathers page-fault their
memory in again (expensive in a VM). Raising the mmap and trim thresholds keeps freed memory in the
heap for reuse (the gain: docs/benchmarks-history.md).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys
import threading


def in_passing_thread(fn, /, *args, **kwargs):
    """fn(*args, **kwargs) in a thread that ends when it returns (its exception raised here), so that
    no thread which lives on owns an OpenMP thread pool for what fn runs in parallel (torch's
    operations while loading, the KV pool's zeroing, the kernels' start-up checks).

    One libgomp serves torch and the kernels, and it keeps a pool of workers for each thread that
    has run a parallel region, until that thread ends. Once the process holds more of those workers
    (the first thread counted) than it has CPUs, every worker spins about 100 times instead of some
    milliseconds before it sleeps at a barrier, so each of a step's ~240 parallel regions wakes it
    through the kernel. A server that loaded in its main thread and steps in the engine's thread
    was that case on 2 cores (its tokens/s and context switches: docs/benchmarks-history.md)."""
    box: dict = {}

    def run() -> None:
        try:
            box["value"] = fn(*args, **kwargs)
        except BaseException as exc:  # raised again in the caller's thread
            box["error"] = exc

    thread = threading.Thread(target=run, name=f"rill-{getattr(fn, '__name__', 'load')}", daemon=True)
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]
    return box["value"]


_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt parameters (glibc malloc.h)


def keep_freed_memory() -> bool:
    """Tell glibc's malloc to reuse freed blocks of up to 1 GiB instead of unmapping them."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return bool(libc.mallopt(_M_MMAP_THRESHOLD, 1 << 30)) and bool(libc.mallopt(_M_TRIM_THRESHOLD, 1 << 31))
    except (OSError, AttributeError):  # not glibc (musl, ...)
        return False


def return_freed_memory() -> None:
    """Hand the heap's freed pages back to the system: glibc keeps what a load's temporaries or an
    unloaded model freed, resident until reused (the thresholds above keep more). Not glibc: nothing."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass
