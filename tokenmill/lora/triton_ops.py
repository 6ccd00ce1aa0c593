"""Triton shrink and expand kernels for the per-token adapter product (the CUDA path of lora/ops.py).

Both read the step's lora map (lora/ops.py: per slot, the offsets of its tokens in a list of token indices sorted
by slot) from one device buffer that the host fills before the forward. Their grids depend only on the number of
tokens, the layer's shapes and the number of slots, never on which adapters the step holds, so the same launches
sit inside the CUDA graphs. Each slot's list is cut into tiles of BLOCK_M tokens, numbered slot after slot; the
grid's first axis has one program per possible tile (`max_tiles`: the most any split of the tokens between the
slots makes), program (m, .) finds its tile's slot from the map's offsets and returns at once when the step has
fewer tiles (slots the step does not use cost nothing, a token without an adapter is in no list).

The shrink computes h[t] = x[t] A[s]^T for every output slice at once (A stacks the slices' ranks: [S * R, in]),
split over K so a decode batch of one token still spreads over the SMs: each split writes an fp32 partial and bumps
its row tile's arrival counter, and the split that arrives last sums the partials in split order (deterministic)
into h [T, S * R], so no expand program re-reads the partials (at decode sizes they outweigh B itself). The shrink
needs only x, so the layers may run it on a side stream beside the base product (lora/manager.py). The expand adds
h[t, slice j] B[s, slice j]^T into y, one column block of one slice per program.
"""
from __future__ import annotations

import functools

import numpy as np
import torch
import triton
import triton.language as tl

from tokenmill.kernels.pdl import launch_kwargs, pdl_wait
from tokenmill.kernels.triton_gemv import _MAX_SPLIT_TILES, _counters

# Shrink partials per row tile: enough programs to cover the SMs at decode batch sizes.
MAX_SPLITS = 16
MAX_SLICES = 3  # q, k, v of a fused qkv_proj


@triton.jit
def _tile_slot(map_ptr, tile, NUM_SLOTS: tl.constexpr, SLOTS_P2: tl.constexpr, BLOCK_M: tl.constexpr):
    """(slot, first list position, idle) of tile `tile`: slot s owns cdiv(count_s, BLOCK_M) tiles, slot order."""
    s = tl.arange(0, SLOTS_P2)
    lo = tl.load(map_ptr + s, mask=s < NUM_SLOTS, other=0)
    hi = tl.load(map_ptr + s + 1, mask=s < NUM_SLOTS, other=0)
    n = (hi - lo + BLOCK_M - 1) // BLOCK_M
    end = tl.cumsum(n, 0)
    own = (tile >= end - n) & (tile < end)  # at most one slot owns the tile
    slot = tl.sum(tl.where(own, s, 0), 0)
    first = tl.sum(tl.where(own, lo + (tile - (end - n)) * BLOCK_M, 0), 0)
    return slot, first, tl.sum(own.to(tl.int32), 0) == 0


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
def _store_h(h_ptr, ws_ptr, cnt_ptr, acc, tile, split, rows, valid, R_TOT, ws_split_stride, h_stride,
             BLOCK_R: tl.constexpr):
    """h[rows] = the sum of the splits' partials (R_TOT columns): the last split of the row tile to arrive adds them
    in split order and resets the tile's counter for the next call or graph replay."""
    r = tl.arange(0, BLOCK_R)
    off = rows[:, None] * h_stride + r[None, :]
    mask = valid[:, None] & (r[None, :] < R_TOT)
    splits = tl.num_programs(1)
    if splits == 1:
        tl.store(h_ptr + off, acc, mask=mask)
    else:
        tl.store(ws_ptr + split * ws_split_stride + off, acc, mask=mask)
        # Every thread's partial store must precede the (single-thread) release of the arrival counter.
        tl.debug_barrier()
        arrived = tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel")
        if arrived == splits - 1:
            total = tl.zeros(acc.shape, dtype=tl.float32)
            for s in range(0, splits):
                # .cg: the other programs' partials are in L2; an L1 line could be stale.
                total += tl.load(ws_ptr + s * ws_split_stride + off, mask=mask, other=0.0, cache_modifier=".cg")
            tl.store(h_ptr + off, total, mask=mask)
            tl.atomic_xchg(cnt_ptr + tile, 0)


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
def _expand_part(h_ptr, bt, y_ptr, rows, valid, j, c, end, R, h_stride, y_stride, BLOCK_R: tl.constexpr,
                 IEEE: tl.constexpr):
    """y[rows, c] += h[rows, slice j] bt, bt = B[slot, c, :]^T."""
    r = tl.arange(0, BLOCK_R)
    h = tl.load(h_ptr + rows[:, None] * h_stride + (j * R + r)[None, :], mask=valid[:, None] & (r[None, :] < R),
                other=0.0)
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
# padded to 16 floats, so its strides always divide by 16; the split count is the grid's, read at run time), so
# the graph capture and the profile run compile every variant a server meets: none compiles mid-serving.
@triton.jit
def _shrink_kernel(x_ptr, a_ptr, h_ptr, ws_ptr, cnt_ptr, map_ptr, K, R_TOT, K_PER, x_stride, a_slot_stride,
                   a_row_stride, ws_split_stride, h_stride, NUM_SLOTS: tl.constexpr, SLOTS_P2: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr,
                   PDL: tl.constexpr):
    tile, split = tl.program_id(0), tl.program_id(1)
    slot, first, idle = _tile_slot(map_ptr, tile, NUM_SLOTS, SLOTS_P2, BLOCK_M)
    # An idle program returns before the PDL wait, except program 0: its wait makes this grid's completion imply
    # the previous kernel's, which the next kernel relies on when the step has no adapter tokens at all.
    if idle & (tile + split > 0):
        return
    pdl_wait(PDL)  # x is the previous kernel's output; the map was copied in before the forward
    if idle:
        return
    rows, valid = _tile_rows(map_ptr, slot, first, NUM_SLOTS, BLOCK_M)
    k_lo = split * K_PER
    acc = _shrink_part(x_ptr, a_ptr, rows, valid, slot, R_TOT, k_lo, tl.minimum(k_lo + K_PER, K), x_stride,
                       a_slot_stride, a_row_stride, BLOCK_M, BLOCK_R, BLOCK_K, IEEE)
    _store_h(h_ptr, ws_ptr, cnt_ptr, acc, tile, split, rows, valid, R_TOT, ws_split_stride, h_stride, BLOCK_R)


