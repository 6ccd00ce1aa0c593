"""The scheduler's only view of the KV cache: which blocks a request holds, prefix hits, and allocation."""
from __future__ import annotations

from tokenmill.core.block_pool import BlockPool, KVBlock
from tokenmill.core.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    """Allocates blocks to requests and finds cached prefixes.

    Check-then-act: `get_computed_blocks` looks up a prefix without side effects; `allocate_slots` either reserves
    everything a step needs (taking references on the prefix hits) or changes nothing and returns None.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, enable_caching)
        self.req_to_blocks: dict[str, list[KVBlock]] = {}
        self._num_cached_blocks: dict[str, int] = {}
        self.prefix_queries = 0  # tokens looked up (cumulative)
        self.prefix_hits = 0     # tokens found (cumulative)

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    def usage(self) -> float:
        return self.pool.usage()

    def get_computed_blocks(self, request: Request) -> tuple[list[KVBlock], int]:
        """The longest cached prefix of a new request, leaving at least one token to compute (for its logits)."""
        if not self.enable_caching or request.sampling_params.prompt_logprobs is not None:
            return [], 0  # prompt logprobs need the logits of every prompt position
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[KVBlock] = []
        for h in request.block_hashes[:max_blocks]:
            b = self.pool.get_cached_block(h)
            if b is None:
                break
            hits.append(b)
        self.prefix_queries += request.num_tokens
        self.prefix_hits += len(hits) * self.block_size
        return hits, len(hits) * self.block_size

    def num_recomputed_tokens(self, request: Request, num_hit: int) -> int:
        """Prompt tokens that are cached but computed again: a prompt that fills whole blocks, all cached, still
        computes its last block (a forward needs at least one new token). Looks up without side effects."""
        i = num_hit // self.block_size
        if (not self.enable_caching or request.sampling_params.prompt_logprobs is not None
                or (i + 1) * self.block_size != request.num_tokens or i >= len(request.block_hashes)):
            return 0
        return self.block_size if self.pool.get_cached_block(request.block_hashes[i]) is not None else 0

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       new_computed_blocks: list[KVBlock] | None = None) -> list[int] | None:
        """Reserve slots for `num_new_tokens` more tokens after the request's computed ones (and its prefix hits).

        Returns the ids of the blocks added to the request (prefix hits first), or None when there is no room.
        """
        blocks = self.req_to_blocks.get(request.request_id)
        if blocks is not None and not new_computed_blocks:
            # The common decode step: the held blocks have room, so nothing is allocated (15 steps in 16).
            total = request.num_computed_tokens + num_new_tokens
            if total <= len(blocks) * self.block_size:
                if self.enable_caching and total // self.block_size > self._num_cached_blocks[request.request_id]:
                    self._cache_full_blocks(request, blocks, total)
                return []
        computed = new_computed_blocks or []
        held = len(blocks) if blocks is not None else 0
        num_computed = request.num_computed_tokens + len(computed) * self.block_size
        total = num_computed + num_new_tokens
        num_needed = cdiv(total, self.block_size) - held - len(computed)
        # Prefix hits sitting in the free queue stop being allocatable once touched.
        revived = sum(1 for b in computed if b.ref_cnt == 0)
        if num_needed > self.pool.get_num_free_blocks() - revived:
            return None
        if blocks is None:
            blocks = self.req_to_blocks[request.request_id] = []
            self._num_cached_blocks[request.request_id] = len(computed)
        self.pool.touch(computed)
        new = self.pool.allocate(max(num_needed, 0))
        blocks.extend(computed)
        blocks.extend(new)
        if self.enable_caching:
            self._cache_full_blocks(request, blocks, total)
        return [b.block_id for b in computed] + [b.block_id for b in new]

    def _cache_full_blocks(self, request: Request, blocks: list[KVBlock], num_tokens_after_step: int) -> None:
        start = self._num_cached_blocks[request.request_id]
        end = min(num_tokens_after_step // self.block_size, len(request.block_hashes))
        for i in range(start, end):
            self.pool.cache_full_block(blocks[i], request.block_hashes[i])
        self._num_cached_blocks[request.request_id] = max(start, end)

    def free(self, request: Request) -> None:
        blocks = self.req_to_blocks.pop(request.request_id, None)
        self._num_cached_blocks.pop(request.request_id, None)
        if blocks:
            self.pool.free_blocks(reversed(blocks))

    def get_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request_id, [])]

    def num_free_blocks(self) -> int:
        return self.pool.get_num_free_blocks()

    def reset_prefix_cache(self) -> bool:
        return self.pool.reset_prefix_cache()
