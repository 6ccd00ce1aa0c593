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

An fp8 cache (FP8 constexpr) is read as fp8 (half the bytes) and dequantised as in the prefill kernel: k_scale folds
into the softmax scale, v_scale into stage 1's normalised output (stage 2's merge is linear in it).
"""
from __future__ import annotations

import dataclasses
import functools
import os

import torch
import triton
import triton.language as tl

from tokenmill.attention.kv_quant import is_fp8, require_scales
from tokenmill.kernels.pdl import launch_kwargs, wait_then_release
from tokenmill.kernels.triton_prefill_attention import _attend_span
from tokenmill.kernels.triton_qk_norm_rope_store import norm_rope_tile, rope_cos_sin

_LOG2E = 1.4426950408889634
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit(do_not_specialize=["num_splits", "stride_bt"])  # vary per step: no recompiles while serving
def _decode_stage1_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_table_ptr, qsl_ptr, seq_lens_ptr, mid_o_ptr, mid_lse_ptr, out_ptr,
    k_scale_ptr, v_scale_ptr, cnt_ptr, pos_ptr, slot_ptr, cos_ptr, sin_ptr, qw_ptr, kw_ptr,
    qk_scale, num_splits, eps,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_cb, stride_cs, stride_ch,
    stride_bt,
    stride_mb, stride_mh, stride_ms, stride_cos, stride_sin,
    BLOCK_SIZE: tl.constexpr, G: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr,
    HEAD: tl.constexpr, HEAD_P2: tl.constexpr, DIRECT: tl.constexpr, IEEE: tl.constexpr, FP8: tl.constexpr,
    MERGE: tl.constexpr = False, ROPE: tl.constexpr = False, HQ: tl.constexpr = 1, HKV: tl.constexpr = 1,
    ROT: tl.constexpr = 0, IS_NEOX: tl.constexpr = True, HAS_NORM: tl.constexpr = False,
    SPLITS_P2: tl.constexpr = 1, PDL: tl.constexpr = False,
):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    d = tl.arange(0, HEAD_P2)
    d_mask = d < HEAD
    if ROPE:
        # Pure decode: row b's token is b. Step metadata, the RoPE table and the norm weights are written by no
        # kernel of the forward, so they are read before the PDL wait, under the previous kernel's tail.
        tok = b.to(tl.int64)
        seq_len = tl.load(seq_lens_ptr + b)
        pos = tl.load(pos_ptr + tok).to(tl.int64)
        slot = tl.load(slot_ptr + tok).to(tl.int64)
        c, sn = rope_cos_sin(cos_ptr + pos * stride_cos, sin_ptr + pos * stride_sin, d, d_mask,
                             q_ptr.dtype.element_ty, ROT, IS_NEOX)
        wait_then_release(PDL)
    else:
        wait_then_release(PDL)
        q_start = tl.load(qsl_ptr + b)
        q_len = tl.load(qsl_ptr + b + 1) - q_start
        if q_len != 1:
            return
        tok = q_start.to(tl.int64)
        seq_len = tl.load(seq_lens_ptr + b)
    split_len = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
    used = tl.cdiv(seq_len, tl.maximum(split_len, 1))        # splits with keys (0 when seq_len == 0)
    start = split * split_len
    g = tl.arange(0, BLOCK_G)
    head = kvh * G + g
    g_mask = g < G
    if not DIRECT:
        if start >= seq_len:        # unused split: nobody reads it
            if MERGE:
                if seq_len == 0:    # a padding row: its output is zeros
                    if split == 0:
                        tl.store(out_ptr + tok * stride_ot + head[:, None] * stride_oh + d[None, :],
                                 tl.zeros([BLOCK_G, HEAD_P2], dtype=out_ptr.dtype.element_ty),
                                 mask=g_mask[:, None] & d_mask[None, :])
            return
    end = tl.minimum(start + split_len, seq_len)

    if ROPE:
        # q_ptr is the qkv projection [T, (HQ + 2 * HKV) * HEAD]: q heads are normalised and rotated here, and the
        # split holding the new token (the last used one) stores its k (normalised, rotated) and v in the cache
        # first; the barrier makes those stores visible to this program's own key loop, the only one reading them.
        row = q_ptr + tok * stride_qt
        q = norm_rope_tile(row, head, g_mask, qw_ptr, c, sn, d, d_mask, eps, HEAD, ROT, IS_NEOX, HAS_NORM)
        if split == used - 1:
            if slot >= 0:
                one = g < 1
                kk = norm_rope_tile(row + HQ * HEAD, kvh + g * 0, one, kw_ptr, c, sn, d, d_mask, eps,
                                    HEAD, ROT, IS_NEOX, HAS_NORM)
                vv = tl.load(row + (HQ + HKV + kvh + g * 0)[:, None] * HEAD + d[None, :],
                             mask=one[:, None] & d_mask[None, :])
                dst = (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_cs + kvh * stride_ch
                st = (dst + g * 0)[:, None] + d[None, :]
                tl.store(k_cache_ptr + st, kk.to(k_cache_ptr.dtype.element_ty), mask=one[:, None] & d_mask[None, :])
                tl.store(v_cache_ptr + st, vv.to(v_cache_ptr.dtype.element_ty), mask=one[:, None] & d_mask[None, :])
            tl.debug_barrier()
    else:
        q = tl.load(q_ptr + tok * stride_qt + head[:, None] * stride_qh + d[None, :],
                    mask=g_mask[:, None] & d_mask[None, :], other=0.0)
    q_pos = tl.zeros([BLOCK_G], dtype=tl.int32) + (seq_len - 1)

    full_end = start + ((end - start) // BLOCK_N) * BLOCK_N
    o, m_i, l_i = _attend_span(q, q_pos, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr,
                               block_table_ptr + b * stride_bt, kvh * stride_ch, d, d_mask, start, full_end, end,
                               qk_scale, stride_cb, stride_cs, BLOCK_G, HEAD_P2, BLOCK_SIZE, BLOCK_N, IEEE, FP8)
    out_ptrs = out_ptr + tok * stride_ot + head[:, None] * stride_oh + d[None, :]
    if DIRECT:
        tl.store(out_ptrs, o.to(out_ptr.dtype.element_ty), mask=g_mask[:, None] & d_mask[None, :])
    else:
        lse = tl.where(l_i > 0.0, m_i + tl.log2(tl.where(l_i > 0.0, l_i, 1.0)), float("-inf"))
        base = b * stride_mb + head * stride_mh + split * stride_ms
        tl.store(mid_o_ptr + base[:, None] + d[None, :], o, mask=g_mask[:, None] & d_mask[None, :])
        # mid_lse is mid_o without its last dim ([B, Hq, S] contiguous), so its offset is base / HEAD_P2.
        tl.store(mid_lse_ptr + base // HEAD_P2, lse, mask=g_mask)
        if MERGE:
            # The split that arrives last merges all of them (no second launch); it resets the counter for the next
            # call. Every thread's partial stores must precede the (single-thread) release of the counter.
            tl.debug_barrier()
            arrived = tl.atomic_add(cnt_ptr + b * tl.num_programs(1) + kvh, 1, sem="acq_rel")
            if arrived == used - 1:
                _merge_splits(mid_o_ptr, mid_lse_ptr, out_ptr + tok * stride_ot + kvh * G * stride_oh, stride_oh,
                              b * stride_mb + kvh * G * stride_mh, stride_mh, stride_ms, used, d, d_mask, G,
                              HEAD_P2, SPLITS_P2)
                tl.atomic_xchg(cnt_ptr + b * tl.num_programs(1) + kvh, 0)


@triton.jit
def _merge_splits(mid_o_ptr, mid_lse_ptr, out_row, stride_oh, base, stride_mh, stride_ms, used, d, d_mask,
                  G: tl.constexpr, HEAD_P2: tl.constexpr, SPLITS_P2: tl.constexpr):
    """Stage 2 for the G heads of one (row, kv head), in the program that finished last: each head's output is the
    log-sum-exp weighted mean of its `used` split outputs, reduced in the same shapes as the stage-2 kernel (so the
    two agree bit for bit). All loads of a head are independent: one L2 round trip, not one per split. .cg: the
    other programs' partials are in L2, never in a stale L1 line."""
    s = tl.arange(0, SPLITS_P2)
    s_mask = s < used
    for gi in tl.static_range(G):
        off = base + gi * stride_mh + s * stride_ms
        lse = tl.load(mid_lse_ptr + off // HEAD_P2, mask=s_mask, other=float("-inf"), cache_modifier=".cg")
        m = tl.max(lse, 0)
        m = tl.where(m > -1.0e30, m, 0.0)
        w = tl.exp2(lse - m)
        o = tl.load(mid_o_ptr + off[:, None] + d[None, :], mask=s_mask[:, None] & d_mask[None, :], other=0.0,
                    cache_modifier=".cg")
        num = tl.sum(o * w[:, None], 0)
        den = tl.sum(w, 0)
        res = num / tl.where(den > 0.0, den, 1.0)
        tl.store(out_row + gi * stride_oh + d, res.to(out_row.dtype.element_ty), mask=d_mask)


@triton.jit(do_not_specialize=["num_splits"])
def _decode_stage2_kernel(
    mid_o_ptr, mid_lse_ptr, out_ptr, qsl_ptr, seq_lens_ptr,
    num_splits,
    stride_ot, stride_oh,
    stride_mb, stride_mh, stride_ms,
    BLOCK_N: tl.constexpr, HEAD: tl.constexpr, HEAD_P2: tl.constexpr, SPLITS_P2: tl.constexpr,
    PDL: tl.constexpr = False,
):
    wait_then_release(PDL)
    b = tl.program_id(0)
    h = tl.program_id(1)
    q_start = tl.load(qsl_ptr + b)
    q_len = tl.load(qsl_ptr + b + 1) - q_start
    if q_len != 1:
        return
    seq_len = tl.load(seq_lens_ptr + b)
    split_len = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
    used = tl.cdiv(seq_len, tl.maximum(split_len, 1))        # splits stage 1 wrote (0 when seq_len == 0)
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
                      block_n: int = 64, min_keys_per_split: int = 256, max_splits: int = MAX_SPLITS) -> int:
    """A power of two: enough (row, kv head, split) programs to fill the GPU about twice, with each split at least
    `min_keys_per_split` keys long. Any value is correct (splits are recomputed from the live seq_len in the kernel);
    this only sets speed. For CUDA graphs pick it once per captured batch size."""
    if max_seq_len <= 0 or num_rows <= 0:
        return 1
    sms = _num_sms(device.index or 0) if device.type == "cuda" else 8
    want = triton.cdiv(2 * sms, num_rows * num_kv_heads)
    useful = triton.cdiv(max_seq_len, max(min_keys_per_split, block_n))
    n = max(1, min(want, useful, max_splits))
    return 1 << (n - 1).bit_length() if n & (n - 1) else n


