"""Triton shrink and expand kernels for the per-token adapter product (the CUDA path of lora/ops.py).

Both read the step's lora map (lora/ops.py: per slot, the offsets of its tokens in a list of token indices sorted
by slot) from one device buffer that the host fills before the forward. Their grids depend only on the number of
tokens, the layer's shapes and the number of slots, never on which adapters the step holds, so the same launches
sit inside the CUDA graphs: program (m, ., s) takes tokens m * BLOCK_M ... of slot s's list and returns at once
when the list is shorter (a slot the step does not use, a token without an adapter).

The shrink computes h[t] = x[t] A[s]^T for every output slice at once (A stacks the slices' ranks: [S * R, in]),
split over K into fp32 partials [splits, T, S * R] so a decode batch of one token still spreads over the SMs; the
expand sums the partials in a fixed order (deterministic) and adds h[t, slice j] B[s, slice j]^T into y, one
column block of one slice per program.
"""
from __future__ import annotations

import functools

import numpy as np
import torch
import triton
import triton.language as tl

from tokenmill.kernels.pdl import launch_kwargs, pdl_wait

# Shrink partials per row tile: enough programs to cover the SMs at decode batch sizes; more would make every
# expand program sum more partials than the shrink saved.
MAX_SPLITS = 16
MAX_SLICES = 3  # q, k, v of a fused qkv_proj


@triton.jit
def _tile_rows(map_ptr, slot, first, NUM_SLOTS: tl.constexpr, BLOCK_M: tl.constexpr):
    """Rows (token indices) of slot `slot`'s list from position `first`, and which of them exist."""
    hi = tl.load(map_ptr + slot + 1)
    m = tl.arange(0, BLOCK_M)
    valid = first + m < hi
    rows = tl.load(map_ptr + NUM_SLOTS + 1 + first + m, mask=valid, other=0).to(tl.int64)
    return rows, valid


@triton.jit
def _shrink_part(x_ptr, a_ptr, rows, valid, slot, R_TOT, k_lo, k_hi, x_stride, a_slot_stride, a_row_stride,
                 BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr):
    """x[rows, k_lo:k_hi] A[slot, :, k_lo:k_hi]^T in fp32 ([BLOCK_M, BLOCK_R])."""
    r = tl.arange(0, BLOCK_R)
    a_base = a_ptr + slot.to(tl.int64) * a_slot_stride
    xrow = x_ptr + rows[:, None] * x_stride
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        xmask = valid[:, None] & (k[None, :] < k_hi)
        xt = tl.load(xrow + k[None, :], mask=xmask, other=0.0)
        at = tl.load(a_base + r[None, :] * a_row_stride + k[:, None],
                     mask=(r[None, :] < R_TOT) & (k[:, None] < k_hi), other=0.0)
        if IEEE:
            acc += tl.dot(xt.to(at.dtype), at, input_precision="ieee")
        else:
            acc += tl.dot(xt.to(at.dtype), at)
    return acc


@triton.jit
def _store_part(h_ptr, acc, split, rows, valid, R_TOT, h_split_stride, h_stride, BLOCK_R: tl.constexpr):
    """A shrink partial into h[split, rows] (R_TOT columns)."""
    r = tl.arange(0, BLOCK_R)
    hp = h_ptr + split * h_split_stride + rows * h_stride
    tl.store(hp[:, None] + r[None, :], acc, mask=valid[:, None] & (r[None, :] < R_TOT))


@triton.jit
def _expand_cols(blk, n0, n1, n2, nb0, nb01, BLOCK_N: tl.constexpr):
    """Column block `blk`'s slice j, its columns and the slice's end: slices 0, 1, 2 own nb0, nb01 - nb0 and the
    remaining blocks."""
    j = (blk >= nb0).to(tl.int32) + (blk >= nb01).to(tl.int32)
    col0 = tl.where(j == 0, 0, tl.where(j == 1, n0, n0 + n1))
    blk0 = tl.where(j == 0, 0, tl.where(j == 1, nb0, nb01))
    end = tl.where(j == 0, n0, tl.where(j == 1, n0 + n1, n0 + n1 + n2))
    return j, col0 + (blk - blk0) * BLOCK_N + tl.arange(0, BLOCK_N), end


