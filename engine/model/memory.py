"""How many KV cache blocks a model gets: from the config, or from the memory free on its device.

On a GPU, the free memory CUDA reports; on the CPU, the smaller of the host's available memory
(/proc/meminfo) and what the container's cgroup limit leaves (a Space is a container with a limit
far below its host's memory).
"""

from __future__ import annotations

from pathlib import Path

import torch

from engine.config import EngineConfig

MEMINFO_PATH = Path("/proc/meminfo")  # the host's memory
CGROUP_ROOT = Path("/sys/fs/cgroup")  # the container's limit: v2 files at the root, v1 under memory/
_NO_LIMIT = 1 << 60  # cgroup v1 says "no limit" with a page-rounded 2**63


def _read_number(path: Path) -> int | None:
    """The integer in a one-line file; None if absent or unreadable; _NO_LIMIT for "max"."""
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    if text == "max":
        return _NO_LIMIT
    try:
        return int(text)
    except ValueError:
        return None


def _stat_value(path: Path, key: str) -> int:
    try:
        for line in path.read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key:
                return int(value)
    except (OSError, ValueError):
        pass
    return 0


def container_free_memory(cgroup_root: Path = CGROUP_ROOT) -> int | None:
    """Bytes the container's memory limit still allows: the limit less the working set (usage
    less reclaimable page cache), from cgroup v2 (`memory.max`) or v1 (`memory.limit_in_bytes`).
    None when there is no limit."""
    for folder, limit_file, usage_file, inactive_key in (
            ("", "memory.max", "memory.current", "inactive_file"),
            ("memory", "memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")):
        base = cgroup_root / folder
        limit = _read_number(base / limit_file)
        if limit is None:
            continue
        if limit >= _NO_LIMIT:
            return None
        usage = _read_number(base / usage_file) or 0
        working_set = max(0, usage - _stat_value(base / "memory.stat", inactive_key))
        return max(0, limit - working_set)
    return None


def host_free_memory(meminfo_path: Path = MEMINFO_PATH) -> int | None:
    """Bytes the host has available (MemAvailable), or None when /proc/meminfo does not say."""
    try:
        with open(meminfo_path) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return None


def free_memory_bytes(device: torch.device, meminfo_path: Path | None = None, cgroup_root: Path | None = None) -> int:
    """Memory a KV cache on `device` may take: the GPU's free memory, or on CPU the smaller of the
    host's available memory and what the container's limit leaves (a Space is a container with a
    limit far below its host's memory); 4 GiB when neither is known."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    known = [m for m in (host_free_memory(meminfo_path or MEMINFO_PATH),
                         container_free_memory(cgroup_root or CGROUP_ROOT)) if m is not None]
    return min(known) if known else 4 << 30


def num_kv_blocks(config: EngineConfig, max_model_len: int, bytes_per_block: int, device: torch.device) -> int:
    """The KV pool's size in blocks: `config.num_kv_blocks`, else `config.kv_cache_memory` (bytes, or
    a fraction of free memory), else enough for every running sequence at full context, capped at a
    quarter of free memory; at least 2."""
    if config.num_kv_blocks:
        return config.num_kv_blocks
    if config.kv_cache_memory:
        budget = config.kv_cache_memory if config.kv_cache_memory > 1 else config.kv_cache_memory * free_memory_bytes(device)
        return max(2, int(budget // bytes_per_block))
    wanted = config.max_num_seqs * -(-max_model_len // config.block_size)
    return max(2, min(wanted, int(free_memory_bytes(device) * 0.25 // bytes_per_block)))