def decode_config(head_size: int, group: int, dtype: torch.dtype, fp8: bool = False,
                  num_rows: int = 1) -> tuple[int, int, int]:
    """(BLOCK_N keys per iteration, num_warps, num_stages).

    fp8 cache at D=128: 64/4/2 spills ~430 bytes per thread on sm_90 (triton 3.6 and 3.9, CPU-side AOT, ptxas -v;
    the bf16 cache ~100), 32/4/2 compiles without spills. Batches of 64+ rows with a 16-bit cache take 128/4/3:
    `tools/tune_attention.py auto ragged` on the H200 (contexts uniform in 101..2044) timed it 3% faster than 64/4/2
    at 256 rows and 8% at 128; small batches keep 64/4/2, which the batch-1 latency runs were measured with."""
    head_p2 = triton.next_power_of_2(head_size)
    if head_p2 >= 256 or (fp8 and head_p2 >= 128):
        return 32, 4, 2
    if num_rows >= 64 and not fp8 and dtype != torch.float32:
        return 128, 4, 3
    return 64, 4, 2


_MAX_COUNTERS = 1 << 16      # (row, kv head) arrival counters of the in-kernel merge; larger grids use stage 2
_COUNTERS: dict[torch.device, torch.Tensor] = {}


def _counters(device: torch.device, needed: int) -> torch.Tensor | None:
    """The per-device zeroed arrival counters, or None (stage 2 merges instead) when the grid needs more or when
    they would first be created inside a CUDA-graph capture (a zeros() there only runs at replay). The merge
    resets each counter it used, so the buffer stays zero between calls. Assumes decode launches on one device
    do not run concurrently on two streams."""
    if needed > _MAX_COUNTERS or device.type != "cuda" and not _INTERPRETED:
        return None
    buf = _COUNTERS.get(device)
    if buf is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        buf = _COUNTERS[device] = torch.zeros(_MAX_COUNTERS, dtype=torch.int32, device=device)
    return buf


