"""The pool of KV-cache blocks: reference counts, an LRU free queue, and the prefix-cache index."""
from __future__ import annotations

from collections import OrderedDict
from typing import Iterable


class KVBlock:
    """One block of `block_size` token slots in every layer's KV cache."""
    __slots__ = ("block_id", "ref_cnt", "block_hash")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: bytes | None = None

    def __repr__(self) -> str:
        return f"KVBlock(id={self.block_id}, ref={self.ref_cnt}, cached={self.block_hash is not None})"


class BlockPool:
    """Owns every block.

    Contract: a block with ref_cnt 0 is in the free queue, ordered for eviction (front first). A free block may still
    hold a cached prefix (block_hash set, indexed in `_cached`) until it is evicted by `allocate`; `touch` revives
    such a block for a prefix hit. Callers free a request's blocks tail-first so the ends of sequences are evicted
    before their shared beginnings.
    """

    def __init__(self, num_blocks: int, enable_caching: bool) -> None:
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._cached: dict[bytes, KVBlock] = {}

    # ----- queries -----
    def get_num_free_blocks(self) -> int:
        return len(self._free)

    def get_cached_block(self, block_hash: bytes) -> KVBlock | None:
        return self._cached.get(block_hash)

    def usage(self) -> float:
        return 1.0 - len(self._free) / self.num_blocks

    # ----- actions -----
    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take a reference on prefix-hit blocks, pulling free ones out of the free queue."""
        for b in blocks:
            if b.ref_cnt == 0:
                del self._free[b.block_id]
            b.ref_cnt += 1

    def allocate(self, n: int) -> list[KVBlock]:
        if n > len(self._free):
            raise RuntimeError(f"BlockPool.allocate({n}) with only {len(self._free)} free blocks; "
                               "callers must check get_num_free_blocks() first.")
        out = []
        for _ in range(n):
            block_id, _ = self._free.popitem(last=False)
            b = self.blocks[block_id]
            if b.block_hash is not None:  # evict the cached prefix this block held
                if self._cached.get(b.block_hash) is b:
                    del self._cached[b.block_hash]
                b.block_hash = None
            b.ref_cnt = 1
            out.append(b)
        return out

    def free_blocks(self, blocks: Iterable[KVBlock]) -> None:
        """Drop one reference from each block; blocks reaching zero join the free queue's tail in the given order."""
        for b in blocks:
            b.ref_cnt -= 1
            assert b.ref_cnt >= 0, f"double free of {b}"
            if b.ref_cnt == 0:
                self._free[b.block_id] = None

    def cache_full_block(self, block: KVBlock, block_hash: bytes) -> None:
        """Index a block that is now full under its chained hash (first writer wins on duplicates)."""
        if not self.enable_caching or block.block_hash is not None:
            return
        if block_hash in self._cached:
            return
        block.block_hash = block_hash
        self._cached[block_hash] = block

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix; only possible when no block is in use."""
        if len(self._free) != self.num_blocks:
            return False
        for b in self.blocks:
            b.block_hash = None
        self._cached.clear()
        return True

    def num_cached_blocks(self) -> int:
        return len(self._cached)
