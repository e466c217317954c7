"""Memory for the weights the kernels stream: an anonymous mapping of its own whose whole 2 MiB
stretches are asked of the kernel as huge pages (`MADV_HUGEPAGE`; Linux with transparent huge pages
set to `madvise` or `always`), so a step's reads walk one page table entry per 2 MiB instead of per
4 KiB. The mapping goes back to the system when the tensor is freed."""

from __future__ import annotations

import math
import mmap

import torch

HUGE_PAGE = 2 << 20


def empty_huge(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """`torch.empty(shape, dtype=dtype)` (zero-filled) on huge pages where the system gives them;
    a small tensor, or a system without `madvise`, takes plain `torch.empty`."""
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes < 2 * HUGE_PAGE or not hasattr(mmap, "MADV_HUGEPAGE"):
        return torch.empty(shape, dtype=dtype)
    area = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    whole = torch.frombuffer(area, dtype=torch.uint8)  # holds the mapping until the last view is freed
    start = (-whole.data_ptr()) % HUGE_PAGE
    try:
        area.madvise(mmap.MADV_HUGEPAGE, start, nbytes // HUGE_PAGE * HUGE_PAGE)
    except OSError:  # transparent huge pages off: small pages, as torch.empty
        pass
    return whole[start:start + nbytes].view(dtype).view(shape)