@dataclasses.dataclass(frozen=True)
class QkvRope:
    """What decode_attention_qkv needs to turn the raw qkv projection into attention inputs: positions and
    slot_mapping [>= T]; cos/sin caches [max_pos, rotary_dim / 2] (RotaryEmbedding's); optional per-head RMSNorm
    weights [D] of q and k (Qwen3) with their eps."""
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    cos_cache: torch.Tensor
    sin_cache: torch.Tensor
    rotary_dim: int
    is_neox: bool = True
    q_norm_weight: torch.Tensor | None = None
    k_norm_weight: torch.Tensor | None = None
    eps: float = 1e-6


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor,
                     query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_table: torch.Tensor,
                     scale: float, num_splits: int = 1, block_n: int | None = None,
                     num_warps: int | None = None, num_stages: int | None = None,
                     k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                     merge_in_kernel: bool = True) -> None:
    """Attention of the single query token of each query_len-1 request in q [T, Hq, D] against the paged cache.

    Row b's token is q[query_start_loc[b]]; rows with query_len != 1 are left alone; query_len 1 with seq_len 0
    gives zeros. k_cache/v_cache [num_blocks, block_size, Hkv, D]; out [T, Hq, D] (may alias nothing in q). An fp8
    cache needs k_scale / v_scale (float32 device scalars): cached values are read as fp8 * scale.
    Grid: (B, Hkv, num_splits), B = seq_lens.shape[0]; with num_splits > 1 the last split of each (row, kv head)
    to finish merges them (merge_in_kernel, when the counters allow) or a stage-2 launch (B, Hq) does."""
    hkv, d = k_cache.shape[2], k_cache.shape[3]
    assert q.shape[2] == d and q.stride(-1) == 1
    _launch(q, q.shape[1], hkv, d, q.stride(0), q.stride(1), k_cache, v_cache, out, query_start_loc, seq_lens,
            block_table, scale, num_splits, block_n, num_warps, num_stages, k_scale, v_scale, merge_in_kernel, None)