@triton.jit
def _expand_kernel(h_ptr, b_ptr, y_ptr, map_ptr, R, h_stride, b_slot_stride, b_row_stride, y_stride, n0, n1, n2,
                   nb0, nb01, NUM_SLOTS: tl.constexpr, SLOTS_P2: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr, PDL: tl.constexpr):
    tile, blk = tl.program_id(0), tl.program_id(1)
    slot, first, idle = _tile_slot(map_ptr, tile, NUM_SLOTS, SLOTS_P2, BLOCK_M)
    if idle & (tile + blk > 0):  # as in the shrink: program 0 always waits
        return
    if idle:
        pdl_wait(PDL)
        return
    rows, valid = _tile_rows(map_ptr, slot, first, NUM_SLOTS, BLOCK_M)
    j, c, end = _expand_cols(blk, n0, n1, n2, nb0, nb01, BLOCK_N)
    bt = _load_b(b_ptr, slot, c, end, R, b_slot_stride, b_row_stride, BLOCK_R)
    pdl_wait(PDL)  # h is the shrink's output, y the product's
    _expand_part(h_ptr, bt, y_ptr, rows, valid, j, c, end, R, h_stride, y_stride, BLOCK_R, IEEE)


@functools.lru_cache(maxsize=None)
def _num_sms(device_index: int) -> int:
    if not torch.cuda.is_available():
        return 4  # the interpreter: a few splits, so the tests cover the partial sums
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def max_tiles(tokens: int, slots: int, block_m: int) -> int:
    """The most row tiles `tokens` tokens make when split between `slots` lists: k non-empty lists make
    k + sum((count - 1) // block_m) <= k + (tokens - k) // block_m tiles, most with every slot used."""
    k = min(slots, tokens)
    return max(1, k + (tokens - k) // block_m)


def _block_m(tokens: int) -> int:
    return 16 if tokens <= 64 else 64


def lora_shrink_triton(x: torch.Tensor, lora_map: torch.Tensor, a: torch.Tensor,
                       stream: torch.cuda.Stream | None = None) -> torch.Tensor:
    """h [T, R_TOT padded to 16] fp32 = every adapter token's x A[slot]^T (other rows left unset), for
    lora_expand_triton. With `stream` the kernel runs there, after the work queued so far on the current stream
    (h and the workspace are the current stream's memory; the caller makes it wait for `stream` before using h)."""
    if x.stride(1) != 1:
        x = x.contiguous()
    T, K = x.shape
    S, r_tot = a.shape[0], a.shape[1]
    block_m, block_k = _block_m(T), 64
    tiles, work_tiles = max_tiles(T, S, block_m), triton.cdiv(T, block_m)
    dev = x.device.index if x.device.type == "cuda" else 0
    splits = max(1, min(MAX_SPLITS, (2 * _num_sms(dev)) // work_tiles, triton.cdiv(K, 4 * block_k)))
    if tiles > _MAX_SPLIT_TILES:
        splits = 1
    k_per = triton.cdiv(triton.cdiv(K, splits), block_k) * block_k
    splits = triton.cdiv(K, k_per)
    # Rows padded to 16 floats, so every row and split starts 64-byte aligned (an odd row stride leaves the
    # partials' loads and stores unvectorized)
    ws = torch.empty(splits + 1, T, triton.cdiv(r_tot, 16) * 16, dtype=torch.float32, device=x.device)
    # Counters of their own: the shrink may run on a side stream beside a split-K product (lora/manager.py).
    h, cnt = ws[splits], _counters(x.device, "lora")
    launch = lambda: _shrink_kernel[(tiles, splits)](  # noqa: E731
        x, a, h, ws, cnt, lora_map, K, r_tot, k_per, x.stride(0), a.stride(0), a.stride(1), ws.stride(0),
        h.stride(0), NUM_SLOTS=S, SLOTS_P2=triton.next_power_of_2(S), BLOCK_M=block_m,
        BLOCK_R=max(16, triton.next_power_of_2(r_tot)), BLOCK_K=block_k, IEEE=a.dtype == torch.float32,
        **launch_kwargs(x.device, "lora"))
    if stream is None:
        launch()
    else:
        stream.wait_stream(torch.cuda.current_stream(x.device))
        with torch.cuda.stream(stream):
            launch()
    return h


def lora_expand_triton(h: torch.Tensor, y: torch.Tensor, lora_map: torch.Tensor, b: torch.Tensor,
                       sizes: list[int], rank: int) -> None:
    """y[t] += h[t, slice j] B[slot, slice j]^T for every adapter token t and output slice j (y: rows contiguous)."""
    if y.stride(1) != 1:
        raise ValueError("lora_expand_triton: y's rows must be contiguous.")
    if len(sizes) > MAX_SLICES:
        raise ValueError(f"lora_expand_triton: at most {MAX_SLICES} output slices, got {len(sizes)}.")
    T, S = y.shape[0], b.shape[0]
    block_m = _block_m(T)
    block_n = 64 if T <= 64 else 128
    n = list(sizes) + [0] * (MAX_SLICES - len(sizes))
    nb = [triton.cdiv(v, block_n) for v in n]
    _expand_kernel[(max_tiles(T, S, block_m), sum(nb))](
        h, b, y, lora_map, rank, h.stride(0), b.stride(0), b.stride(1), y.stride(0), n[0], n[1], n[2], nb[0],
        nb[0] + nb[1], NUM_SLOTS=S, SLOTS_P2=triton.next_power_of_2(S), BLOCK_M=block_m,
        BLOCK_R=max(16, triton.next_power_of_2(rank)), BLOCK_N=block_n, IEEE=b.dtype == torch.float32,
        **launch_kwargs(y.device, "lora"))


def lora_delta_triton(x: torch.Tensor, y: torch.Tensor, lora_map: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                      sizes: list[int], rank: int) -> None:
    """lora/ops.lora_delta_ref's contract, the map as a device int32 tensor (x, y: 2-D, y's rows contiguous)."""
    lora_expand_triton(lora_shrink_triton(x, lora_map, a), y, lora_map, b, sizes, rank)


def map_to_device(lora_map: np.ndarray, device: torch.device) -> torch.Tensor:
    """A host lora map as the int32 device tensor the kernels read (tests; the runner stages it in place)."""
    return torch.from_numpy(np.ascontiguousarray(lora_map, dtype=np.int32)).to(device)
