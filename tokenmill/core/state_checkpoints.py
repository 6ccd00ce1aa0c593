"""Recurrent-state checkpoints: prefix caching for hybrid models (Gated DeltaNet layers beside full attention).

A prefix hit skips tokens, and a recurrent layer has no per-token cache to read them from: it needs its state as
it stood after the last skipped token. So while prompts are computed, the state is copied at chosen block
boundaries into checkpoint slots, each keyed by the chained hash of the block that ends there; a later request
whose prompt starts with those blocks may skip to such a boundary (and no further) and starts from the copy.

Boundaries saved: every `stride_blocks`-th block boundary of a prompt and the prompt's last full block (a repeated
prompt, or the next turn of a chat, skips to it). A shared system prompt skips to the last saved boundary below
where the prompts part, so at most stride_blocks blocks of it are computed again.
"""
from __future__ import annotations

from collections import OrderedDict


class StateCheckpoints:
    """Up to `capacity` checkpoint slots (0..capacity-1), keyed by block hash, least recently used evicted first.

    Contract: `begin_step()` once per schedule; `ready(hash)` gives the slot of a checkpoint written by an earlier
    step (touching it), or None; `reserve(hash)` gives the slot the current step writes that hash's checkpoint into
    (an existing one is kept: None then), which becomes ready from the next step on. A slot read this step is never
    handed out for writing in the same step (the runner copies checkpoints out before the forward, but keeping
    the two apart makes the order irrelevant)."""

    def __init__(self, capacity: int, block_size: int, stride_blocks: int = 32) -> None:
        if capacity < 1:
            raise ValueError(f"state checkpoint capacity must be >= 1, got {capacity}")
        self.capacity, self.block_size, self.stride_blocks = capacity, block_size, stride_blocks
        self._slots: OrderedDict[bytes, int] = OrderedDict()
        self._free = list(range(capacity - 1, -1, -1))
        self._pending: set[bytes] = set()
        self._read: set[int] = set()

    def begin_step(self) -> None:
        self._pending.clear()
        self._read.clear()

    def ready(self, block_hash: bytes) -> int | None:
        slot = self._slots.get(block_hash)
        if slot is None or block_hash in self._pending:
            return None
        self._slots.move_to_end(block_hash)
        self._read.add(slot)
        return slot

    def reserve(self, block_hash: bytes) -> int | None:
        if block_hash in self._slots:
            return None
        if self._free:
            slot = self._free.pop()
        else:
            victim = next((h for h, s in self._slots.items() if s not in self._read and h not in self._pending),
                          None)
            if victim is None:
                return None
            slot = self._slots.pop(victim)
        self._slots[block_hash] = slot
        self._pending.add(block_hash)
        return slot

    def boundaries(self, start: int, end: int, num_prompt_tokens: int, num_hashed_blocks: int) -> list[int]:
        """The token positions p in (start, end] where a prompt's state is saved: block boundaries inside the
        prompt's hashed full blocks that are a multiple of stride_blocks blocks or its last full block's end."""
        bs = self.block_size
        last = min(num_prompt_tokens // bs, num_hashed_blocks)
        out = [b * bs for b in range(start // bs + 1, min(end // bs, last) + 1)
               if b % self.stride_blocks == 0 or b == last]
        return out

    def ends_hit(self, block_hashes: list[bytes]):
        """end_ok for KVCacheManager.get_computed_blocks: a hit of n blocks must end at a ready checkpoint."""
        return lambda n: block_hashes[n - 1] in self._slots and block_hashes[n - 1] not in self._pending


def num_checkpoint_slots(config) -> int:
    """Checkpoint slots a hybrid model keeps with prefix caching on (as many as sequences), else 0: the one count
    the scheduler's StateCheckpoints, the runner's state pool and the memory profile share."""
    from tokenmill.config import has_recurrent_layers
    if not config.cache_config.enable_prefix_caching or not has_recurrent_layers(config):
        return 0
    return config.scheduler_config.max_num_seqs
