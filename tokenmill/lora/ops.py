"""The per-token adapter product: y[t] += (x[t] A[s_t]^T) B[s_t]^T for each token t whose adapter sits in slot s_t.

A layer's slots hold its output slices stacked (lora/manager.py): A [slots, S * R, in] (slice j's rank rows at
j * R), B [slots, out, R] (slice j's output rows where the slice sits in y, the slices contiguous from column 0),
ranks below R zero-padded.

A step describes its tokens' slots by a lora map (`build_lora_map`): int32, the first slots + 1 entries the offsets
of each slot's tokens in the list that follows, the indices of the tokens that have an adapter, sorted by slot.
The torch reference runs one shrink and one expand matmul per slot the step uses and output slice. It is the CPU
path and the oracle of the Triton kernels (lora/triton_ops.py), which the layers use on CUDA.
"""
from __future__ import annotations

import numpy as np
import torch


def build_lora_map(token_slots: np.ndarray, num_slots: int) -> np.ndarray:
    """The lora map of per-token slots (-1: no adapter)."""
    t = np.asarray(token_slots, dtype=np.int64)
    counts = np.bincount(t[t >= 0], minlength=num_slots) if len(t) else np.zeros(num_slots, dtype=np.int64)
    out = np.empty(num_slots + 1 + int(counts.sum()), dtype=np.int32)
    out[0] = 0
    np.cumsum(counts, out=out[1:num_slots + 1])
    order = np.argsort(t, kind="stable")
    out[num_slots + 1:] = order[len(t) - int(counts.sum()):]
    return out


def map_groups(lora_map: np.ndarray, num_slots: int) -> list[tuple[int, np.ndarray]]:
    """(slot, its token indices) for every slot the map uses."""
    off, idx = lora_map[:num_slots + 1], lora_map[num_slots + 1:]
    return [(s, idx[off[s]:off[s + 1]]) for s in range(num_slots) if off[s + 1] > off[s]]


def lora_delta_ref(x: torch.Tensor, y: torch.Tensor, groups: list[tuple[int, torch.Tensor]], a: torch.Tensor,
                   b: torch.Tensor, sizes: list[int], rank: int) -> None:
    """Add every token's adapter product into y in place.

    x: [T, in]; y: [T, out]; groups: (slot, the token rows using it) pairs (map_groups, rows as index tensors);
    a, b: the layer's stacked slots; sizes: the output slices' widths (summing to at most y's); rank: R. The
    products run in the weights' dtype; the sum lands in y's.
    """
    for slot, rows in groups:
        h = x.index_select(0, rows).to(a.dtype) @ a[slot].t()
        off = 0
        for j, n in enumerate(sizes):
            d = h[:, j * rank:(j + 1) * rank] @ b[slot, off:off + n].t()
            y.narrow(1, off, n).index_add_(0, rows, d.to(y.dtype))
            off += n