@triton.jit
def _expand_part(h_ptr, bt, y_ptr, rows, valid, j, c, end, R, SPLITS, h_split_stride, h_stride, y_stride,
                 BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, IEEE: tl.constexpr):
    """y[rows, c] += (sum of the SPLITS partials of h[rows, slice j]) bt, bt = B[slot, c, :]^T."""
    r = tl.arange(0, BLOCK_R)
    hmask = valid[:, None] & (r[None, :] < R)
    hp = h_ptr + rows[:, None] * h_stride + (j * R + r)[None, :]
    h = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for s in range(0, SPLITS):
        h += tl.load(hp + s * h_split_stride, mask=hmask, other=0.0)
    if IEEE:
        d = tl.dot(h.to(bt.dtype), bt, input_precision="ieee")
    else:
        d = tl.dot(h.to(bt.dtype), bt)
    yp = y_ptr + rows[:, None] * y_stride + c[None, :]
    mask = valid[:, None] & (c[None, :] < end)
    y = tl.load(yp, mask=mask, other=0.0)
    tl.store(yp, (y.to(tl.float32) + d).to(y.dtype), mask=mask)


@triton.jit
def _load_b(b_ptr, slot, c, end, R, b_slot_stride, b_row_stride, BLOCK_R: tl.constexpr):
    r = tl.arange(0, BLOCK_R)
    return tl.load(b_ptr + slot.to(tl.int64) * b_slot_stride + c[None, :] * b_row_stride + r[:, None],
                   mask=(c[None, :] < end) & (r[:, None] < R), other=0.0)


# No argument that varies with the step's token count takes a specialization that depends on it (h's rows are
# padded to 16 floats, so its strides always divide by 16; a count of one split is not specialized), so the graph
# capture and the profile run compile every variant a server meets: none compiles mid-serving.
@triton.jit
def _shrink_kernel(x_ptr, a_ptr, h_ptr, map_ptr, K, R_TOT, K_PER, x_stride, a_slot_stride, a_row_stride,
                   h_split_stride, h_stride, NUM_SLOTS: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr, PDL: tl.constexpr):
    tile, split, slot = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    first = tl.load(map_ptr + slot) + tile * BLOCK_M
    idle = first >= tl.load(map_ptr + slot + 1)
    # An idle program returns before the PDL wait, except program 0: its wait makes this grid's completion imply
    # the previous kernel's, which the next kernel relies on when the step has no adapter tokens at all.
    if idle & (tile + split + slot > 0):
        return
    pdl_wait(PDL)  # x is the previous kernel's output; the map was copied in before the forward
    if idle:
        return
    rows, valid = _tile_rows(map_ptr, slot, first, NUM_SLOTS, BLOCK_M)
    k_lo = split * K_PER
    acc = _shrink_part(x_ptr, a_ptr, rows, valid, slot, R_TOT, k_lo, tl.minimum(k_lo + K_PER, K), x_stride,
                       a_slot_stride, a_row_stride, BLOCK_M, BLOCK_R, BLOCK_K, IEEE)
    _store_part(h_ptr, acc, split, rows, valid, R_TOT, h_split_stride, h_stride, BLOCK_R)


