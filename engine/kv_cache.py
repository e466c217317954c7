"""The KV block allocator: a free list of fixed-size blocks and a block table per sequence.

Plain Python: the tensors that hold keys and values live in `attention.PagedKVCache`; this
module only decides which block (and so which slots) each sequence's tokens occupy.
"""

from __future__ import annotations


class BlockAllocator:
    """Hands out KV blocks of `block_size` token slots. Block b owns slots [b*bs, (b+1)*bs)."""

    def __init__(self, num_blocks: int, block_size: int):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.free_blocks: list[int] = list(range(num_blocks - 1, -1, -1))  # pop() gives 0, 1, ...

    @property
    def num_free(self) -> int:
        return len(self.free_blocks)

    @property
    def usage(self) -> float:
        """Fraction of blocks in use, 0..1."""
        return 1.0 - len(self.free_blocks) / self.num_blocks

    def blocks_needed(self, block_table: list[int], num_tokens: int) -> int:
        """How many more blocks a sequence holding `block_table` needs to store `num_tokens`."""
        return max(0, -(-num_tokens // self.block_size) - len(block_table))

    def can_allocate(self, block_table: list[int], num_tokens: int) -> bool:
        return self.blocks_needed(block_table, num_tokens) <= len(self.free_blocks)

    def allocate(self, block_table: list[int], num_tokens: int) -> bool:
        """Grow `block_table` in place to hold `num_tokens`; False (and no change) if short of blocks."""
        needed = self.blocks_needed(block_table, num_tokens)
        if needed > len(self.free_blocks):
            return False
        for _ in range(needed):
            block_table.append(self.free_blocks.pop())
        return True

    def free(self, block_table: list[int]) -> None:
        """Return every block of `block_table` to the pool and empty it."""
        self.free_blocks.extend(reversed(block_table))
        block_table.clear()