def decode_attention_qkv(qkv: torch.Tensor, rope: QkvRope, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         out: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                         block_table: torch.Tensor, scale: float, num_splits: int = 1,
                         block_n: int | None = None, merge_in_kernel: bool = True) -> None:
    """decode_attention straight from the qkv projection [T, (Hq + 2 * Hkv) * D] (contiguous rows) of a pure-decode
    step, replacing qk_norm_rope_store + decode_attention: q/k are normalised (optional) and rotated inside the
    attention kernel, and each row's new k/v are stored at rope.slot_mapping[token] (skipped when negative) before
    the row's keys are read. Every row of the batch must have query_len 1; out is [T, Hq, D]; a 16-bit cache of
    qkv's dtype (fp8 caches take the unfused path)."""
    hkv, d = k_cache.shape[2], k_cache.shape[3]
    width = qkv.shape[1]
    hq = width // d - 2 * hkv
    if qkv.dim() != 2 or qkv.stride(1) != 1 or hq <= 0 or (hq + 2 * hkv) * d != width or hq % hkv:
        raise ValueError(f"decode_attention_qkv: qkv must be [T, (Hq + 2 * {hkv}) * {d}] with contiguous rows, got "
                         f"{tuple(qkv.shape)}")
    if k_cache.dtype != qkv.dtype or is_fp8(k_cache.dtype):
        raise ValueError(f"decode_attention_qkv: the cache dtype must be qkv's ({qkv.dtype}), got {k_cache.dtype}")
    if rope.rotary_dim % 2 or not 0 < rope.rotary_dim <= d:
        raise ValueError(f"decode_attention_qkv: rotary_dim must be even and in (0, {d}], got {rope.rotary_dim}")
    if (rope.q_norm_weight is None) != (rope.k_norm_weight is None):
        raise ValueError("decode_attention_qkv: give both q_norm_weight and k_norm_weight, or neither")
    for t in (rope.cos_cache, rope.sin_cache):
        if t.shape[-1] != rope.rotary_dim // 2 or t.stride(-1) != 1:
            raise ValueError(f"decode_attention_qkv: cos/sin caches must be [max_pos, {rope.rotary_dim // 2}] with "
                             f"contiguous rows, got {tuple(t.shape)}")
    _launch(qkv, hq, hkv, d, qkv.stride(0), d, k_cache, v_cache, out, query_start_loc, seq_lens, block_table,
            scale, num_splits, block_n, None, None, None, None, merge_in_kernel, rope)


