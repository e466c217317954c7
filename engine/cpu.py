"""CPU speedups, applied by the engine when the model runs on the CPU.

1. Linears on oneDNN with weights packed once, instead of `F.linear` (MKL sgemm) per call.
Measured here (2 cores, AVX2, fp32): MKL repacks the weight on every call, which dominates at
the small row counts of decode steps. A 4096x512 output head takes 2.6 ms at 8 rows with
`F.linear` and 0.3 ms packed; a 2048x512 projection at 64 rows 1.4 ms against 1.05 ms. Results
differ from `F.linear` by float rounding only (about 4e-6 on unit-scale inputs).

`pack_linears(model, kernel)` swaps every plain `nn.Linear` of a CPU model for a `PanelLinear`
(float32, with the C kernel of 4.) or else a `PackedLinear` holding the packed weight (the
original weight tensor is released unless something else, such as tied input embeddings, still
holds it). For oneDNN it checks one layer against `F.linear` first and leaves the model
untouched when oneDNN is missing or disagrees.

2. `keep_freed_memory()`: glibc serves allocations above 128 KiB-32 MiB with fresh `mmap`s and
returns them on free, so every step's multi-megabyte activations and KV gathers page-fault
their memory in again (expensive in a VM). Raising the mmap and trim thresholds keeps freed
memory in the heap for reuse: about 10% more tokens/s at 64 sequences here.

3. `decode_attention_kernel()`: decode attention read straight from the paged cache by a small C
function (`csrc/decode_attention.c`), compiled once per machine into `$RILL_CACHE/kernels` with
the system's C compiler and OpenMP (the process's own libgomp, torch's, so one thread pool). The
torch path gathers every sequence's context with `index_select` and runs SDPA with a mask, which
reads the keys twice and builds tensors per layer: 15% of a 32-sequence step here against 2%.
It is checked against that path on a small case first; without a compiler, or on a mismatch,
the engine keeps the torch path and says so in its log.

4. `linear_kernel()`: every linear of a float32 model in another C function of the same library
(`csrc/linear.c`), on weights rearranged once into panels of 16 output features. Measured here
against the packed oneDNN linear of 1.: 1.2-2.7x on decode steps (1-64 rows: they mostly stream
the weights, which this does at 12-20 GB/s against oneDNN's 5-12), 0.9-1.3x on prefill chunks;
SmolLM2's 576 x 49152 output head at one row 7.4 ms against 12.7. The panels replace the weight
(an output head tied to the input embeddings is the exception: the embedding keeps the original,
as with oneDNN's packed copy). Checked against `F.linear` first; bfloat16 models, or no
compiler, keep 1.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

log = logging.getLogger("rill.engine")

_DTYPES = (torch.float32, torch.bfloat16)


def _linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


class PackedLinear(nn.Module):
    """`nn.Linear` for inference on CPU, the weight pre-packed in oneDNN's blocked layout."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), None)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        y = _linear(x.reshape(-1, self.in_features), self.packed, self.bias)
        return y.view(*lead, self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


class PanelLinear(nn.Module):
    """`nn.Linear` for inference on CPU in float32, on `LinearKernel` (csrc/linear.c): the weight
    held as panels of 16 output features, [ceil(out / 16), in, 16], the last one zero-padded."""

    def __init__(self, linear: nn.Linear, kernel: LinearKernel):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.kernel = kernel
        self.panels = panels_of(linear.weight.detach())
        bias = None
        if linear.bias is not None:
            bias = torch.zeros(self.panels.shape[0] * 16, dtype=torch.float32)
            bias[:self.out_features] = linear.bias.detach()
        self.bias = bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        y = self.kernel(x.reshape(-1, self.in_features), self.panels, self.bias, self.out_features)
        return y.view(*lead, self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def panels_of(weight: torch.Tensor) -> torch.Tensor:
    """[out, in] -> [ceil(out / 16), in, 16]: panel p holds the weights of outputs 16p..16p+15."""
    out_features, in_features = weight.shape
    full, rest = divmod(out_features, 16)
    panels = torch.zeros(full + (rest > 0), in_features, 16, dtype=torch.float32)
    panels[:full] = weight[:full * 16].view(full, 16, in_features).transpose(1, 2)
    if rest:
        panels[full, :, :rest] = weight[full * 16:].t()
    return panels


def _works(dtype: torch.dtype) -> bool:
    """oneDNN is present and agrees with F.linear on a small case of this dtype."""
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")):
        return False
    try:
        gen = torch.Generator().manual_seed(0)
        w = torch.randn(64, 32, generator=gen).to(dtype)
        x = torch.randn(3, 32, generator=gen).to(dtype)
        got = _linear(x, torch.ops.mkldnn._reorder_linear_weight(w, None), None)
        tol = 1e-4 if dtype == torch.float32 else 5e-2
        return bool(torch.allclose(got.float(), F.linear(x, w).float(), atol=tol, rtol=tol))
    except Exception as exc:  # an old or odd build
        log.info("packed linears unavailable: %s", exc)
        return False


def pack_linears(model: nn.Module, kernel: LinearKernel | None = None) -> tuple[int, str]:
    """Swap the model's plain CPU `nn.Linear`s for `PanelLinear` (float32 with `kernel`) or
    `PackedLinear`; returns how many were swapped and where they run ("C kernel" or "oneDNN")."""
    targets = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
               if type(child) is nn.Linear and child.weight.device.type == "cpu" and child.weight.dtype in _DTYPES]
    dtypes = {child.weight.dtype for _, _, child in targets}
    if len(dtypes) != 1:  # none, or a model of mixed precision: left as it is
        return 0, ""
    (dtype,) = dtypes
    if kernel is not None and dtype == torch.float32:
        kind, make = "C kernel", lambda linear: PanelLinear(linear, kernel)
    elif _works(dtype):
        kind, make = "oneDNN", PackedLinear
    else:
        return 0, ""
    count = len(targets)
    while targets:  # each original weight can go as soon as its replacement exists
        parent, name, child = targets.pop()
        setattr(parent, name, make(child))
    return count, kind


def in_passing_thread(fn, /, *args, **kwargs):
    """fn(*args, **kwargs) in a thread that ends when it returns (its exception raised here), so that
    no thread which lives on owns an OpenMP thread pool for what fn runs in parallel (torch's
    operations while loading, the KV pool's zeroing, the kernels' start-up checks).

    One libgomp serves torch and the kernels, and it keeps a pool of workers for each thread that
    has run a parallel region, until that thread ends. Once the process holds more of those workers
    (the first thread counted) than it has CPUs, every worker spins about 100 times instead of some
    milliseconds before it sleeps at a barrier, so each of a step's ~240 parallel regions wakes it
    through the kernel. A server that loaded in its main thread and steps in the engine's thread
    was that case on 2 cores: 32 streams of the engine alone (an AsyncEngine fed as `python -m
    bench` feeds the server) 763 tok/s and 40,900 context switches, 866 and 1,600 with the load
    and the core built in passing threads."""
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


_SOURCES = sorted((Path(__file__).parent / "csrc").glob("*.c"))
_HEADERS = sorted((Path(__file__).parent / "csrc").glob("*.h"))  # in the build key, not on the command line
_CFLAGS = ["-O3", "-march=native", "-fopenmp", "-std=gnu11", "-shared", "-fPIC"]


class LinearKernel:
    """`rill_linear` from the compiled library: x [rows, in] times the panels of a weight."""

    def __init__(self, library: ctypes.CDLL, path: Path):
        self.path = path
        self._fn = library.rill_linear
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        self._fn.argtypes = [ptr, i64, ptr, ptr, ptr, i64, i64, i64, ctypes.c_int]
        self._fn.restype = None
        self.threads = torch.get_num_threads()

    def __call__(self, x: torch.Tensor, panels: torch.Tensor, bias: torch.Tensor | None,
                 out_features: int) -> torch.Tensor:
        """x: [rows, in] float32 (rows may be strided); panels from `panels_of`; bias padded like them."""
        return call_panel_kernel(self._fn, self.threads, x, panels, bias, out_features)[0]


def call_panel_kernel(fn, threads: int, x: torch.Tensor, panels: torch.Tensor, bias: torch.Tensor | None,
                      out_features: int, *extra) -> tuple[torch.Tensor, object]:
    """y = x w^T + b through a C kernel of the form fn(x, x_row, panels, bias, y, rows, out, in,
    threads, *extra) (csrc/linear.c, csrc/qlinear.c); returns y [rows, out] and what fn returned."""
    if x.dtype != torch.float32 or x.device.type != "cpu":
        raise TypeError(f"the C linear takes float32 CPU tensors; given {x.dtype} on {x.device}")
    if x.stride(-1) != 1:
        x = x.contiguous()
    rows = x.shape[0]
    y = torch.empty(rows, out_features, dtype=torch.float32)
    status = fn(x.data_ptr(), x.stride(0), panels.data_ptr(), None if bias is None else bias.data_ptr(),
                y.data_ptr(), rows, out_features, x.shape[1], threads, *extra)
    return y, status


class DecodeAttentionKernel:
    """`rill_decode_attention` from the compiled library, called with tensors (float32, CPU)."""

    reads = "slots"  # a slot per context position (gpu.PagedDecodeKernel reads block tables)

    def __init__(self, library: ctypes.CDLL, path: Path):
        self.path = path
        self._fn = library.rill_decode_attention
        i64, ptr, i32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
        self._fn.argtypes = [ptr, i64, i64, ptr, ptr, ptr, ptr, i64, ptr, ptr,
                             i32, i32, i32, i32, ctypes.c_float, i64, ctypes.c_float, i32]
        self._fn.restype = None
        self.threads = torch.get_num_threads()

    def __call__(self, query: torch.Tensor, out: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 index: torch.Tensor, slots: torch.Tensor, lens: torch.Tensor, scale: float,
                 window: int | None, softcap: float | None) -> None:
        """query: [1, heads, T, D] (any strides, D contiguous); out: [T, heads, D]; k/v_cache:
        [slots, kv_heads, D]; index, lens: [B] int64; slots: [B, max_ctx] int64. Fills out[index]."""
        _, heads, _, head_dim = query.shape
        self._fn(query.data_ptr(), query.stride(2), query.stride(1), index.data_ptr(),
                 k_cache.data_ptr(), v_cache.data_ptr(), slots.data_ptr(), slots.shape[1], lens.data_ptr(),
                 out.data_ptr(), index.shape[0], heads, k_cache.shape[1], head_dim, scale,
                 window or 0, softcap or 0.0, self.threads)


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")


def _build(cache_dir: Path) -> Path:
    """Compile the kernels unless these sources, compiler and CPU already have a build; returns the .so."""
    cc = _compiler()
    if cc is None:
        raise RuntimeError("no C compiler (cc, gcc or clang; or $CC)")
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    cpu_flags = ""
    if Path("/proc/cpuinfo").exists():  # -march=native: a build is only good for this CPU
        cpu_flags = next((line for line in Path("/proc/cpuinfo").read_text().splitlines()
                          if line.startswith(("flags", "Features"))), "")
    key = hashlib.sha256("\0".join([*(src.read_text() for src in (*_SOURCES, *_HEADERS)), version, cpu_flags, *_CFLAGS]).encode())
    target = cache_dir / "kernels" / f"rill_kernels-{key.hexdigest()[:16]}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        built = Path(tmp) / target.name
        result = subprocess.run([cc, *_CFLAGS, *map(str, _SOURCES), "-o", str(built), "-lm"],
                                capture_output=True, text=True, timeout=120)
        if result.returncode != 0:
            raise RuntimeError(f"{cc} failed: {result.stderr.strip()[-500:]}")
        os.replace(built, target)  # atomic: another process may build the same file
    return target


def _kernel_agrees(kernel: DecodeAttentionKernel) -> bool:
    """The kernel against the torch path of `paged_attention` on one small step: ragged
    contexts, grouped queries, a head size that is no multiple of 16, a window, a softcap."""
    from engine.attention import PagedKVCache, StepMetadata, paged_attention

    class Layer:
        layer_idx = 0

    gen = torch.Generator().manual_seed(0)
    heads, kv_heads, dim, block = 4, 2, 24, 4
    cache = PagedKVCache(1, 32, block, kv_heads, dim, torch.float32, torch.device("cpu"))
    cache.keys[0].copy_(torch.randn(cache.keys[0].shape, generator=gen))
    cache.values[0].copy_(torch.randn(cache.values[0].shape, generator=gen))
    lens = torch.tensor([1, 37, 20])
    slots = torch.randperm(32 * block, generator=gen)[:3 * 37].view(3, 37)  # scattered, like a busy cache
    q, k, v = (torch.randn(1, 3, n, dim, generator=gen).transpose(1, 2) for n in (heads, kv_heads, kv_heads))
    last = slots[torch.arange(3), lens - 1]
    for window, softcap in ((None, None), (8, None), (None, 5.0)):
        outs = []
        for use in (kernel, None):
            step = StepMetadata(cache=cache, slot_mapping=last, decode_token_index=torch.arange(3),
                                decode_slots=slots, decode_context_lens=lens, decode_kernel=use)
            outs.append(paged_attention(Layer(), q, k, v, None, scaling=0.3, rill_step=step,
                                        sliding_window=window, softcap=softcap)[0])
        if not torch.allclose(outs[0], outs[1], atol=1e-5, rtol=1e-4):
            return False
    return True


def _linear_agrees(kernel: LinearKernel) -> bool:
    """The kernel against F.linear: 1 to 13 rows (tiles of 6 and every partial one), a width that
    is no multiple of 8, a partial panel, with and without bias, rows with a stride."""
    gen = torch.Generator().manual_seed(0)
    linear = nn.Linear(37, 21)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(21, 37, generator=gen))
        linear.bias.copy_(torch.randn(21, generator=gen))
    wide = torch.randn(13, 40, generator=gen)
    for bias in (True, False):
        if not bias:
            linear.bias = None
        panel = PanelLinear(linear, kernel)
        for rows in range(1, 14):
            x = wide[:rows, :37]
            if not torch.allclose(panel(x), F.linear(x, linear.weight, linear.bias), atol=1e-5, rtol=1e-5):
                return False
    return True


