"""The scheduler's only view of the KV cache: which blocks a request holds, prefix hits, and allocation."""
from __future__ import annotations

from tokenmill.core.block_pool import BlockPool, KVBlock
from tokenmill.core.kv_cache_spec import FullAttentionSpec
from tokenmill.core.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    """Allocates blocks to requests and finds cached prefixes.

    Check-then-act: `get_computed_blocks` looks up a prefix without side effects; `allocate_slots` either reserves
    everything a step needs (taking references on the prefix hits) or changes nothing and returns None.

    `spec` (core/kv_cache_spec.py) is what every layer of the cache keeps. With a SlidingWindowSpec the leading
    blocks no later query can read are freed as the request advances (at the start of each allocation): its list
    keeps None in their places, so a request holds about window / block_size + 1 blocks whatever its length.
    Freed blocks keep their prefix-cache entry until evicted, and a prefix hit needs every block of the prefix to
    be cached (the chain walk stops at the first miss), so a hit is exactly what a miss would compute.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool,
                 spec: FullAttentionSpec | None = None) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.spec = spec
        self._windowed = spec is not None and spec.num_dead_blocks(1 << 40) > 0
        self.pool = BlockPool(num_blocks, enable_caching)
        self.req_to_blocks: dict[str, list[KVBlock | None]] = {}
        self._num_cached_blocks: dict[str, int] = {}
        self._num_dead: dict[str, int] = {}  # leading blocks already freed (sliding window)
        self.prefix_queries = 0  # tokens looked up (cumulative)
        self.prefix_hits = 0     # tokens found (cumulative)

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    def usage(self) -> float:
        return self.pool.usage()

    @property
    def num_prompt_blocks(self) -> int:
        """A prompt of more than this many blocks can never be scheduled (the engine's early check; a window makes
        it conservative: the scheduler's check_request knows the exact need)."""
        return self.pool.num_blocks

    def get_computed_blocks(self, request: Request, end_ok=None) -> tuple[list[KVBlock], int]:
        """The longest cached prefix of a new request, leaving at least one token to compute (for its logits).
        end_ok(n), when given, must also hold for a hit of n > 0 blocks (a hybrid model's hit ends where its
        recurrent state was saved)."""
        if not self.enable_caching or request.sampling_params.prompt_logprobs is not None:
            return [], 0  # prompt logprobs need the logits of every prompt position
        max_blocks = (request.num_tokens - 1) // self.block_size
        found, valid = self.hit_lengths(request.block_hashes[:max_blocks])
        n = longest_hit(valid, end_ok)
        hits = self.hits_of(found, n)
        self.prefix_queries += request.num_tokens
        self.prefix_hits += len(hits) * self.block_size
        return hits, len(hits) * self.block_size

    def hit_lengths(self, hashes: list[bytes]) -> tuple[list[KVBlock | None], list[bool]]:
        """(the cached block of each hash or None, valid[n] for n = 0..len(hashes)): whether the first n blocks
        can be taken as computed. Full attention: all n of them cached. Sliding window: the ones inside the window
        of position n * block_size cached (the ones below it are never read again). No side effects."""
        found, valid, run = [], [True], 0
        for i, h in enumerate(hashes):
            b = self.pool.get_cached_block(h)
            found.append(b)
            run = run + 1 if b is not None else 0
            n = i + 1
            if self._windowed:
                valid.append(run >= n - self.spec.num_dead_blocks(n * self.block_size))
            elif b is None:  # full attention: the chain ends at the first miss
                valid.extend([False] * (len(hashes) - i))
                break
            else:
                valid.append(True)
        return found, valid

    def hits_of(self, found: list[KVBlock | None], n: int) -> list[KVBlock | None]:
        """The prefix hit of n blocks from hit_lengths' `found`: None in the places below the window."""
        dead = self.spec.num_dead_blocks(n * self.block_size) if self._windowed else 0
        return [None] * dead + found[dead:n]

    def num_recomputed_tokens(self, request: Request, num_hit: int) -> int:
        """Prompt tokens that are cached but computed again: a prompt that fills whole blocks, all cached, still
        computes its last block (a forward needs at least one new token). Looks up without side effects."""
        i = num_hit // self.block_size
        if (not self.enable_caching or request.sampling_params.prompt_logprobs is not None
                or (i + 1) * self.block_size != request.num_tokens or i >= len(request.block_hashes)):
            return 0
        return self.block_size if self.pool.get_cached_block(request.block_hashes[i]) is not None else 0

    def can_allocate(self, request: Request, num_new_tokens: int,
                     new_computed_blocks: list[KVBlock | None] | None = None) -> bool:
        """Whether allocate_slots would succeed now (it frees the request's blocks below a sliding window first,
        which is always safe)."""
        blocks = self.req_to_blocks.get(request.request_id)
        if blocks is not None and self._windowed:
            self._free_dead_blocks(request.request_id, blocks, request.num_computed_tokens)
        computed = new_computed_blocks or []
        held = len(blocks) if blocks is not None else 0
        total = request.num_computed_tokens + len(computed) * self.block_size + num_new_tokens
        num_needed = cdiv(total, self.block_size) - held - len(computed)
        revived = sum(1 for b in computed if b is not None and b.ref_cnt == 0)
        return num_needed <= self.pool.get_num_free_blocks() - revived

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       new_computed_blocks: list[KVBlock] | None = None,
                       num_lookahead_tokens: int = 0) -> list[int] | None:
        """Reserve slots for `num_new_tokens` more tokens after the request's computed ones (and its prefix hits),
        plus `num_lookahead_tokens` beyond them that a draft model writes its own KV into before the target computes
        them (never hashed into the prefix cache until the target has computed them).

        Returns the ids of the blocks added to the request (prefix hits first), or None when there is no room.
        """
        blocks = self.req_to_blocks.get(request.request_id)
        if blocks is not None and self._windowed:
            self._free_dead_blocks(request.request_id, blocks, request.num_computed_tokens)
        if blocks is not None and not new_computed_blocks:
            # The common decode step: the held blocks have room, so nothing is allocated (15 steps in 16).
            total = request.num_computed_tokens + num_new_tokens
            if total + num_lookahead_tokens <= len(blocks) * self.block_size:
                if self.enable_caching and total // self.block_size > self._num_cached_blocks[request.request_id]:
                    self._cache_full_blocks(request, blocks, total)
                return []
        computed = new_computed_blocks or []
        held = len(blocks) if blocks is not None else 0
        num_computed = request.num_computed_tokens + len(computed) * self.block_size
        total = num_computed + num_new_tokens
        num_needed = cdiv(total + num_lookahead_tokens, self.block_size) - held - len(computed)
        # Prefix hits sitting in the free queue stop being allocatable once touched.
        revived = sum(1 for b in computed if b is not None and b.ref_cnt == 0)
        if num_needed > self.pool.get_num_free_blocks() - revived:
            return None
        if blocks is None:
            blocks = self.req_to_blocks[request.request_id] = []
            self._num_cached_blocks[request.request_id] = len(computed)
            self._num_dead[request.request_id] = 0
        self.pool.touch(b for b in computed if b is not None)
        new = self.pool.allocate(max(num_needed, 0))
        blocks.extend(computed)
        blocks.extend(new)
        if self.enable_caching:
            self._cache_full_blocks(request, blocks, total)
        if computed and self._windowed:  # hits below the window of the first computed token: not needed
            self._free_dead_blocks(request.request_id, blocks, num_computed)
        # A hit's freed places (None) get block 0 in the runner's table: below the window, never read.
        return [0 if b is None else b.block_id for b in computed] + [b.block_id for b in new]

    def _free_dead_blocks(self, request_id: str, blocks: list[KVBlock | None], num_computed: int) -> None:
        """Free the leading blocks wholly below the window of the next query (at position num_computed)."""
        dead = min(self.spec.num_dead_blocks(num_computed), len(blocks))
        done = self._num_dead[request_id]
        if dead > done:
            # Oldest first into the free queue: they are the first a new allocation evicts.
            self.pool.free_blocks(b for b in blocks[done:dead] if b is not None)
            for i in range(done, dead):
                blocks[i] = None
            self._num_dead[request_id] = dead

    def _cache_full_blocks(self, request: Request, blocks: list[KVBlock | None], num_tokens_after_step: int) -> None:
        start = self._num_cached_blocks[request.request_id]
        end = min(num_tokens_after_step // self.block_size, len(request.block_hashes))
        for i in range(start, end):
            if blocks[i] is not None:  # (a block freed below the window before its hash was known stays out)
                self.pool.cache_full_block(blocks[i], request.block_hashes[i])
        self._num_cached_blocks[request.request_id] = max(start, end)

    def free(self, request: Request) -> None:
        blocks = self.req_to_blocks.pop(request.request_id, None)
        self._num_cached_blocks.pop(request.request_id, None)
        self._num_dead.pop(request.request_id, None)
        if blocks:
            self.pool.free_blocks(b for b in reversed(blocks) if b is not None)

    def num_held_blocks(self, request_id: str) -> int:
        """Blocks the request holds now (the freed ones below a sliding window not counted)."""
        return sum(b is not None for b in self.req_to_blocks.get(request_id, ()))

    def max_blocks_per_request(self, num_tokens: int, max_step_tokens: int) -> int:
        """The most blocks a request of num_tokens tokens holds at once, its steps at most max_step_tokens."""
        if self.spec is None:
            return cdiv(num_tokens, self.block_size)
        return self.spec.max_blocks_per_request(num_tokens, max_step_tokens)

    def get_block_ids(self, request_id: str) -> list[int]:
        """The request's block ids in order; -1 where a block below the sliding window was freed."""
        return [-1 if b is None else b.block_id for b in self.req_to_blocks.get(request_id, [])]

    def num_free_blocks(self) -> int:
        return self.pool.get_num_free_blocks()

    def reset_prefix_cache(self) -> bool:
        return self.pool.reset_prefix_cache()


def longest_hit(valid, end_ok=None) -> int:
    """The largest n with valid[n] (and end_ok(n), when given, for n > 0); valid[0] is always true."""
    return next(n for n in range(len(valid) - 1, -1, -1) if valid[n] and (n == 0 or end_ok is None or end_ok(n)))
