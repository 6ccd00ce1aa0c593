"""The recurrent-state slot pool of hybrid models (Gated DeltaNet layers): per layer a conv state and a delta-rule
state for each of max_num_seqs slots, a scratch slot, and prefix caching's checkpoint slots.

A request's slot is its InputBatch row: the runner takes a row when the scheduler first sends the request and
gives it back when the request finishes, is aborted or is preempted (the scheduler lists a preempted request as
finished for the runner and sends it again as new, with no computed tokens), so no second allocator is needed. A
request with no computed tokens starts from zero state whatever its slot held before; one with computed tokens
continues from its slot. A request that starts at a prefix hit has its slot filled from the checkpoint saved where
the hit ends (`restore`); the layers save checkpoints where the scheduler asks (core/state_checkpoints.py).
"""
from __future__ import annotations

import numpy as np
import torch

from tokenmill.worker.transfer import to_device


class RecurrentStateCache:
    """conv[layer]: [slots + 1, conv_dim, K - 1] in the model dtype; ssm[layer]: [slots + 1, Hv, dk, dv] float32
    (the delta-rule state accumulates over the whole context, so it is kept in full precision). The last slot,
    `scratch_slot`, belongs to no request: a CUDA graph's padding rows read and write it."""

    def __init__(self, shapes: dict[int, tuple[tuple[int, ...], tuple[int, ...]]], num_slots: int,
                 conv_dtype: torch.dtype, device: torch.device, num_checkpoints: int = 0) -> None:
        self.device = device
        self.scratch_slot = num_slots
        # Prefix caching's checkpoints (core/state_checkpoints.py) follow: checkpoint c is slot checkpoint_base + c.
        self.checkpoint_base = num_slots + 1
        total = num_slots + 1 + num_checkpoints
        self.conv = {i: torch.zeros(total, *c, dtype=conv_dtype, device=device) for i, (c, _) in shapes.items()}
        self.ssm = {i: torch.zeros(total, *s, dtype=torch.float32, device=device) for i, (_, s) in shapes.items()}

    def restore(self, slot: int, checkpoint: int) -> None:
        """A request that starts at a prefix hit: its slot takes the checkpoint's state, in every layer."""
        src = self.checkpoint_base + checkpoint
        for t in (*self.conv.values(), *self.ssm.values()):
            t[slot].copy_(t[src])

    def step(self, rows: np.ndarray, qsl: np.ndarray, computed: np.ndarray,
             saves: dict[int, list[tuple[int, int]]] | None = None) -> RecurrentStep:
        """saves: batch index -> (token offset in its chunk, checkpoint) where its state is to be saved."""
        return RecurrentStep(self, rows, qsl, computed, saves or {})


class RecurrentStep:
    """One step's view for the layers (layers/gated_deltanet.py): per request (batch order) its slot and whether
    it continues from that slot's state; decode_idx: the requests with one token and a state (updated together,
    their token indices and slots on the device); prefill_idx: the others, run one sequence at a time;
    saves[i]: (token offset in request i's chunk, slot) where the layer copies its state (prefill rows only)."""

    def __init__(self, cache: RecurrentStateCache, rows: np.ndarray, qsl: np.ndarray, computed: np.ndarray,
                 saves: dict[int, list[tuple[int, int]]]) -> None:
        self.conv, self.ssm = cache.conv, cache.ssm
        self.slots_cpu = rows
        self.query_start_loc_cpu = qsl
        self.has_state = computed > 0
        self.saves = {i: [(off, cache.checkpoint_base + c) for off, c in v] for i, v in saves.items()}
        n = np.diff(qsl)
        decode = (n == 1) & self.has_state
        if self.saves:
            decode[list(self.saves)] = False
        self.decode_idx = np.flatnonzero(decode)
        self.prefill_idx = np.flatnonzero(~decode & (n > 0)).tolist()
        self.decode_tokens = to_device(qsl[self.decode_idx].astype(np.int64), cache.device)
        self.decode_slots = to_device(rows[self.decode_idx].astype(np.int64), cache.device)


class GraphRecurrentStep:
    """The recurrent-state view a decode CUDA graph captures: every row of the graph is a decode row (one token,
    continuing from its slot's state), its token index is its row, and its slot is read from `slots`, a device
    buffer that `load` fills before each replay (padding rows: the scratch slot). The runner sends a batch
    through such a graph only when every request in it has computed tokens (a state to continue from)."""

    def __init__(self, cache: RecurrentStateCache, max_rows: int) -> None:
        self.conv, self.ssm = cache.conv, cache.ssm
        self.scratch_slot = cache.scratch_slot
        self.slots = torch.full((max_rows,), cache.scratch_slot, dtype=torch.long, device=cache.device)
        self._rows = torch.arange(max_rows, dtype=torch.long, device=cache.device)
        self._mirror = np.full(max_rows, cache.scratch_slot, dtype=np.int64)
        self.size = 0

    def view(self, size: int) -> GraphRecurrentStep:
        """Set the captured batch size (the layers read decode_idx / decode_tokens / decode_slots)."""
        self.size = size
        return self

    @property
    def decode_idx(self) -> range:
        return range(self.size)

    @property
    def decode_tokens(self) -> torch.Tensor:
        return self._rows[:self.size]

    @property
    def decode_slots(self) -> torch.Tensor:
        return self.slots[:self.size]

    prefill_idx = ()
    saves: dict = {}

    def load(self, rows: np.ndarray, size: int) -> None:
        """The slots of a batch of len(rows) requests run through the graph of `size` rows (an unchanged set is not
        copied again)."""
        want = np.full(size, self.scratch_slot, dtype=np.int64)
        want[:len(rows)] = rows
        if np.array_equal(self._mirror[:size], want):
            return
        self._mirror[:size] = want
        self.slots[:size].copy_(to_device(want, self.slots.device))
