"""Fused mixture-of-experts MLP: y[t] = sum_k w[t, k] * (silu(x[t] W1[e]^T) * (x[t] W3[e]^T)) W2[e]^T, e = ids[t, k].

Contract of `fused_moe`: x [T, H] (fp32 / bf16 / fp16); w13 [E, 2I, H] with rows 0..I-1 the gate projection W1 and
rows I..2I-1 the up projection W3 (nn.Linear weights); w2 [E, H, I] (the down projection, an nn.Linear weight);
topk_weights [T, K] (float32 or x's dtype); topk_ids [T, K] (int32 / int64, values in [0, E): not checked, since
checking would read them on the host). Returns y [T, H] in x's dtype, written into `out` when given.

How it runs, with no host/device synchronisation (every size follows from T, K, E and the tiles, so the whole call
can be captured in a CUDA graph and replayed with new routing):
1. Alignment (torch ops): the T*K assignments a = t*K + k are stably sorted by expert; `searchsorted` on the sorted
   ids gives each expert's segment. Each segment is padded to a multiple of BLOCK_M inside a buffer of the static
   upper bound of rows, (T*K + min(E, T*K) * (BLOCK_M - 1)) rounded down to whole blocks (at most min(E, T*K)
   experts receive tokens, each wasting at most BLOCK_M - 1 rows). Padding slots hold the sentinel T*K. Each
   block of rows gets its expert id, or -1 for blocks past the last used one.
2. `_moe_gate_up_kernel`: a grouped GEMM over (row blocks x I tiles). A program gathers its block's x rows
   (token a // K) and multiplies them by the gate and the up tiles of its expert's w13 (two accumulators, so the
   epilogue has both), then stores silu(gate) * up in x's dtype at the block's padded rows of the intermediate.
3. `_moe_down_kernel`: the same tiling against w2[e] over H, each row scaled by its routing weight in fp32 and
   stored at its assignment's row of an fp32 [T*K, H] buffer (every assignment has exactly one row, so no atomics).
4. torch sums the K rows of each token in a fixed order: results are deterministic and reproducible run to run.
Blocks flagged -1 return at once, so the static grid costs little beyond the launch of idle programs.

All products accumulate in fp32; fp32 operands are multiplied in full precision (input_precision="ieee", not TF32),
so an fp32 model matches PyTorch to ~1e-6 relative. `fused_moe_reference` is the PyTorch oracle and CPU fallback.
"""
from __future__ import annotations

import torch

from tokenmill import envs
from tokenmill.kernels.triton_moe_routing import align_fits, align_small

try:
    import triton
    import triton.language as tl
    _jit = triton.jit
except ImportError:  # CPU-only torch builds ship no triton: the reference (the CPU fallback) still imports
    triton = tl = None

    def _jit(fn):
        return fn

# Triton's CPU interpreter (3.9) multiplies bf16 dot operands as their raw 16-bit patterns (see triton_gemv): it gets
# fp32 operands instead (exact for bf16 / fp16 values). Compiled kernels never take that branch.
_INTERPRETED = envs.TRITON_INTERPRET


def available(device: torch.device | str) -> bool:
    """Whether `fused_moe` can run on `device`: triton is importable and the device is CUDA, or Triton's
    interpreter is on (tests, any device)."""
    return triton is not None and (_INTERPRETED or torch.device(device).type == "cuda")


def moe_tiles(num_assignments: int, num_experts: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K) for T*K assignments over E experts. BLOCK_M follows the mean rows per expert:
    at decode most experts get one or two rows, and each used expert pads its rows to a whole block, so small blocks
    waste the least work; prefill's many rows per expert amortise each weight tile over 64 rows. tl.dot needs every
    dim >= 16."""
    per_expert = num_assignments / max(num_experts, 1)
    block_m = 16 if per_expert <= 16 else 32 if per_expert <= 48 else 64
    return block_m, 64, 64


def _align(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(row ids [num_blocks * block_m] int32: the assignment a = t*K + k at each padded row, T*K at padding;
    block experts [num_blocks] int32: each block's expert, -1 for unused blocks). Static sizes only."""
    n = topk_ids.numel()
    dev = topk_ids.device
    num_blocks = (n + min(num_experts, n) * (block_m - 1)) // block_m
    flat = topk_ids.reshape(-1).to(torch.int64)
    # stable: within an expert the rows keep the assignments' order, so the layout (and the result) is reproducible
    sorted_ids, order = torch.sort(flat, stable=True)
    # bounds[e] = first sorted position with expert >= e (no bincount: on CUDA it reads the maximum on the host)
    bounds = torch.searchsorted(sorted_ids, torch.arange(num_experts + 1, device=dev, dtype=torch.int64))
    counts = bounds[1:] - bounds[:-1]
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)
    padded_start = padded_end - padded
    # sorted position i of expert e goes to padded row padded_start[e] + (i - bounds[e])
    dest = padded_start[sorted_ids] + torch.arange(n, device=dev) - bounds[sorted_ids]
    row_ids = torch.full((num_blocks * block_m,), n, dtype=torch.int32, device=dev)
    row_ids.scatter_(0, dest, order.to(torch.int32))
    # block b holds expert e where padded_start[e] <= b*BLOCK_M < padded_end[e]; E (past every segment) -> -1
    block_start = torch.arange(num_blocks, device=dev, dtype=torch.int64) * block_m
    block_expert = torch.searchsorted(padded_end, block_start, right=True)
    block_expert = torch.where(block_expert < num_experts, block_expert, -1).to(torch.int32)
    return row_ids, block_expert


