"""Fill the input ids that the previous step was still sampling when this step was prepared (Triton).

With async scheduling the host builds step N+1's inputs before step N's sampled ids reach it, so those positions
hold a placeholder and a source index into the previous step's sampled ids. A CUDA graph captures this kernel
before the model: ids[i] = prev[src[i]] where src[i] >= 0, so the fix-up costs no launches outside the graph.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK = 1024


@triton.jit
def _fill_placeholders_kernel(ids_ptr, src_ptr, prev_ptr, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    src = tl.load(src_ptr + i, mask=m, other=-1)
    take = m & (src >= 0)
    tok = tl.load(prev_ptr + tl.where(take, src, 0), mask=take)
    tl.store(ids_ptr + i, tok.to(ids_ptr.dtype.element_ty), mask=take)


def fill_placeholders(ids: torch.Tensor, src: torch.Tensor, prev: torch.Tensor) -> None:
    """In place: ids[i] = prev[src[i]] for every i with src[i] >= 0 (1-D tensors on one device; ids and src of
    the same length, src entries < len(prev))."""
    n = ids.shape[0]
    assert src.shape[0] == n and ids.stride(0) == 1 and src.stride(0) == 1 and prev.stride(0) == 1
    if n:
        _fill_placeholders_kernel[(triton.cdiv(n, _BLOCK),)](ids, src, prev, n, BLOCK=_BLOCK)
