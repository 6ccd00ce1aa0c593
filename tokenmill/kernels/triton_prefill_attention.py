"""Varlen causal (prefill / chunked-prefill / prefix-cached) attention over the paged KV cache (Triton).

The K/V of every token, new ones included, must already be in the cache (`store_kv` first). Request b owns query
tokens [qsl[b], qsl[b+1]) and a context of seq_lens[b] positions; with ctx = seq_len - query_len, its query i sits at
position ctx + i and attends to cache positions 0..ctx + i; with a sliding window W (window > 0) only to positions
(ctx + i - W, ctx + i], HF's sliding-window mask (key k visible to query q when q - W < k <= q).

Layout of the work:
  * grid = (query tiles of all requests, kv heads). A program handles BLOCK_Q query tokens x all G = Hq / Hkv query
    heads of one kv head ("packed GQA": the G heads are stacked along the M dim of the tile, BLOCK_M = BLOCK_Q * G
    rows, row r = query r // G, head r % G), so each K/V tile is loaded once for the whole head group.
  * Tiles are numbered without a host plan: request b's tiles start at virtual index qsl[b] // BLOCK_Q + b, an upper
    bound on the real prefix sum; a program finds its request by binary search over qsl and exits when its tile is
    past the request's end. The grid is T // BLOCK_Q + B programs along axis 0 (a few idle ones).
  * Flash-attention style: fp32 online softmax in the exp2 domain, tl.dot for QK^T and PV. The key loop is split in
    an unmasked part (keys every row of the tile sees) and a masked diagonal part.
  * fp8 cache (FP8 constexpr): K/V tiles are loaded as fp8 (half the bytes) and widened to fp16 (fp32 for fp32
    queries), which holds every e4m3 / e5m2 value exactly; q, pre-multiplied by the softmax scale, and the
    probabilities go to fp16 for the dots. Dequantising is linear, so k_scale folds into the softmax scale
    (q.(k * s_k) = s_k * (q.k)) and v_scale into the final normalisation: no per-element multiply in the key loop.
  * Sliding window (SLIDING constexpr): a tile reads keys from the lowest one its first row sees; keys every row of
    the tile sees are the unmasked middle part, the ones below it are masked per row like the diagonal part. Keys
    below the window are never loaded, so their blocks may already be freed and reused (core/kv_cache_manager.py).
  * Logit soft-capping (SOFTCAP constexpr, Gemma 2): scores become cap * tanh(score / cap) before the softmax.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenmill.kernels.kv_fp8 import is_fp8, require_scales
from tokenmill.kernels.pdl import launch_kwargs, pdl_wait

_LOG2E = 1.4426950408889634


@triton.jit
def _attn_inner(acc, l_i, m_i, q, q_pos, k_cache_ptr, v_cache_ptr, bt_row_ptr, kv_head_off, d, d_mask,
                start, end, kv_end, kv_lo, window, qk_scale, softcap,
                stride_cb, stride_cs,
                BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr, SLIDING: tl.constexpr,
                SOFTCAP: tl.constexpr, IEEE: tl.constexpr):
    for start_n in range(start, end, BLOCK_N):
        pos = start_n + tl.arange(0, BLOCK_N)
        if MASKED:
            k_mask = pos < kv_end
            if SLIDING:
                k_mask = k_mask & (pos >= kv_lo)   # below every row's window: not loaded at all
            blk = tl.load(bt_row_ptr + pos // BLOCK_SIZE, mask=k_mask, other=0).to(tl.int64)
        else:
            blk = tl.load(bt_row_ptr + pos // BLOCK_SIZE).to(tl.int64)
        row_off = blk * stride_cb + (pos % BLOCK_SIZE) * stride_cs + kv_head_off      # [BLOCK_N]
        if MASKED:
            kt = tl.load(k_cache_ptr + row_off[None, :] + d[:, None], mask=k_mask[None, :] & d_mask[:, None],
                         other=0.0)
            vv = tl.load(v_cache_ptr + row_off[:, None] + d[None, :], mask=k_mask[:, None] & d_mask[None, :],
                         other=0.0)
        else:
            kt = tl.load(k_cache_ptr + row_off[None, :] + d[:, None], mask=d_mask[:, None], other=0.0)
            vv = tl.load(v_cache_ptr + row_off[:, None] + d[None, :], mask=d_mask[None, :], other=0.0)
        if MASKED:
            s_mask = (pos[None, :] <= q_pos[:, None]) & k_mask[None, :]
            if SLIDING:
                s_mask = s_mask & (pos[None, :] > q_pos[:, None] - window)
        else:
            s_mask = pos                       # unused
        acc, l_i, m_i = softmax_tile(acc, l_i, m_i, q, kt, vv, s_mask, qk_scale, MASKED, IEEE, softcap, SOFTCAP)
    return acc, l_i, m_i


@triton.jit
def tanh_f32(x):
    """tanh through exp2 (no tanh in every triton version's language): exact to fp32 rounding."""
    e = tl.exp2(-2.8853900817779268 * tl.abs(x))          # exp(-2|x|)
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x >= 0, t, -t)