_LIBRARIES: dict[Path, tuple[ctypes.CDLL, Path] | Exception] = {}


def _library(cache_dir: Path) -> tuple[ctypes.CDLL, Path]:
    """The compiled library, built (or found) once per process and cache folder; a failed build
    is not tried again."""
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


def _checked_kernel(kind, agrees, cache_dir: Path, what: str, reference: str, instead: str):
    """`kind` from the compiled library if it `agrees` with the reference, else None (logged)."""
    try:
        kernel = kind(*_library(cache_dir))
        if agrees(kernel):
            return kernel
        log.warning("%s: the C kernel disagrees with %s; using %s", what, reference, instead)
    except Exception as exc:  # no compiler, no OpenMP, a read-only cache, ...
        log.warning("%s: %s (the C kernel is unavailable: %s)", what, instead, exc)
    return None


def linear_kernel(cache_dir: Path) -> LinearKernel | None:
    """The compiled linear, or None (with the reason logged) when it cannot be used here."""
    return _checked_kernel(LinearKernel, _linear_agrees, cache_dir, "linears", "F.linear", "oneDNN")


def decode_attention_kernel(cache_dir: Path) -> DecodeAttentionKernel | None:
    """The compiled decode kernel, or None (with the reason logged) when it cannot be used here."""
    return _checked_kernel(DecodeAttentionKernel, _kernel_agrees, cache_dir, "decode attention", "the torch path",
                           "the torch path")
