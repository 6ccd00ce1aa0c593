"""The small steps of a MoE layer on CUDA, each one Triton launch instead of a dozen torch ops: the router's softmax
+ top-k (+ renormalisation) and, for batches of up to ALIGN_MAX_CELLS / E assignments, the layout of the
assignments sorted by expert that the grouped expert GEMMs read (kernels/triton_fused_moe.py). At a decode step
the torch forms of these steps launch ~20 small kernels a layer, which cost more than the experts' products at
batch 1.

`topk_softmax(logits, k, renormalize, out_dtype)` -> (weights [T, k] out_dtype, ids [T, k] int32): probabilities
in fp32 from the logits (any float dtype), the k largest in decreasing order (ties to the lower expert id), divided
by their sum when `renormalize`. Matches torch.softmax(fp32) + torch.topk to fp32 rounding.

`align_small(topk_ids, num_experts, block_m)` -> (row_ids, block_expert): the same contract and sizes as
triton_fused_moe._align (assignment a = t*K + k at each padded row, sentinel T*K; each block's expert or -1), for
T*K * next_pow2(E) <= ALIGN_MAX_CELLS, in one program. Neither synchronises with the host.

The MoE layers use them only with TOKENMILL_MOE_ROUTING_KERNELS=1: they are checked against the torch forms
(interpreted on the CPU) but not yet compiled and timed on a device.
"""
from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
    _jit = triton.jit
except ImportError:  # CPU-only torch builds ship no triton; these are CUDA paths only
    triton = tl = None

    def _jit(fn):
        return fn

# Cells of the one program's [assignments, experts] one-hot matrix: 512 assignments (64 tokens at top-8) of 128
# experts, 128 of 512. Past that the torch alignment (a sort) runs.
ALIGN_MAX_CELLS = 65536


def _pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


@_jit
def _topk_softmax_kernel(logits_ptr, w_ptr, ids_ptr, E, stride_l, K: tl.constexpr, K_P2: tl.constexpr,
                         E_P2: tl.constexpr, RENORM: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, E_P2)
    ok = offs < E
    x = tl.load(logits_ptr + row * stride_l + offs, mask=ok, other=-float("inf")).to(tl.float32)
    p = tl.exp(x - tl.max(x, 0))
    p = p / tl.sum(p, 0)
    p = tl.where(ok, p, -2.0)  # padding never wins, not even against an underflowed 0
    slots = tl.arange(0, K_P2)
    vals = tl.zeros([K_P2], dtype=tl.float32)
    idxs = tl.zeros([K_P2], dtype=tl.int32)
    for j in tl.static_range(K):
        best = tl.max(p, 0)
        idx = tl.min(tl.where(p == best, offs, E_P2), 0)  # the lowest id among equal maxima
        vals = tl.where(slots == j, best, vals)
        idxs = tl.where(slots == j, idx, idxs)
        p = tl.where(offs == idx, -1.0, p)
    if RENORM:
        vals = vals / tl.sum(tl.where(slots < K, vals, 0.0), 0)
    tl.store(w_ptr + row * K + slots, vals.to(w_ptr.dtype.element_ty), mask=slots < K)
    tl.store(ids_ptr + row * K + slots, idxs, mask=slots < K)


def topk_softmax(logits: torch.Tensor, k: int, renormalize: bool,
                 out_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    t, e = logits.shape
    weights = torch.empty(t, k, dtype=out_dtype, device=logits.device)
    ids = torch.empty(t, k, dtype=torch.int32, device=logits.device)
    if t:
        logits = logits if logits.stride(-1) == 1 else logits.contiguous()
        e_p2 = _pow2(e)
        _topk_softmax_kernel[(t,)](logits, weights, ids, e, logits.stride(0), K=k, K_P2=_pow2(k), E_P2=e_p2,
                                   RENORM=renormalize, num_warps=1 if e_p2 <= 128 else 4)
    return weights, ids


def align_fits(num_assignments: int, num_experts: int) -> bool:
    """Whether `align_small` takes this many assignments over this many experts."""
    return num_assignments > 0 and _pow2(num_assignments) * _pow2(num_experts) <= ALIGN_MAX_CELLS


@_jit
def _align_kernel(ids_ptr, row_ids_ptr, block_expert_ptr, n, E, num_rows, num_blocks,
                  N_P2: tl.constexpr, E_P2: tl.constexpr, ROWS_P2: tl.constexpr, NB_P2: tl.constexpr,
                  BLOCK_M: tl.constexpr):
    a = tl.arange(0, N_P2)
    a_ok = a < n
    ex = tl.arange(0, E_P2)
    e = tl.load(ids_ptr + a, mask=a_ok, other=E).to(tl.int32)
    onehot = ((e[:, None] == ex[None, :]) & a_ok[:, None]).to(tl.int32)  # [N, E]
    counts = tl.sum(onehot, 0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    end = tl.cumsum(padded, 0)
    start = end - padded
    # an assignment's place among its expert's, in assignment order (what the stable sort gives)
    rank = tl.sum(tl.cumsum(onehot, 0) * onehot, 1) - 1
    dest = tl.sum(onehot * start[None, :], 1) + rank
    r = tl.arange(0, ROWS_P2)
    tl.store(row_ids_ptr + r, tl.zeros([ROWS_P2], dtype=tl.int32) + n, mask=r < num_rows)
    tl.debug_barrier()  # the padding's sentinel first, then the assignments over it
    tl.store(row_ids_ptr + dest, a, mask=a_ok)
    b = tl.arange(0, NB_P2)
    # block b's expert: how many experts' padded segments end at or before its first row
    done = (end[None, :] <= (b * BLOCK_M)[:, None]) & (ex[None, :] < E)
    be = tl.sum(done.to(tl.int32), 1)
    tl.store(block_expert_ptr + b, tl.where(be < E, be, -1), mask=b < num_blocks)


def align_small(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    n = topk_ids.numel()
    num_blocks = (n + min(num_experts, n) * (block_m - 1)) // block_m
    dev = topk_ids.device
    row_ids = torch.empty(num_blocks * block_m, dtype=torch.int32, device=dev)
    block_expert = torch.empty(num_blocks, dtype=torch.int32, device=dev)
    ids = topk_ids.reshape(-1)
    ids = ids if ids.is_contiguous() else ids.contiguous()
    _align_kernel[(1,)](ids, row_ids, block_expert, n, num_experts, num_blocks * block_m, num_blocks,
                        N_P2=_pow2(n), E_P2=_pow2(num_experts), ROWS_P2=_pow2(num_blocks * block_m),
                        NB_P2=_pow2(num_blocks), BLOCK_M=block_m, num_warps=4)
    return row_ids, block_expert
