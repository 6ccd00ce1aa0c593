"""The per-token adapter product: y[t] += (x[t] A[s_t]^T) B[s_t]^T for each token t whose adapter sits in slot s_t.

The torch reference groups the tokens by slot (at most max_loras groups per step, whatever the batch size) and runs
one shrink and one expand matmul per group and output slice. It is the CPU path and the oracle of the Triton
kernels (lora/triton_ops.py), which the layers use on CUDA.
"""
from __future__ import annotations

import torch


def lora_delta_ref(x: torch.Tensor, y: torch.Tensor, groups: list[tuple[int, torch.Tensor]],
                   a: list[torch.Tensor], b: list[torch.Tensor], offsets: list[int]) -> None:
    """Add every token's adapter product into y in place.

    x: [T, in]; y: [T, out]; groups: (slot, the token rows using it) pairs; a[j]: [slots, R, in] and b[j]:
    [slots, n_j, R] are output slice j's stacked weights (ranks below R zero-padded), written to y[:, offsets[j]:
    offsets[j] + n_j]. The products run in the weights' dtype; the sum lands in y's.
    """
    for slot, rows in groups:
        xs = x.index_select(0, rows).to(a[0].dtype)
        for aj, bj, off in zip(a, b, offsets):
            d = (xs @ aj[slot].t()) @ bj[slot].t()
            y.narrow(1, off, bj.shape[1]).index_add_(0, rows, d.to(y.dtype))
