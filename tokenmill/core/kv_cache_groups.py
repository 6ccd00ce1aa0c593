"""The KV cache of a model whose layers keep different kinds of KV (full attention beside sliding windows): one
KVCacheManager per layer group, each with its own block pool, driven together."""
from __future__ import annotations

from tokenmill.core.kv_cache_manager import KVCacheManager, longest_hit
from tokenmill.core.kv_cache_spec import FullAttentionSpec
from tokenmill.core.request import Request


class HybridKVCacheManager:
    """The scheduler's view of a cache with several layer groups (core/kv_cache_spec.py), behind the one-group
    KVCacheManager's API.

    Group g holds the KV of its layers in its own blocks (`num_blocks[g]` of them; a sliding-window group frees
    the ones below the window as a request advances, so it needs far fewer). Block ids are per group: wherever the
    one-group manager answers a list of block ids, this one answers a tuple with one list per group, in group order
    (the runner keeps a block table per group). Check-then-act across groups: `allocate_slots` reserves in every
    group or in none. A prefix hit of n blocks is one that every group can take (full attention: all n blocks
    cached; sliding window: the ones inside the window of position n * block_size), so a hit gives what a miss
    computes.
    """

    def __init__(self, num_blocks: tuple[int, ...], block_size: int, enable_caching: bool,
                 specs: list[FullAttentionSpec]) -> None:
        if len(num_blocks) != len(specs):
            raise ValueError(f"{len(num_blocks)} block counts for {len(specs)} KV cache groups")
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.specs = list(specs)
        self.groups = [KVCacheManager(n, block_size, enable_caching, s) for n, s in zip(num_blocks, specs)]
        self.prefix_queries = 0
        self.prefix_hits = 0

    # ----- capacity -----
    @property
    def num_blocks(self) -> int:
        return sum(g.num_blocks for g in self.groups)

    def num_free_blocks(self) -> int:
        return sum(g.num_free_blocks() for g in self.groups)

    def usage(self) -> float:
        """The fullest group's usage: the one that makes the scheduler preempt first."""
        return max(g.usage() for g in self.groups)

    @property
    def num_prompt_blocks(self) -> int:
        """The full-attention group's blocks (the group a long prompt fills first)."""
        full = [g.num_blocks for g, s in zip(self.groups, self.specs) if type(s) is FullAttentionSpec]
        return min(full) if full else min(g.num_blocks for g in self.groups)

    @property
    def pool(self):
        return self.groups[0].pool

    @property
    def pools(self):
        return [g.pool for g in self.groups]

    def max_blocks_per_request(self, num_tokens: int, max_step_tokens: int) -> int:
        return sum(g.max_blocks_per_request(num_tokens, max_step_tokens) for g in self.groups)

    def num_held_blocks(self, request_id: str) -> int:
        return sum(g.num_held_blocks(request_id) for g in self.groups)

    # ----- prefix cache -----
    def get_computed_blocks(self, request: Request, end_ok=None) -> tuple[tuple[list, ...] | list, int]:
        if not self.enable_caching or request.sampling_params.prompt_logprobs is not None:
            return [], 0
        hashes = request.block_hashes[:(request.num_tokens - 1) // self.block_size]
        looked = [g.hit_lengths(hashes) for g in self.groups]
        n = longest_hit([all(valid[i] for _, valid in looked) for i in range(len(hashes) + 1)], end_ok)
        self.prefix_queries += request.num_tokens
        self.prefix_hits += n * self.block_size
        if n == 0:
            return [], 0
        return tuple(g.hits_of(found, n) for g, (found, _) in zip(self.groups, looked)), n * self.block_size

    def num_recomputed_tokens(self, request: Request, num_hit: int) -> int:
        return self.groups[0].num_recomputed_tokens(request, num_hit)

    def reset_prefix_cache(self) -> bool:
        if any(g.pool.get_num_free_blocks() != g.pool.num_blocks for g in self.groups):
            return False
        return all([g.reset_prefix_cache() for g in self.groups])

    # ----- allocation -----
    def allocate_slots(self, request: Request, num_new_tokens: int,
                       new_computed_blocks: tuple[list, ...] | list | None = None,
                       num_lookahead_tokens: int = 0) -> tuple[list[int], ...] | None:
        if num_lookahead_tokens:
            raise NotImplementedError("lookahead slots (a draft model) with several KV cache groups")
        hits = new_computed_blocks or [None] * len(self.groups)
        if not all(g.can_allocate(request, num_new_tokens, h) for g, h in zip(self.groups, hits)):
            return None
        out = tuple(g.allocate_slots(request, num_new_tokens, h) for g, h in zip(self.groups, hits))
        assert all(ids is not None for ids in out), "a group refused after can_allocate said yes"
        return out

    def free(self, request: Request) -> None:
        for g in self.groups:
            g.free(request)

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        return tuple(g.get_block_ids(request_id) for g in self.groups)


def kv_groups(specs: list[FullAttentionSpec]) -> list[tuple[FullAttentionSpec, list[int]]]:
    """The model's layer groups in a fixed order (first layer of each), each (spec, its layers)."""
    from tokenmill.core.kv_cache_spec import group_layers
    return list(group_layers(specs, range(len(specs))).items())


def make_kv_cache_manager(config, num_blocks: int | tuple[int, ...]):
    """The manager for `config`'s model: one KVCacheManager when every layer keeps the same kind of KV, a
    HybridKVCacheManager (num_blocks: one count per group of kv_groups) otherwise."""
    from tokenmill.core.kv_cache_spec import config_attention_specs
    cc = config.cache_config
    specs = config_attention_specs(config)
    groups = kv_groups(specs) if specs else []
    if len(groups) <= 1:
        if isinstance(num_blocks, tuple):
            (num_blocks,) = num_blocks
        return KVCacheManager(num_blocks, cc.block_size, cc.enable_prefix_caching, specs[0] if specs else None)
    if not isinstance(num_blocks, tuple):
        num_blocks = (num_blocks,) * len(groups)
    return HybridKVCacheManager(num_blocks, cc.block_size, cc.enable_prefix_caching, [s for s, _ in groups])


def split_kv_budget(budget_bytes: float, groups: list[tuple[FullAttentionSpec, list[int]]], own_layers,
                    max_model_len: int, max_step_tokens: int) -> tuple[int, ...]:
    """Blocks per group from one memory budget, so that every group holds the same number of max_model_len
    requests: group g costs its spec's bytes per block times its layers on this rank, and a request needs
    spec.max_blocks_per_request blocks of it (a sliding-window group far fewer than a full one)."""
    own = set(own_layers)
    need = [s.max_blocks_per_request(max_model_len, max_step_tokens) for s, _ in groups]
    cost = [s.bytes_per_block * sum(1 for i in layers if i in own) for s, layers in groups]
    per_request = sum(n * c for n, c in zip(need, cost))
    if per_request <= 0:
        return tuple(0 for _ in groups)
    requests = max(budget_bytes, 0) / per_request
    return tuple(int(requests * n) for n in need)


def kv_capacity(kv, max_model_len: int, max_step_tokens: int) -> list[list]:
    """[[group name, blocks, requests of max_model_len its blocks hold at once], ...] for the manager `kv` (one
    row per layer group; one row for a one-group cache): what the start-up log and /metrics report."""
    groups = kv.groups if isinstance(kv, HybridKVCacheManager) else [kv]
    rows = []
    for g in groups:
        need = max(g.max_blocks_per_request(max_model_len, max_step_tokens), 1)
        name = g.spec.name if g.spec is not None else "full_attention"
        rows.append([name, int(g.num_blocks), round(g.num_blocks / need, 2)])
    return rows