@triton.jit
def softmax_tile(acc, l_i, m_i, q, kt, vv, s_mask, qk_scale, MASKED: tl.constexpr, IEEE: tl.constexpr,
                 softcap=0.0, SOFTCAP: tl.constexpr = False):
    """One online-softmax step (exp2 domain) of q's rows over a K^T / V tile; with MASKED, scores where s_mask
    (broadcast to [rows, keys]) is false are dropped. With SOFTCAP, scores are capped as softcap * tanh(s /
    softcap), softcap given in the exp2 domain (cap * log2(e)), which caps the natural-log scores at cap.
    Returns the updated (acc, l, m)."""
    if IEEE:
        s = tl.dot(q, kt.to(q.dtype), input_precision="ieee")
    else:
        s = tl.dot(q, kt.to(q.dtype))
    s = s * qk_scale                                                                    # [BLOCK_M, BLOCK_N]
    if SOFTCAP:
        s = softcap * tanh_f32(s / softcap)
    if MASKED:
        s = tl.where(s_mask, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if IEEE:
        pv = tl.dot(p.to(q.dtype), vv.to(q.dtype), input_precision="ieee")
    else:
        pv = tl.dot(p.to(q.dtype), vv.to(q.dtype))
    return acc * alpha[:, None] + pv, l_i, m_new


@triton.jit
def _attend_span(q, q_pos, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, bt_row_ptr, kv_head_off, d, d_mask,
                 start, full_start, full_end, end, window, qk_scale, softcap, stride_cb, stride_cs,
                 ROWS: tl.constexpr, HEAD_P2: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
                 IEEE: tl.constexpr, FP8: tl.constexpr, SLIDING: tl.constexpr, SOFTCAP: tl.constexpr):
    """Online-softmax attention of q's rows to keys [start, end): [start, full_start) masked by each row's window
    (SLIDING; empty otherwise), [full_start, full_end) unmasked (a whole number of BLOCK_N tiles), the rest causal
    and bounded by end. Returns (normalised output, running max m, sum l). An fp8 cache's k_scale is folded into
    the softmax scale and its v_scale into the output."""
    m_i = tl.full([ROWS], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([ROWS], dtype=tl.float32)
    acc = tl.zeros([ROWS, HEAD_P2], dtype=tl.float32)
    if FP8:
        qk_scale = qk_scale * tl.load(k_scale_ptr)
        if not IEEE:
            # Dots in fp16, which e4m3 and e5m2 widen to in one hardware instruction per pair (widening to bf16
            # takes four), and fp16's 11-bit significand holds q no worse than bf16. The softmax scale goes into
            # q first, so q.k stays far inside fp16's range whatever q's magnitude.
            q = (q.to(tl.float32) * qk_scale).to(tl.float16)
            qk_scale = 1.0
    if SLIDING:
        acc, l_i, m_i = _attn_inner(acc, l_i, m_i, q, q_pos, k_cache_ptr, v_cache_ptr, bt_row_ptr, kv_head_off,
                                    d, d_mask, start, full_start, full_start, start, window, qk_scale, softcap,
                                    stride_cb, stride_cs, BLOCK_SIZE, BLOCK_N, True, SLIDING, SOFTCAP, IEEE)
    acc, l_i, m_i = _attn_inner(acc, l_i, m_i, q, q_pos, k_cache_ptr, v_cache_ptr, bt_row_ptr, kv_head_off, d,
                                d_mask, full_start, full_end, end, start, window, qk_scale, softcap,
                                stride_cb, stride_cs, BLOCK_SIZE, BLOCK_N, False, SLIDING, SOFTCAP, IEEE)
    acc, l_i, m_i = _attn_inner(acc, l_i, m_i, q, q_pos, k_cache_ptr, v_cache_ptr, bt_row_ptr, kv_head_off, d,
                                d_mask, full_end, end, end, start, window, qk_scale, softcap,
                                stride_cb, stride_cs, BLOCK_SIZE, BLOCK_N, True, SLIDING, SOFTCAP, IEEE)
    o = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    if FP8:
        o = o * tl.load(v_scale_ptr)
    return o, m_i, l_i


# num_seqs and the block table's row stride change with every batch: specialising on them (== 1, % 16) compiled new
# variants mid-run, each a ~1 s stall of the whole engine (seen in the structured-outputs serving bench). skip_single
# is a runtime flag for the same reason: CUDA-graph capture compiles the kernel with it set (mixed batches), and a
# constexpr made the first eager prefill of a run compile another variant (0.5 s of the H200 throughput bench).
@triton.jit(do_not_specialize=["num_seqs", "stride_bt", "skip_single"])
def _prefill_attn_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, block_table_ptr, qsl_ptr, seq_lens_ptr, k_scale_ptr, v_scale_ptr,
    num_seqs, skip_single, qk_scale, window, softcap,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_cb, stride_cs, stride_ch,
    stride_bt,
    BLOCK_SIZE: tl.constexpr, G: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, HEAD: tl.constexpr, HEAD_P2: tl.constexpr,
    IEEE: tl.constexpr, FP8: tl.constexpr, SLIDING: tl.constexpr, SOFTCAP: tl.constexpr,
    PDL: tl.constexpr = False,
):
    pdl_wait(PDL)
    pid = tl.program_id(0)
    kvh = tl.program_id(1)

    # Which request owns virtual tile `pid`: the largest b with qsl[b] // BLOCK_Q + b <= pid.
    lo = 0
    hi = num_seqs - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if tl.load(qsl_ptr + mid) // BLOCK_Q + mid <= pid:
            lo = mid
        else:
            hi = mid - 1
    b = lo
    q_start = tl.load(qsl_ptr + b)
    q_len = tl.load(qsl_ptr + b + 1) - q_start
    q0 = (pid - (q_start // BLOCK_Q + b)) * BLOCK_Q
    if q0 >= q_len:
        return
    if skip_single != 0 and q_len == 1:
        return
    seq_len = tl.load(seq_lens_ptr + b)
    ctx = seq_len - q_len

    r = tl.arange(0, BLOCK_M)
    qi = q0 + r // G                          # query index inside the request
    head = kvh * G + r % G                    # q head
    row_valid = (r < BLOCK_Q * G) & (qi < q_len)
    d = tl.arange(0, HEAD_P2)
    d_mask = d < HEAD
    tok = (q_start + qi).to(tl.int64)
    q = tl.load(q_ptr + tok[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                mask=row_valid[:, None] & d_mask[None, :], other=0.0)
    q_pos = ctx + qi

    bt_row_ptr = block_table_ptr + b * stride_bt
    kv_end = ctx + tl.minimum(q0 + BLOCK_Q, q_len)        # exclusive: the last row's position + 1
    full_end = ((ctx + q0) // BLOCK_N) * BLOCK_N          # keys below this are visible to every row of the tile
    start = 0
    full_start = 0
    if SLIDING:
        start = tl.maximum(ctx + q0 - window + 1, 0)      # the first row's oldest key: nothing below is read
        # Keys from here on are in every row's window: the last row's oldest key, rounded up to whole tiles
        # below full_end.
        all_lo = tl.maximum(kv_end - window, 0)
        full_start = tl.where(all_lo < full_end, full_end - ((full_end - all_lo) // BLOCK_N) * BLOCK_N, full_end)
        full_start = tl.maximum(full_start, start)
        full_end = tl.maximum(full_end, full_start)
    o, _, _ = _attend_span(q, q_pos, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, bt_row_ptr,
                           kvh * stride_ch, d, d_mask, start, full_start, full_end, kv_end, window, qk_scale,
                           softcap, stride_cb, stride_cs,
                           BLOCK_M, HEAD_P2, BLOCK_SIZE, BLOCK_N, IEEE, FP8, SLIDING, SOFTCAP)
    tl.store(out_ptr + tok[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
             o.to(out_ptr.dtype.element_ty), mask=row_valid[:, None] & d_mask[None, :])


def prefill_config(head_size: int, group: int, dtype: torch.dtype,
                   max_query_len: int | None = None) -> tuple[int, int, int, int]:
    """(BLOCK_M rows = BLOCK_Q * G, BLOCK_N keys, num_warps, num_stages): first guesses, to be tuned on the H200.

    All of these compiled for sm_90 (triton 3.9, CPU-side AOT) without register spills: 64/64/4/2 (D <= 128,
    ~175 regs at D=128), 128/64/8/2 (D <= 128, ~180 regs), 64/32/8/2 (D=256, ~180 regs)."""
    head_p2 = triton.next_power_of_2(head_size)
    rows = None if max_query_len is None else max_query_len * group
    if head_p2 > 128:
        block_m, block_n, warps = 64, 32, 8
    elif dtype != torch.float32 and (rows is None or rows >= 128):
        block_m, block_n, warps = 128, 64, 8
    else:
        block_m, block_n, warps = 64, 64, 4
    block_m = max(block_m, triton.next_power_of_2(group))
    return block_m, block_n, warps, 2


def prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor,
                      query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_table: torch.Tensor,
                      scale: float, num_tokens: int, skip_single: bool = False, max_query_len: int | None = None,
                      block_m: int | None = None, block_n: int | None = None,
                      num_warps: int | None = None, num_stages: int | None = None,
                      k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                      sliding_window: int | None = None, softcap: float | None = None) -> None:
    """Causal varlen attention of q [T, Hq, D] against the paged cache; writes out [T, Hq, D].

    k_cache/v_cache: [num_blocks, block_size, Hkv, D] (kv_cache[0], kv_cache[1]); query_start_loc [B+1] int32,
    seq_lens [B] int32, block_table [B, max_blocks] int32, all on the device. `num_tokens` (a host int, T or an upper
    bound of qsl[B]) sizes the grid; rows of requests with query_len 0 are ignored. skip_single=True leaves rows with
    query_len 1 alone (the decode kernel does them). max_query_len (host int, optional) only picks the tile config.
    q and out may be strided but need a contiguous head dim. An fp8 cache needs k_scale / v_scale (float32 device
    scalars): cached values are read as fp8 * scale. sliding_window W: query position p sees keys (p - W, p];
    softcap c: scores capped as c * tanh(score / c)."""
    num_seqs = seq_lens.shape[0]
    if num_seqs == 0 or num_tokens == 0:
        return
    hq, d = q.shape[1], q.shape[2]
    hkv = k_cache.shape[2]
    assert hq % hkv == 0
    g = hq // hkv
    assert q.stride(-1) == 1 and out.stride(-1) == 1 and k_cache.stride(-1) == 1
    assert k_cache.stride() == v_cache.stride()
    cfg = prefill_config(d, g, q.dtype, max_query_len)
    block_m = block_m or cfg[0]
    block_n = block_n or cfg[1]
    assert block_m >= g and block_m >= 16 and block_n >= 16
    block_q = block_m // g
    ieee = q.dtype == torch.float32     # fp32 dots in full precision (tests), not tf32
    fp8 = is_fp8(k_cache.dtype)
    if fp8:
        require_scales(k_scale, v_scale)
    else:  # never read: any pointer will do
        k_scale = v_scale = seq_lens
    grid = (num_tokens // block_q + num_seqs, hkv)
    _prefill_attn_kernel[grid](
        q, k_cache, v_cache, out, block_table, query_start_loc, seq_lens, k_scale, v_scale,
        num_seqs, int(skip_single), scale * _LOG2E, sliding_window or 0, (softcap or 1.0) * _LOG2E,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_table.stride(0),
        BLOCK_SIZE=k_cache.shape[1], G=g, BLOCK_Q=block_q, BLOCK_M=block_m, BLOCK_N=block_n,
        HEAD=d, HEAD_P2=triton.next_power_of_2(d), IEEE=ieee, FP8=fp8, SLIDING=bool(sliding_window),
        SOFTCAP=bool(softcap), num_warps=num_warps or cfg[2], num_stages=num_stages or cfg[3], **launch_kwargs(q.device, "attention"),
    )