def _launch(q, hq, hkv, d, stride_qt, stride_qh, k_cache, v_cache, out, query_start_loc, seq_lens, block_table,
            scale, num_splits, block_n, num_warps, num_stages, k_scale, v_scale, merge_in_kernel,
            rope: QkvRope | None) -> None:
    num_rows = seq_lens.shape[0]
    if num_rows == 0:
        return
    assert hq % hkv == 0
    g = hq // hkv
    assert out.stride(-1) == 1 and k_cache.stride(-1) == 1
    assert k_cache.stride() == v_cache.stride()
    fp8 = is_fp8(k_cache.dtype)
    cfg = decode_config(d, g, q.dtype, fp8, num_rows)
    block_n = block_n or cfg[0]
    head_p2 = triton.next_power_of_2(d)
    block_g = max(16, triton.next_power_of_2(g))
    ieee = q.dtype == torch.float32     # fp32 dots in full precision (tests), not tf32
    direct = num_splits == 1
    if fp8:
        require_scales(k_scale, v_scale)
    else:  # never read: any pointer will do
        k_scale = v_scale = seq_lens
    cnt = None
    if direct:
        mid_o = mid_lse = out          # unused
        sm = (0, 0, 0)
    else:
        mid_o = torch.empty((num_rows, hq, num_splits, head_p2), dtype=torch.float32, device=q.device)
        mid_lse = torch.empty((num_rows, hq, num_splits), dtype=torch.float32, device=q.device)
        sm = mid_o.stride()[:3]
        if merge_in_kernel:
            cnt = _counters(q.device, num_rows * hkv)
    merge = cnt is not None
    r = rope
    unused = seq_lens                  # pointer arguments a variant never reads
    nw = r.q_norm_weight if r is not None and r.q_norm_weight is not None else unused
    kw = r.k_norm_weight if r is not None and r.k_norm_weight is not None else unused
    common = dict(num_warps=num_warps or cfg[1], **launch_kwargs(q.device))
    _decode_stage1_kernel[(num_rows, hkv, num_splits)](
        q, k_cache, v_cache, block_table, query_start_loc, seq_lens, mid_o, mid_lse, out,
        k_scale, v_scale, cnt if merge else unused,
        r.positions if r else unused, r.slot_mapping if r else unused, r.cos_cache if r else unused,
        r.sin_cache if r else unused, nw, kw,
        scale * _LOG2E, num_splits, r.eps if r else 0.0,
        stride_qt, stride_qh, out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_table.stride(0),
        sm[0], sm[1], sm[2], r.cos_cache.stride(0) if r else 0, r.sin_cache.stride(0) if r else 0,
        BLOCK_SIZE=k_cache.shape[1], G=g, BLOCK_G=block_g, BLOCK_N=block_n, HEAD=d, HEAD_P2=head_p2,
        DIRECT=direct, IEEE=ieee, FP8=fp8, MERGE=merge, ROPE=r is not None, HQ=hq, HKV=hkv,
        ROT=r.rotary_dim if r else 0, IS_NEOX=r.is_neox if r else True, HAS_NORM=r is not None and
        r.q_norm_weight is not None, SPLITS_P2=_splits_p2(num_splits) if merge else 1,
        num_stages=num_stages or cfg[2], **common,
    )
    if not direct and not merge:
        _decode_stage2_kernel[(num_rows, hq)](
            mid_o, mid_lse, out, query_start_loc, seq_lens, num_splits,
            out.stride(0), out.stride(1), sm[0], sm[1], sm[2],
            BLOCK_N=block_n, HEAD=d, HEAD_P2=head_p2, SPLITS_P2=_splits_p2(num_splits),
            **common,
        )