@triton.jit(do_not_specialize=["SPLITS"])
def _expand_kernel(h_ptr, b_ptr, y_ptr, map_ptr, R, SPLITS, h_split_stride, h_stride, b_slot_stride, b_row_stride,
                   y_stride, n0, n1, n2, nb0, nb01, NUM_SLOTS: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr, PDL: tl.constexpr):
    tile, blk, slot = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    first = tl.load(map_ptr + slot) + tile * BLOCK_M
    idle = first >= tl.load(map_ptr + slot + 1)
    if idle & (tile + blk + slot > 0):  # as in the shrink: program 0 always waits
        return
    if idle:
        pdl_wait(PDL)
        return
    rows, valid = _tile_rows(map_ptr, slot, first, NUM_SLOTS, BLOCK_M)
    j, c, end = _expand_cols(blk, n0, n1, n2, nb0, nb01, BLOCK_N)
    bt = _load_b(b_ptr, slot, c, end, R, b_slot_stride, b_row_stride, BLOCK_R)
    pdl_wait(PDL)  # h is the shrink's output, y the product's
    _expand_part(h_ptr, bt, y_ptr, rows, valid, j, c, end, R, SPLITS, h_split_stride, h_stride, y_stride,
                 BLOCK_M, BLOCK_R, IEEE)


@functools.lru_cache(maxsize=None)
def _num_sms(device_index: int) -> int:
    if not torch.cuda.is_available():
        return 4  # the interpreter: a few splits, so the tests cover the partial sums
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def lora_delta_triton(x: torch.Tensor, y: torch.Tensor, lora_map: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                      sizes: list[int], rank: int) -> None:
    """lora/ops.lora_delta_ref's contract, the map as a device int32 tensor (x, y: 2-D, rows contiguous)."""
    if x.stride(1) != 1:
        x = x.contiguous()
    if y.stride(1) != 1:
        raise ValueError("lora_delta_triton: y's rows must be contiguous.")
    if len(sizes) > MAX_SLICES:
        raise ValueError(f"lora_delta_triton: at most {MAX_SLICES} output slices, got {len(sizes)}.")
    T, K = x.shape
    S = a.shape[0]
    r_tot = a.shape[1]
    ieee = a.dtype == torch.float32
    block_m = 16 if T <= 64 else 64
    tiles = triton.cdiv(T, block_m)
    block_k = 64
    dev = x.device.index if x.device.type == "cuda" else 0
    splits = max(1, min(MAX_SPLITS, (2 * _num_sms(dev)) // tiles, triton.cdiv(K, 4 * block_k)))
    k_per = triton.cdiv(triton.cdiv(K, splits), block_k) * block_k
    splits = triton.cdiv(K, k_per)
    pdl = launch_kwargs(x.device, "lora")
    # Rows padded to 16 floats, so every row and split starts 64-byte aligned (an odd row stride leaves the
    # partials' loads and stores unvectorized)
    h = torch.empty(splits, T, triton.cdiv(r_tot, 16) * 16, dtype=torch.float32, device=x.device)
    block_n = 64 if T <= 64 else 128
    n = list(sizes) + [0] * (MAX_SLICES - len(sizes))
    nb = [triton.cdiv(v, block_n) for v in n]
    block_rt, block_r = max(16, triton.next_power_of_2(r_tot)), max(16, triton.next_power_of_2(rank))
    _shrink_kernel[(tiles, splits, S)](
        x, a, h, lora_map, K, r_tot, k_per, x.stride(0), a.stride(0), a.stride(1), h.stride(0), h.stride(1),
        NUM_SLOTS=S, BLOCK_M=block_m, BLOCK_R=block_rt, BLOCK_K=block_k, IEEE=ieee, **pdl)
    _expand_kernel[(tiles, sum(nb), S)](
        h, b, y, lora_map, rank, splits, h.stride(0), h.stride(1), b.stride(0), b.stride(1), y.stride(0), n[0], n[1],
        n[2], nb[0], nb[0] + nb[1], NUM_SLOTS=S, BLOCK_M=block_m, BLOCK_R=block_r, BLOCK_N=block_n, IEEE=ieee,
        **pdl)


def map_to_device(lora_map: np.ndarray, device: torch.device) -> torch.Tensor:
    """A host lora map as the int32 device tensor the kernels read (tests; the runner stages it in place)."""
    return torch.from_numpy(np.ascontiguousarray(lora_map, dtype=np.int32)).to(device)