@_jit
def _moe_gate_up_kernel(x_ptr, w_ptr, h_ptr, row_ids_ptr, block_expert_ptr, num_assignments, top_k, H, I,
                        stride_xt, stride_we, stride_wn, stride_hm,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_F32: tl.constexpr):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    expert = tl.load(block_expert_ptr + pid_m)
    if expert < 0:  # past the last used block: nothing to compute, and the down kernel skips these rows too
        return
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    assign = tl.load(row_ids_ptr + rm)
    m_ok = assign < num_assignments
    token = (assign // top_k).to(tl.int64)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = rn < I
    # int64 expert offset: E * 2I * H passes 2^31 elements in the large models
    w_gate = w_ptr + expert.to(tl.int64) * stride_we + rn[None, :].to(tl.int64) * stride_wn
    w_up = w_gate + I * stride_wn
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        k_ok = rk < H
        x = tl.load(x_ptr + token[:, None] * stride_xt + rk[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        kn_ok = k_ok[:, None] & n_ok[None, :]
        wg = tl.load(w_gate + rk[:, None], mask=kn_ok, other=0.0)
        wu = tl.load(w_up + rk[:, None], mask=kn_ok, other=0.0)
        if DOT_F32:
            x, wg, wu = x.to(tl.float32), wg.to(tl.float32), wu.to(tl.float32)
        acc_g += tl.dot(x, wg, input_precision="ieee")
        acc_u += tl.dot(x, wu, input_precision="ieee")
    # silu(g) * u in fp32, rounded once to the intermediate's dtype (padding rows store 0: x was masked to 0)
    h = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u
    tl.store(h_ptr + rm[:, None].to(tl.int64) * stride_hm + rn[None, :], h.to(h_ptr.dtype.element_ty),
             mask=n_ok[None, :])


@_jit
def _moe_down_kernel(h_ptr, w_ptr, y_ptr, row_ids_ptr, block_expert_ptr, topk_w_ptr, num_assignments, H, I,
                     stride_hm, stride_we, stride_wn, stride_ym,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_F32: tl.constexpr):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    expert = tl.load(block_expert_ptr + pid_m)
    if expert < 0:
        return
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    assign = tl.load(row_ids_ptr + rm)
    m_ok = assign < num_assignments
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = rn < H
    w_base = w_ptr + expert.to(tl.int64) * stride_we + rn[None, :].to(tl.int64) * stride_wn
    h_base = h_ptr + rm[:, None].to(tl.int64) * stride_hm
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, I, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        k_ok = rk < I
        h = tl.load(h_base + rk[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_base + rk[:, None], mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        if DOT_F32:
            h, w = h.to(tl.float32), w.to(tl.float32)
        acc += tl.dot(h, w, input_precision="ieee")
    # the routing weight scales the fp32 accumulator (before any rounding), as the reference does
    route = tl.load(topk_w_ptr + assign, mask=m_ok, other=0.0).to(tl.float32)
    acc = acc * route[:, None]
    tl.store(y_ptr + assign[:, None].to(tl.int64) * stride_ym + rn[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, H] (fp32/bf16/fp16); w13 [E, 2*I, H] (rows 0..I-1 are the gate projection W1, rows I..2I-1 the up
    projection W3, both as nn.Linear weights); w2 [E, H, I] (down projection as nn.Linear weight);
    topk_weights [T, K] (float32 or x.dtype); topk_ids [T, K] (int32 or int64, values in [0, E)).
    Returns y [T, H] in x.dtype with
    y[t] = sum_k topk_weights[t,k] * (silu(x[t] @ W1[e].T) * (x[t] @ W3[e].T)) @ W2[e].T, e = topk_ids[t, k].
    `out` ([T, H], x.dtype) receives y when given. No host/device synchronisation (see the module docstring):
    capturable in a CUDA graph."""
    t, hidden = x.shape
    e, two_i, _ = w13.shape
    inter = two_i // 2
    if w13.shape != (e, 2 * inter, hidden) or w2.shape != (e, hidden, inter):
        raise ValueError(f"fused_moe: w13 {tuple(w13.shape)} / w2 {tuple(w2.shape)} do not fit x {tuple(x.shape)}: "
                         f"want [E, 2I, {hidden}] and [E, {hidden}, I]")
    if topk_ids.shape != topk_weights.shape or topk_ids.shape[0] != t:
        raise ValueError(f"fused_moe: topk_ids {tuple(topk_ids.shape)} and topk_weights "
                         f"{tuple(topk_weights.shape)} must both be [T={t}, K]")
    if out is None:
        out = torch.empty(t, hidden, dtype=x.dtype, device=x.device)
    top_k = topk_ids.shape[1]
    n = t * top_k
    if n == 0:
        return out.zero_()
    # the kernels read the last dim with unit stride; weights are normally contiguous already (no copy)
    x = x if x.stride(-1) == 1 else x.contiguous()
    w13 = w13 if w13.stride(-1) == 1 else w13.contiguous()
    w2 = w2 if w2.stride(-1) == 1 else w2.contiguous()
    topk_w = topk_weights.reshape(-1).contiguous()

    block_m, block_n, block_k = moe_tiles(n, e)
    if envs.TOKENMILL_MOE_ROUTING_KERNELS and align_fits(n, e):  # one launch instead of the sort's ~15 kernels
        row_ids, block_expert = align_small(topk_ids, e, block_m)
    else:
        row_ids, block_expert = _align(topk_ids, e, block_m)
    num_blocks = block_expert.numel()
    # the intermediate in x's dtype (what a bf16 model's MLP rounds to), indexed by padded row
    h = torch.empty(num_blocks * block_m, inter, dtype=x.dtype, device=x.device)
    # fp32 per-assignment rows: the K-sum below adds unrounded products
    y_rows = torch.empty(n, hidden, dtype=torch.float32, device=x.device)
    dot_f32 = _INTERPRETED and x.dtype != torch.float32
    _moe_gate_up_kernel[(num_blocks, triton.cdiv(inter, block_n))](
        x, w13, h, row_ids, block_expert, n, top_k, hidden, inter, x.stride(0), w13.stride(0), w13.stride(1),
        h.stride(0), BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, DOT_F32=dot_f32)
    _moe_down_kernel[(num_blocks, triton.cdiv(hidden, block_n))](
        h, w2, y_rows, row_ids, block_expert, topk_w, n, hidden, inter, h.stride(0), w2.stride(0), w2.stride(1),
        y_rows.stride(0), BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, DOT_F32=dot_f32)
    # a fixed-order sum over K (deterministic, unlike atomic adds into y)
    out.copy_(y_rows.view(t, top_k, hidden).sum(1))
    return out


def fused_moe_reference(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                        topk_ids: torch.Tensor) -> torch.Tensor:
    """`fused_moe` in plain PyTorch, computed in fp32 and returned in x's dtype: a loop over the experts that have
    tokens (it reads the routing on the host, so it is the test oracle and the CPU fallback, not a graph path)."""
    t, hidden = x.shape
    inter = w13.shape[1] // 2
    xf = x.float()
    y = torch.zeros(t, hidden, dtype=torch.float32, device=x.device)
    flat_ids = topk_ids.reshape(-1).long()
    flat_w = topk_weights.reshape(-1).float()
    tokens = torch.arange(t, device=x.device).repeat_interleave(topk_ids.shape[1])
    for expert in flat_ids.unique().tolist():
        sel = flat_ids == expert
        rows = tokens[sel]
        w13e = w13[expert].float()
        gate = xf[rows] @ w13e[:inter].T
        up = xf[rows] @ w13e[inter:].T
        hid = torch.nn.functional.silu(gate) * up
        y.index_add_(0, rows, (hid @ w2[expert].float().T) * flat_w[sel, None])
    return y.to(x.dtype)
