"""Min-p -> top-k -> top-p sampling from torch.topk's candidates, for rows whose top_k is small: one tiny kernel.

The rules, the key() order and the race are kernels/triton_topk_topp.py's (its module docstring); this computes the
same kept set A = {key(y) >= tau} and the same token without streaming the row, for the rows with top_k >= 1 of a
batch whose largest top_k (max_top_k) is at most TOPK_SELECT_MAX; it leaves the rows without top-k to those kernels.

Why the candidates suffice. torch.topk gives each row's W = min(V, next_pow2(max_top_k + TIE_SLACK)) largest raw
logits, sorted. Dividing by a positive temperature (IEEE, rounded) is monotone non-decreasing, so the scaled list is
the row's W largest y in order (values that round together stay adjacent), and v_k, the k-th largest y, is the
list's entry k - 1. Min-p's floor and top-k's are both upper sets, so min-p's survivors P = {key(y) >= lo} with
lo = max(key(v_k), key(max(y) + log(min_p))): the list holds every element of P except, when lo = key(v_k), the
ties of v_k past its end. Top-p keeps an element when the mass of P strictly above it is < top_p * mass(P); that
mass, for any element at or above v_k, is a sum over list entries only (everything strictly above v_k is in the
list), so the tail enters only mass(P), as (its count) * exp(v_k - max). With e_i = exp(y_i - max) over P in list
order and excl_i the mass before entry i, the last entry j* with excl < top_p * mass(P) lies in the lowest kept tie
group (excl grows along the list, and a group's first entry carries the group's mass strictly above), so
tau = key(y_j*); without top-p, tau = lo. The race over A is then a race over the list entries with key >= tau,
using each entry's own column for the counter-based uniform: the same race values as the full-row race, so the same
winner (ties: the lowest column, as torch.argmax).

Ties past the list. When the list's last entry is still in P (key == lo == key(v_k)) and W < V, some ties of v_k may
lie beyond it (torch.topk keeps an arbitrary subset of a tie group at its edge). That row alone streams itself once
(`_draw`): the count of key >= lo, hence the tail's count, and the race winner over key >= lo, which is the token
when tau = lo. TIE_SLACK extra candidates make this rare (bf16 rows tie in runs of a few values near their top).

Cost: one torch.topk (a radix select over the row) and one program per row on [W]-sized vectors. CUDA-graph safe:
no host control flow depends on the data.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenmill.kernels import sampling_rng as rng
from tokenmill.kernels.pdl import launch_kwargs, pdl_wait
from tokenmill.kernels.triton_sampling_rows import _draw, _key, _log, _pick, _race, _row_key, _row_temp, _scale, _unkey

# Candidates fetched beyond the largest k, so that the tie group of the k-th value rarely runs past the list.
TIE_SLACK = 32


@triton.jit
def _select_kernel(logits_ptr, stride_b, vals_ptr, cols_ptr, W, seeds_ptr, pos_ptr, temp_ptr, k_ptr, p_ptr, minp_ptr,
                   out_ptr, thr_ptr, V, SALT_SEED: tl.constexpr, SALT_POS: tl.constexpr, SALT_COL: tl.constexpr,
                   W_P2: tl.constexpr, BLOCK: tl.constexpr, HAS_TEMP: tl.constexpr,
                   HAS_P: tl.constexpr, HAS_MINP: tl.constexpr, WANT_THR: tl.constexpr, PDL: tl.constexpr = False):
    pdl_wait(PDL)
    b = tl.program_id(0)
    kk = tl.load(k_ptr + b).to(tl.int32)
    if kk <= 0:   # top-k off: the full-row kernels draw this row
        return
    kk = tl.minimum(kk, W)   # k > W only when W = V: everything is kept, as with k = V
    temp = _row_temp(temp_ptr, b, HAS_TEMP)
    j = tl.arange(0, W_P2)
    jm = j < W
    y = _scale(tl.load(vals_ptr + b * W + j, mask=jm, other=float("-inf")), temp, HAS_TEMP)
    cols = tl.load(cols_ptr + b * W + j, mask=jm, other=0)
    key = _key(y)
    m = tl.max(y, axis=0)
    live = m > float("-inf")   # a row with every logit masked draws token 0 and keeps everything

    lo = _pick(key, j, kk - 1)
    if HAS_MINP:
        lo = tl.maximum(lo, _key(m + _log(tl.load(minp_ptr + b).to(tl.float32))))
    in_p = jm & (key >= lo)
    e = tl.where(in_p, tl.exp(y - m), 0.0)
    z = tl.sum(e, axis=0)
    tail = live & (W < V) & (_pick(key, j, W - 1) >= lo)   # the last entry is a tie of v_k still in P
    x_tail = tl.full([], 0, tl.int32)
    if tail:
        row_ptr = logits_ptr + b.to(tl.int64) * stride_b
        x_tail, n_p = _draw(row_ptr, V, temp, _row_key(seeds_ptr, pos_ptr, b, SALT_SEED, SALT_POS), lo, SALT_COL,
                            BLOCK, HAS_TEMP, True)
        z += (n_p - tl.sum(in_p.to(tl.int32), axis=0)).to(tl.float32) * _pick(e, j, W - 1)

    tau = lo
    if HAS_P:
        pp = tl.load(p_ptr + b).to(tl.float32)
        excl = tl.cumsum(e, axis=0) - e   # the mass of P before each entry
        last = tl.max(tl.where(in_p & (excl < pp * z), j, 0), axis=0)   # at least entry 0: the max is kept
        tau = tl.where(live & (pp < 1.0), _pick(key, j, last), lo)

    g = tl.where(jm & (key >= tau), _race(y, cols, _row_key(seeds_ptr, pos_ptr, b, SALT_SEED, SALT_POS), SALT_COL),
                 float("-inf"))
    x = tl.min(tl.where(g == tl.max(g, axis=0), cols, V + 1), axis=0).to(tl.int32)
    x = tl.where(tail & (tau == lo), x_tail, x)
    tl.store(out_ptr + b, tl.where(live, x, 0).to(tl.int64))
    if WANT_THR:
        tl.store(thr_ptr + b, _unkey(tau))


def select_sample(logits: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor,
                  temperature: torch.Tensor | None, top_k: torch.Tensor, top_p: torch.Tensor | None,
                  min_p: torch.Tensor | None, max_top_k: int, out: torch.Tensor, thr: torch.Tensor | None,
                  block: int) -> None:
    """Writes out[b] (and thr[b], when given) for every row b with top_k[b] > 0, as topk_topp_sample defines them;
    rows with top_k <= 0 are left untouched. logits [B, V] with a contiguous last dim; 0 < max_top_k = the largest
    top_k of the batch (a smaller value breaks the rows above it); block: the columns per iteration of the rare
    full-row pass (a power of 2)."""
    b, v = logits.shape
    width = min(v, triton.next_power_of_2(max_top_k + TIE_SLACK))
    # Raw values: the temperature division is monotone, so their order is the scaled values' order.
    vals, cols = torch.topk(logits, width, dim=-1)
    dummy = seeds
    _select_kernel[(b,)](
        logits, logits.stride(0), vals, cols, width, seeds, positions,
        temperature if temperature is not None else dummy, top_k, top_p if top_p is not None else dummy,
        min_p if min_p is not None else dummy, out, thr if thr is not None else out, v, SALT_SEED=rng._SALT_SEED,
        SALT_POS=rng._SALT_POS, SALT_COL=rng._SALT_COL, W_P2=triton.next_power_of_2(width), BLOCK=block,
        HAS_TEMP=temperature is not None, HAS_P=top_p is not None, HAS_MINP=min_p is not None,
        WANT_THR=thr is not None, num_warps=4, **launch_kwargs(logits.device, "sampling"))
