"""Triton shrink and expand kernels for the per-token adapter product (the CUDA path of lora/ops.py).

The step's tokens are cut into tiles: runs of consecutive tokens under one adapter slot (a prefill chunk is one
run, split every BLOCK_M tokens; a decode step's run is usually one token), built once per step on the host. The
shrink computes h[t] = x[t] A[s]^T ([T, R] in float32) tile by tile; the expand adds h[t] B[s]^T into y's output
slice. Tokens without an adapter are in no tile and are not touched.
"""
from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

BLOCK_M = 16


@triton.jit
def _shrink_kernel(x_ptr, a_ptr, h_ptr, start_ptr, len_ptr, slot_ptr, K, R, x_stride, a_slot_stride,
                   a_row_stride, h_stride, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    tile = tl.program_id(0)
    start, n, slot = tl.load(start_ptr + tile), tl.load(len_ptr + tile), tl.load(slot_ptr + tile)
    m = tl.arange(0, BLOCK_M)
    r = tl.arange(0, BLOCK_R)
    rows = start + m
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    a_base = a_ptr + slot.to(tl.int64) * a_slot_stride
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        xt = tl.load(x_ptr + rows[:, None].to(tl.int64) * x_stride + k[None, :],
                     mask=(m[:, None] < n) & (k[None, :] < K), other=0.0)
        at = tl.load(a_base + r[None, :] * a_row_stride + k[:, None], mask=(r[None, :] < R) & (k[:, None] < K),
                     other=0.0)
        acc += tl.dot(xt.to(at.dtype), at, out_dtype=tl.float32)
    tl.store(h_ptr + rows[:, None].to(tl.int64) * h_stride + r[None, :], acc,
             mask=(m[:, None] < n) & (r[None, :] < R))


@triton.jit
def _expand_kernel(h_ptr, b_ptr, y_ptr, start_ptr, len_ptr, slot_ptr, N, R, h_stride, b_slot_stride,
                   b_row_stride, y_stride, y_offset, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr,
                   BLOCK_N: tl.constexpr):
    tile = tl.program_id(0)
    start, n, slot = tl.load(start_ptr + tile), tl.load(len_ptr + tile), tl.load(slot_ptr + tile)
    m = tl.arange(0, BLOCK_M)
    r = tl.arange(0, BLOCK_R)
    c = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = start + m
    bt = tl.load(b_ptr + slot.to(tl.int64) * b_slot_stride + c[None, :] * b_row_stride + r[:, None],
                 mask=(c[None, :] < N) & (r[:, None] < R), other=0.0)
    ht = tl.load(h_ptr + rows[:, None].to(tl.int64) * h_stride + r[None, :],
                 mask=(m[:, None] < n) & (r[None, :] < R), other=0.0)
    d = tl.dot(ht.to(bt.dtype), bt, out_dtype=tl.float32)
    yp = y_ptr + rows[:, None].to(tl.int64) * y_stride + y_offset + c[None, :]
    mask = (m[:, None] < n) & (c[None, :] < N)
    y = tl.load(yp, mask=mask, other=0.0)
    tl.store(yp, (y.to(tl.float32) + d).to(y.dtype), mask=mask)


def make_tiles(token_slots: np.ndarray, device: torch.device) -> tuple[torch.Tensor, ...] | None:
    """(start, length, slot) int32 tensors of the tiles of a step's per-token slots (-1: no adapter); None when
    no token has an adapter. Built once per step and shared by every layer."""
    t = np.asarray(token_slots, dtype=np.int64)
    if not len(t) or (t < 0).all():
        return None
    edges = np.flatnonzero(np.diff(t)) + 1
    starts = np.concatenate(([0], edges))
    ends = np.concatenate((edges, [len(t)]))
    keep = t[starts] >= 0
    starts, ends = starts[keep], ends[keep]
    counts = -(-(ends - starts) // BLOCK_M)
    tile_start = np.repeat(starts, counts) + BLOCK_M * (np.arange(counts.sum()) - np.repeat(np.cumsum(counts) - counts,
                                                                                         counts))
    tile_len = np.minimum(np.repeat(ends, counts) - tile_start, BLOCK_M)
    tile_slot = t[tile_start]
    return tuple(torch.from_numpy(v.astype(np.int32)).to(device) for v in (tile_start, tile_len, tile_slot))


def lora_delta_triton(x: torch.Tensor, y: torch.Tensor, tiles: tuple[torch.Tensor, ...],
                      a: list[torch.Tensor], b: list[torch.Tensor], offsets: list[int]) -> None:
    """lora_delta_ref's contract over tiles from make_tiles (x, y: 2-D, rows contiguous)."""
    start, length, slot = tiles
    if x.stride(1) != 1:
        x = x.contiguous()
    if y.stride(1) != 1:
        raise ValueError("lora_delta_triton: y's rows must be contiguous.")
    num_tiles = start.shape[0]
    T, K = x.shape
    R = a[0].shape[1]
    block_r = max(16, triton.next_power_of_2(R))
    for aj, bj, off in zip(a, b, offsets):
        h = torch.empty(T, R, dtype=torch.float32, device=x.device)
        _shrink_kernel[(num_tiles,)](x, aj, h, start, length, slot, K, R, x.stride(0), aj.stride(0), aj.stride(1),
                                     h.stride(0), BLOCK_M=BLOCK_M, BLOCK_R=block_r, BLOCK_K=32)
        N = bj.shape[1]
        _expand_kernel[(num_tiles, triton.cdiv(N, 64))](h, bj, y, start, length, slot, N, R, h.stride(0),
                                                        bj.stride(0), bj.stride(1), y.stride(0), off,
                                                        BLOCK_M=BLOCK_M, BLOCK_R=block_r, BLOCK_N=64)
