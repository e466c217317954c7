"""The KV block allocator: a free list of fixed-size blocks, a block table per sequence, and
prefix caching.

Plain Python: the tensors that hold keys and values live in `attention.PagedKVCache`; this
module only decides which block (and so which slots) each sequence's tokens occupy.

Prefix caching (as in vLLM): a full block is named by a hash of its tokens and of every token
before it (a chain of BLAKE2 digests), so two sequences that start with the same tokens (a
system prompt, the earlier turns of a chat, a resumed stream) can share the blocks that hold
them. Blocks are reference-counted; a cached block that nobody uses any more stays cached
and counts as free, and is only reused for other tokens (evicted, least recently freed first)
when no never-cached block is left.

A request's `cache_salt` seeds its chain: requests with different salts never share a block,
so one client cannot learn from the hit counters (or the time to first token) whether another
client's prompt is cached. Requests without a salt share with each other only.

A prompt with images (engine/model/vision.py `PromptImages`) adds to the hash of every block holding
image tokens the digest of each image whose tokens it holds (the images before it are in the chain):
the same picture under a new question finds those blocks (and the text before them), a different
picture never does, and two prompts sharing their first picture share its blocks and part ways at
the block where their second one starts.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict


class BlockAllocator:
    """Hands out KV blocks of `block_size` token slots. Block b owns slots [b*bs, (b+1)*bs)."""

    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = False):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        self.free_blocks: list[int] = list(range(num_blocks - 1, -1, -1))  # pop() gives 0, 1, ...
        self.refs = [0] * num_blocks  # sequences holding each block
        self.block_hash: dict[int, bytes] = {}  # cached block -> its hash
        self.cached: dict[bytes, int] = {}  # hash -> the block holding those tokens
        self.evictable: OrderedDict[int, None] = OrderedDict()  # cached, unused; least recently freed first
        self.queried_tokens = 0  # prompt tokens looked up in the cache
        self.hit_tokens = 0  # of which found there (their K/V were not computed again)

    @property
    def num_free(self) -> int:
        """Blocks that can be handed out (never-cached ones and cached ones nobody uses)."""
        return len(self.free_blocks) + len(self.evictable)

    @property
    def usage(self) -> float:
        """Fraction of blocks in use, 0..1."""
        return 1.0 - self.num_free / self.num_blocks

    def blocks_needed(self, block_table: list[int], num_tokens: int) -> int:
        """How many more blocks a sequence holding `block_table` needs to store `num_tokens`."""
        return max(0, -(-num_tokens // self.block_size) - len(block_table))

    def allocate(self, block_table: list[int], num_tokens: int) -> bool:
        """Grow `block_table` in place to hold `num_tokens`; False (and no change) if short of blocks."""
        needed = self.blocks_needed(block_table, num_tokens)
        if needed > self.num_free:
            return False
        for _ in range(needed):
            block_table.append(self._take())
        return True

    def _take(self) -> int:
        if self.free_blocks:
            block = self.free_blocks.pop()
        else:  # evict the cached block freed longest ago
            block, _ = self.evictable.popitem(last=False)
            del self.cached[self.block_hash.pop(block)]
        self.refs[block] = 1
        return block

    def free(self, block_table: list[int]) -> None:
        """Give back every block of `block_table` and empty it (shared blocks stay with their other holders)."""
        for block in reversed(block_table):  # the tail first: it is evicted first, the shared head last
            self.refs[block] -= 1
            if self.refs[block] == 0:
                if block in self.block_hash:
                    self.evictable[block] = None
                else:
                    self.free_blocks.append(block)
        block_table.clear()

    def shrink(self, block_table: list[int], num_tokens: int) -> None:
        """Give back the blocks of `block_table` past the ones `num_tokens` tokens need (a rejected
        draft's positions, engine/speculative.py); never named in the prefix cache, they are free."""
        keep = -(-num_tokens // self.block_size)
        if len(block_table) > keep:
            tail = block_table[keep:]
            del block_table[keep:]
            self.free(tail)

    # ---- prefix caching ---------------------------------------------------------------------

    def _extend_hashes(self, token_ids: list[int], hashes: list[bytes], num_blocks: int,
                       salt: str | None = None, images=None) -> None:
        """Append to `hashes` the chain hashes of full blocks len(hashes)..num_blocks-1 (the first
        one chained to the salt's own digest when there is a salt; a block holding image tokens
        also hashes the images' digest)."""
        bs = self.block_size
        for i in range(len(hashes), num_blocks):
            previous = hashes[-1] if hashes else _salt_digest(salt)
            tokens = array("q", token_ids[i * bs:(i + 1) * bs]).tobytes()
            if images is not None and i * bs <= images.last and (i + 1) * bs > images.first:
                tokens += images.digests_within(i * bs, (i + 1) * bs)
            hashes.append(hashlib.blake2b(previous + tokens, digest_size=16).digest())

    def match_prefix(self, token_ids: list[int], hashes: list[bytes], block_table: list[int],
                     salt: str | None = None, images=None) -> int:
        """Put the cached blocks of the longest cached prefix into an empty `block_table`; returns
        how many tokens they hold. The last token is always left to compute (its logits are needed)."""
        if not self.prefix_caching or block_table:
            return 0
        max_blocks = (len(token_ids) - 1) // self.block_size
        self._extend_hashes(token_ids, hashes, max_blocks, salt, images)
        for h in hashes[:max_blocks]:
            block = self.cached.get(h)
            if block is None:
                break
            if self.refs[block] == 0:
                del self.evictable[block]
            self.refs[block] += 1
            block_table.append(block)
        return len(block_table) * self.block_size

    def count_lookup(self, num_tokens: int, num_matched: int) -> None:
        """Count one admitted sequence's lookup (a sequence that keeps waiting looks again)."""
        if self.prefix_caching:
            self.queried_tokens += num_tokens
            self.hit_tokens += num_matched

    def cache_full_blocks(self, token_ids: list[int], hashes: list[bytes], block_table: list[int],
                          num_computed: int, num_cached: int, salt: str | None = None, images=None) -> int:
        """Name the blocks that `num_computed` tokens fill, from block `num_cached` on, so later
        sequences can share them; returns the new number of named blocks of this sequence."""
        full = min(num_computed // self.block_size, len(block_table))
        if not self.prefix_caching or full <= num_cached:
            return num_cached
        self._extend_hashes(token_ids, hashes, full, salt, images)
        for i in range(num_cached, full):
            block, h = block_table[i], hashes[i]
            if block not in self.block_hash and h not in self.cached:  # else shared already, or a twin is
                self.block_hash[block] = h
                self.cached[h] = block
        return full


def _salt_digest(salt: str | None) -> bytes:
    """What a sequence's first block hash is chained to: nothing, or a digest of its salt (16 bytes,
    like a block hash, under a prefix no block's input has)."""
    if salt is None:
        return b""
    return hashlib.blake2b(b"rill-cache-salt\0" + salt.encode("utf-8"), digest_size=16).digest()
