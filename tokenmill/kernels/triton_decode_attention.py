"""Decode attention (one query token per request) over the paged KV cache, split along the context (Triton).

Flash-decoding: stage 1 runs a program per (request, kv head, split); it attends the G = Hq / Hkv query heads of that
kv head (stacked as the M dim of a BLOCK_G >= 16 tile so tl.dot applies) to keys [split * L_s, (split + 1) * L_s) of
the request, L_s = ceil(ceil(seq_len / num_splits) / BLOCK_N) * BLOCK_N computed in the kernel from the live
seq_len, and writes the normalised partial output and its log-sum-exp (base 2). Stage 2 runs a program per
(request, q head) and merges the used splits. With num_splits == 1 stage 1 writes the output directly.

Everything the kernels need is read from device tensors (query_start_loc, seq_lens, block_table), so the launch is
CUDA-graph friendly: the host only picks the grid (batch rows, num_splits). Rows whose query_len != 1 are skipped
(they belong to the prefill kernel in a mixed batch, or are query_len-0 padding); rows with query_len 1 and
seq_len 0 (CUDA-graph padding) produce zeros.

With a sliding window W (window > 0) the query at position seq_len - 1 sees keys [max(seq_len - W, 0), seq_len):
the splits divide that range, so the work per row is bounded by the window, and older keys are never read (their
blocks may be freed). Logit soft-capping (SOFTCAP) is the prefill kernel's.

An fp8 cache (FP8 constexpr) is read as fp8 (half the bytes) and dequantised as in the prefill kernel: k_scale folds
into the softmax scale, v_scale into stage 1's normalised output (stage 2's merge is linear in it).
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from tokenmill.kernels.kv_fp8 import is_fp8, require_scales
from tokenmill.kernels.pdl import launch_kwargs, pdl_wait
from tokenmill.kernels.triton_prefill_attention import _attend_span

_LOG2E = 1.4426950408889634


@triton.jit
def row_meta(qsl_ptr, seq_lens_ptr, b):
    """Row b's (first query token, query length, context length). Step metadata, written by no kernel of the
    forward (host copies before it): the decode kernels read it before the PDL wait."""
    q_start = tl.load(qsl_ptr + b)
    return q_start, tl.load(qsl_ptr + b + 1) - q_start, tl.load(seq_lens_ptr + b)


@triton.jit
def split_len_of(seq_len, num_splits, BLOCK_N: tl.constexpr):
    """Keys per split, a multiple of BLOCK_N, from the live context length: stage 1 and stage 2 must agree on it."""
    return tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N


@triton.jit
def window_lo(seq_len, window):
    """The oldest key the newest query (position seq_len - 1) sees: 0, or seq_len - window with a window."""
    return tl.where(window > 0, tl.maximum(seq_len - window, 0), 0)


@triton.jit(do_not_specialize=["num_splits", "stride_bt"])  # vary per step: no recompiles while serving
def _decode_stage1_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_table_ptr, qsl_ptr, seq_lens_ptr, mid_o_ptr, mid_lse_ptr, out_ptr,
    k_scale_ptr, v_scale_ptr, qk_scale, num_splits, window, softcap,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_cb, stride_cs, stride_ch,
    stride_bt,
    stride_mb, stride_mh, stride_ms,
    BLOCK_SIZE: tl.constexpr, G: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr,
    HEAD: tl.constexpr, HEAD_P2: tl.constexpr, DIRECT: tl.constexpr, IEEE: tl.constexpr, FP8: tl.constexpr,
    SOFTCAP: tl.constexpr = False, PDL: tl.constexpr = False,
):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    q_start, q_len, seq_len = row_meta(qsl_ptr, seq_lens_ptr, b)
    lo = window_lo(seq_len, window)
    split_len = split_len_of(seq_len - lo, num_splits, BLOCK_N)
    start = lo + split * split_len
    # A program with nothing to do (not a decode row, or a split past the context, which stage 2 does not read)
    # leaves before the PDL wait: it frees its SM slot at once instead of after the previous kernel.
    if q_len != 1:
        return
    if not DIRECT:
        if start >= seq_len:
            return
    pdl_wait(PDL)
    end = tl.minimum(start + split_len, seq_len)

    g = tl.arange(0, BLOCK_G)
    head = kvh * G + g
    g_mask = g < G
    d = tl.arange(0, HEAD_P2)
    d_mask = d < HEAD
    tok = q_start.to(tl.int64)
    q = tl.load(q_ptr + tok * stride_qt + head[:, None] * stride_qh + d[None, :],
                mask=g_mask[:, None] & d_mask[None, :], other=0.0)
    q_pos = tl.zeros([BLOCK_G], dtype=tl.int32) + (seq_len - 1)

    full_end = start + ((end - start) // BLOCK_N) * BLOCK_N
    # One query row: every key of [lo, seq_len) is in its window, so no per-key window mask is needed.
    o, m_i, l_i = _attend_span(q, q_pos, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr,
                               block_table_ptr + b * stride_bt, kvh * stride_ch, d, d_mask, start, start, full_end,
                               end, window, qk_scale, softcap, stride_cb, stride_cs, BLOCK_G, HEAD_P2, BLOCK_SIZE,
                               BLOCK_N, IEEE, FP8, False, SOFTCAP)
    store_stage1(o, m_i, l_i, out_ptr, mid_o_ptr, mid_lse_ptr, tok, b, split, head, g_mask, d, d_mask,
                 stride_ot, stride_oh, stride_mb, stride_mh, stride_ms, HEAD_P2, DIRECT)


@triton.jit
def store_stage1(o, m_i, l_i, out_ptr, mid_o_ptr, mid_lse_ptr, tok, b, split, head, g_mask, d, d_mask,
                 stride_ot, stride_oh, stride_mb, stride_mh, stride_ms, HEAD_P2: tl.constexpr, DIRECT: tl.constexpr):
    """A stage-1 program's result: the output rows themselves with one split (DIRECT), else the split's normalised
    partial output and its log-sum-exp (base 2) for stage 2."""
    if DIRECT:
        tl.store(out_ptr + tok * stride_ot + head[:, None] * stride_oh + d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=g_mask[:, None] & d_mask[None, :])
    else:
        lse = tl.where(l_i > 0.0, m_i + tl.log2(tl.where(l_i > 0.0, l_i, 1.0)), float("-inf"))
        base = b * stride_mb + head * stride_mh + split * stride_ms
        tl.store(mid_o_ptr + base[:, None] + d[None, :], o, mask=g_mask[:, None] & d_mask[None, :])
        # mid_lse is mid_o without its last dim ([B, Hq, S] contiguous), so its offset is base / HEAD_P2.
        tl.store(mid_lse_ptr + base // HEAD_P2, lse, mask=g_mask)


@triton.jit(do_not_specialize=["num_splits"])
def _decode_stage2_kernel(
    mid_o_ptr, mid_lse_ptr, out_ptr, qsl_ptr, seq_lens_ptr,
    num_splits, window,
    stride_ot, stride_oh,
    stride_mb, stride_mh, stride_ms,
    BLOCK_N: tl.constexpr, HEAD: tl.constexpr, HEAD_P2: tl.constexpr, SPLITS_P2: tl.constexpr,
    PDL: tl.constexpr = False,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    q_start, q_len, seq_len = row_meta(qsl_ptr, seq_lens_ptr, b)
    pdl_wait(PDL)
    if q_len != 1:
        return
    span = seq_len - window_lo(seq_len, window)
    split_len = split_len_of(span, num_splits, BLOCK_N)
    used = tl.cdiv(span, tl.maximum(split_len, 1))           # splits stage 1 wrote (0 when seq_len == 0)
    s = tl.arange(0, SPLITS_P2)
    s_mask = s < used
    d = tl.arange(0, HEAD_P2)
    d_mask = d < HEAD
    base = b * stride_mb + h * stride_mh + s * stride_ms
    lse = tl.load(mid_lse_ptr + base // HEAD_P2, mask=s_mask, other=float("-inf"))
    m = tl.max(lse, 0)
    m = tl.where(m > -1.0e30, m, 0.0)
    w = tl.exp2(lse - m)                                       # 0 for unused / empty splits
    o = tl.load(mid_o_ptr + base[:, None] + d[None, :], mask=s_mask[:, None] & d_mask[None, :], other=0.0)
    num = tl.sum(o * w[:, None], 0)
    den = tl.sum(w, 0)
    res = num / tl.where(den > 0.0, den, 1.0)
    tl.store(out_ptr + q_start.to(tl.int64) * stride_ot + h * stride_oh + d, res.to(out_ptr.dtype.element_ty),
             mask=d_mask)


MAX_SPLITS = 32


def _splits_p2(num_splits: int) -> int:
    """Stage 2's split axis: one width for every count up to MAX_SPLITS, so an eager step with a new split count
    compiles nothing mid-run (CUDA-graph capture compiled it); the unused splits are masked loads."""
    return MAX_SPLITS if num_splits <= MAX_SPLITS else triton.next_power_of_2(num_splits)


@functools.lru_cache(maxsize=8)
def _num_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def decode_num_splits(num_rows: int, num_kv_heads: int, max_seq_len: int, device: torch.device,
                      block_n: int = 64, min_keys_per_split: int = 0, max_splits: int = MAX_SPLITS) -> int:
    """A power of two: enough (row, kv head, split) programs to fill the GPU about twice, and no more splits than
    max_seq_len has BLOCK_N tiles (nor than max_seq_len / min_keys_per_split). Any value is correct (splits are
    recomputed from the live seq_len in the kernel); this only sets speed. For CUDA graphs pick it once per
    captured batch size.

    Why one tile per split is the aim: at small batches a split's first K/V tile is loaded before the PDL wait,
    and every further tile is a dependent round trip after it, while a split past the live context leaves before
    the wait at almost no cost. On an H200 at batch 1, 32 splits instead of 8 (what a 256-key minimum per split
    gives at max_model_len 2048) take the decode graph 4.9% (Qwen3-0.6B) and 2.1% (Llama-3-8B) lower at a
    1266-token context, and 0.18% / 0.05% higher at 256 tokens."""
    if max_seq_len <= 0 or num_rows <= 0:
        return 1
    sms = _num_sms(device.index or 0) if device.type == "cuda" else 8
    want = triton.cdiv(2 * sms, num_rows * num_kv_heads)
    useful = triton.cdiv(max_seq_len, max(min_keys_per_split, block_n))
    n = max(1, min(want, useful, max_splits))
    return 1 << (n - 1).bit_length() if n & (n - 1) else n


def decode_config(head_size: int, group: int, dtype: torch.dtype, num_rows: int = 1) -> tuple[int, int, int]:
    """(BLOCK_N keys per iteration, num_warps, num_stages).

    Measured on an H100 (triton 3.6) at the 8B shape (32 q / 8 kv heads, D=128), ragged contexts: batches of 64+
    rows take 128/4/3, 2-4% faster than 64/4/2 with a 16-bit cache at 256 and 512 rows and 30-45% faster with an
    fp8 cache (2.26-2.48 TB/s of fp8 K/V, against 1.7-2.1 for 32/4/2 and 64/4/2); small batches keep 64/4/2, the
    config their batch-1 latency figures hold for (fp8 at one row: 18 us at a 1266-token context, as bf16). D=256
    takes 32/4/2, which compiles without register spills on sm_90."""
    head_p2 = triton.next_power_of_2(head_size)
    if head_p2 >= 256:
        return 32, 4, 2
    if num_rows >= 64 and dtype != torch.float32:
        return 128, 4, 3
    return 64, 4, 2


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor,
                     query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_table: torch.Tensor,
                     scale: float, num_splits: int = 1, block_n: int | None = None,
                     num_warps: int | None = None, num_stages: int | None = None,
                     k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                     sliding_window: int | None = None, softcap: float | None = None) -> None:
    """Attention of the single query token of each query_len-1 request in q [T, Hq, D] against the paged cache.

    Row b's token is q[query_start_loc[b]]; rows with query_len != 1 are left alone; query_len 1 with seq_len 0
    gives zeros. k_cache/v_cache [num_blocks, block_size, Hkv, D]; out [T, Hq, D] (may alias nothing in q). An fp8
    cache needs k_scale / v_scale (float32 device scalars): cached values are read as fp8 * scale.
    sliding_window / softcap as in prefill_attention. Grid: (B, Hkv, num_splits) then (B, Hq) when num_splits > 1, B = seq_lens.shape[0]."""
    num_rows = seq_lens.shape[0]
    if num_rows == 0:
        return
    hq, d = q.shape[1], q.shape[2]
    hkv = k_cache.shape[2]
    assert hq % hkv == 0
    g = hq // hkv
    assert q.stride(-1) == 1 and out.stride(-1) == 1 and k_cache.stride(-1) == 1
    assert k_cache.stride() == v_cache.stride()
    fp8 = is_fp8(k_cache.dtype)
    cfg = decode_config(d, g, q.dtype, num_rows)
    block_n = block_n or cfg[0]
    head_p2 = triton.next_power_of_2(d)
    block_g = max(16, triton.next_power_of_2(g))
    ieee = q.dtype == torch.float32     # fp32 dots in full precision (tests), not tf32
    direct = num_splits == 1
    if fp8:
        require_scales(k_scale, v_scale)
    else:  # never read: any pointer will do
        k_scale = v_scale = seq_lens
    if direct:
        mid_o = mid_lse = out          # unused
        sm = (0, 0, 0)
    else:
        mid_o = torch.empty((num_rows, hq, num_splits, head_p2), dtype=torch.float32, device=q.device)
        mid_lse = torch.empty((num_rows, hq, num_splits), dtype=torch.float32, device=q.device)
        sm = mid_o.stride()[:3]
    common = dict(num_warps=num_warps or cfg[1], **launch_kwargs(q.device, "attention"))
    _decode_stage1_kernel[(num_rows, hkv, num_splits)](
        q, k_cache, v_cache, block_table, query_start_loc, seq_lens, mid_o, mid_lse, out,
        k_scale, v_scale, scale * _LOG2E, num_splits, sliding_window or 0, (softcap or 1.0) * _LOG2E,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_table.stride(0),
        sm[0], sm[1], sm[2],
        BLOCK_SIZE=k_cache.shape[1], G=g, BLOCK_G=block_g, BLOCK_N=block_n, HEAD=d, HEAD_P2=head_p2,
        DIRECT=direct, IEEE=ieee, FP8=fp8, SOFTCAP=bool(softcap), num_stages=num_stages or cfg[2], **common,
    )
    if not direct:
        _decode_stage2_kernel[(num_rows, hq)](
            mid_o, mid_lse, out, query_start_loc, seq_lens, num_splits, sliding_window or 0,
            out.stride(0), out.stride(1), sm[0], sm[1], sm[2],
            BLOCK_N=block_n, HEAD=d, HEAD_P2=head_p2, SPLITS_P2=_splits_p2(num_splits),
            **common,
        )
