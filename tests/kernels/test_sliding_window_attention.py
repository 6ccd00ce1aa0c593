"""Sliding-window attention and logit soft-capping: the torch reference against a dense oracle written from HF's
mask (key k visible to query q when q - W < k <= q), and the Triton prefill / decode / fused-rope decode kernels
against the torch reference, on mixed paged batches (chunked prefill rows with a cached context, decode rows).

Blocks wholly below every query's window are pointed at a block full of NaN: a backend that reads them (for
anything the result depends on) fails, which is what lets the KV cache manager free and reuse them."""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from tests.kernels.kernel_check import DEV, compile_for_sm90, rel_err  # noqa: E402
from tests.kernels.test_triton_attention import make_batch  # noqa: E402
from tokenmill.attention.backends.torch_ref import TorchRefBackend  # noqa: E402
from tokenmill.attention.backends.triton_attn import TritonAttentionBackend  # noqa: E402


def dense_oracle(md, cache, q, hq, hkv, d, scale, window, cap):
    """Per request: gather its whole context from the (already stored) cache and apply the HF mask in float64."""
    out = torch.zeros(q.shape[0], hq, d, dtype=torch.float64)
    bs = cache.shape[2]
    qsl, lens = md.query_start_loc_cpu, md.seq_lens_cpu
    for b in range(len(lens)):
        s, e, n = int(qsl[b]), int(qsl[b + 1]), int(lens[b])
        if e == s:
            continue
        pos = np.arange(n)
        slots = md.block_table[b].cpu().numpy()[pos // bs].astype(np.int64) * bs + pos % bs
        flat = cache.double().view(2, -1, hkv, d)
        k, v = flat[0][slots], flat[1][slots]                                # [n, Hkv, D]
        k, v = k.repeat_interleave(hq // hkv, 1), v.repeat_interleave(hq // hkv, 1)
        qq = q[s:e].double().view(e - s, hq, d)
        sc = torch.einsum("qhd,khd->hqk", qq, k) * scale
        if cap:
            sc = torch.tanh(sc / cap) * cap
        qpos = torch.arange(n - (e - s), n)[:, None]
        kpos = torch.arange(n)[None, :]
        mask = (kpos <= qpos) & (kpos > qpos - window if window else True)
        sc = sc.masked_fill(~mask[None], float("-inf"))
        out[s:e] = torch.einsum("hqk,khd->qhd", sc.softmax(-1), v)
    return out.view(q.shape[0], hq * d)


def poison_out_of_window(md, cache, window):
    """A cache with one more block, full of NaN, that every block-table entry wholly below all of a request's
    windows now names."""
    bs = cache.shape[2]
    nan_block = cache.shape[1]
    cache = torch.cat([cache, torch.full_like(cache[:, :1], float("nan"))], dim=1)
    qsl, lens = md.query_start_loc_cpu, md.seq_lens_cpu
    for b in range(len(lens)):
        ql, n = int(qsl[b + 1] - qsl[b]), int(lens[b])
        oldest = max(n - ql - window + 1, 0)           # the first query's oldest visible key
        md.block_table[b, :oldest // bs] = nan_block
    return cache


# (query lens, cached context lens, hq, hkv, d, block size, window): chunked prefill rows with a context, decode
# rows, windows of 1, under one key tile, across blocks, and wider than every context.
CASES = [
    ([5, 1, 1, 9], [20, 33, 7, 0], 4, 2, 16, 4, 8),
    ([17, 1, 3], [40, 70, 2], 2, 1, 32, 8, 1),
    ([1, 1, 12], [100, 5, 60], 4, 1, 16, 16, 37),
    ([6, 1], [10, 30], 4, 4, 8, 4, 1000),
]


@pytest.mark.parametrize("case", range(len(CASES)))
@pytest.mark.parametrize("cap", [None, 2.0])
def test_window_and_softcap_match_the_dense_oracle(case, cap):
    ql, ctx, hq, hkv, d, bs, w = CASES[case]
    md, kv_cache, q, k, v = make_batch(ql, ctx, hq=hq, hkv=hkv, d=d, block_size=bs, dtype=torch.float32,
                                       seed=900 + case, extra_blocks=4)
    scale = d ** -0.5
    ref_cache = kv_cache.clone()
    ref = TorchRefBackend(hq, d, hkv, scale, sliding_window=w, logits_soft_cap=cap)
    want = ref.forward(q.clone(), k, v, ref_cache, md)
    oracle = dense_oracle(md, ref_cache, q, hq, hkv, d, scale, w, cap)
    assert rel_err(want, oracle) < 1e-5

    for splits in (1, 2):
        md2, cache, q2, k2, v2 = make_batch(ql, ctx, hq=hq, hkv=hkv, d=d, block_size=bs, dtype=torch.float32,
                                            seed=900 + case, extra_blocks=4)
        cache = poison_out_of_window(md2, cache, w)
        be = TritonAttentionBackend(hq, d, hkv, scale, sliding_window=w, logits_soft_cap=cap)
        be.decode_num_splits = splits
        got = be.forward(q2, k2, v2, cache, md2)
        assert rel_err(got, oracle) < 1e-4, f"splits={splits}"

    # The torch reference never reads the out-of-window blocks either.
    md3, cache3, q3, k3, v3 = make_batch(ql, ctx, hq=hq, hkv=hkv, d=d, block_size=bs, dtype=torch.float32,
                                         seed=900 + case, extra_blocks=4)
    cache3 = poison_out_of_window(md3, cache3, w)
    assert rel_err(ref.forward(q3, k3, v3, cache3, md3), oracle) < 1e-5


def test_window_changes_the_result():
    """A window narrower than the context must change the output (the test above is not vacuous)."""
    ql, ctx, hq, hkv, d, bs, _ = CASES[0]
    md, kv_cache, q, k, v = make_batch(ql, ctx, hq=hq, hkv=hkv, d=d, block_size=bs, dtype=torch.float32, seed=3)
    full = TorchRefBackend(hq, d, hkv, d ** -0.5).forward(q, k, v, kv_cache.clone(), md)
    win = TorchRefBackend(hq, d, hkv, d ** -0.5, sliding_window=4).forward(q, k, v, kv_cache.clone(), md)
    assert rel_err(win, full) > 1e-2


def test_fused_rope_decode_honours_the_window():
    from tokenmill.kernels.triton_decode_rope_attention import decode_rope_attention
    from tokenmill.layers.rotary import RotaryEmbedding
    hq, hkv, d, bs, w = 4, 2, 16, 4, 6
    ctx = [30, 3, 17]
    md, cache, _, _, _ = make_batch([1, 1, 1], ctx, hq=hq, hkv=hkv, d=d, block_size=bs, dtype=torch.float32,
                                    seed=77, extra_blocks=4)
    g = torch.Generator().manual_seed(5)
    qkv = torch.randn(3, (hq + 2 * hkv) * d, generator=g).to(DEV)
    positions = torch.tensor(ctx, device=DEV)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    rope = RotaryEmbedding(inv_freq.to(DEV), d, d, 64, 1.0)
    ref_cache = cache.clone()
    q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
    q, k = rope(positions, q.clone(), k.clone())
    want = TorchRefBackend(hq, d, hkv, d ** -0.5, sliding_window=w).forward(q, k, v.contiguous(), ref_cache, md)
    cache = poison_out_of_window(md, cache, w)
    for splits in (1, 2):
        got = decode_rope_attention(qkv, positions, md.slot_mapping, cache.clone(), rope.cos_cache,
                                    rope.sin_cache, md.query_start_loc, md.seq_lens, md.block_table, num_heads=hq,
                                    num_kv_heads=hkv, head_dim=d, scale=d ** -0.5, num_splits=splits,
                                    sliding_window=w)
        assert rel_err(got, want) < 1e-4


_COMPILE = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from tokenmill.kernels.triton_prefill_attention import _prefill_attn_kernel
from tokenmill.kernels.triton_decode_attention import _decode_stage1_kernel, _decode_stage2_kernel
t = GPUTarget("cuda", 90, 32)
common = dict(BLOCK_SIZE=16, HEAD=128, HEAD_P2=128, IEEE=False, FP8=False)
pre = {"q_ptr": "*bf16", "k_cache_ptr": "*bf16", "v_cache_ptr": "*bf16", "out_ptr": "*bf16",
       "block_table_ptr": "*i32", "qsl_ptr": "*i32", "seq_lens_ptr": "*i32", "k_scale_ptr": "*fp32",
       "v_scale_ptr": "*fp32", "num_seqs": "i32", "skip_single": "i32", "qk_scale": "fp32", "window": "i32",
       "softcap": "fp32", "stride_qt": "i32", "stride_qh": "i32", "stride_ot": "i32", "stride_oh": "i32",
       "stride_cb": "i32", "stride_cs": "i32", "stride_ch": "i32", "stride_bt": "i32"}
cx = dict(common, G=2, BLOCK_Q=64, BLOCK_M=128, BLOCK_N=64, SLIDING=True, SOFTCAP=True, PDL=False)
for k in cx:
    pre[k] = "constexpr"
out = [sorted(triton.compile(ASTSource(fn=_prefill_attn_kernel, signature=pre, constexprs=cx), target=t).asm)]
s1 = {"q_ptr": "*bf16", "k_cache_ptr": "*bf16", "v_cache_ptr": "*bf16", "block_table_ptr": "*i32",
      "qsl_ptr": "*i32", "seq_lens_ptr": "*i32", "mid_o_ptr": "*fp32", "mid_lse_ptr": "*fp32", "out_ptr": "*bf16",
      "k_scale_ptr": "*fp32", "v_scale_ptr": "*fp32", "qk_scale": "fp32", "num_splits": "i32", "window": "i32",
      "softcap": "fp32", "stride_qt": "i32", "stride_qh": "i32", "stride_ot": "i32", "stride_oh": "i32",
      "stride_cb": "i32", "stride_cs": "i32", "stride_ch": "i32", "stride_bt": "i32", "stride_mb": "i32",
      "stride_mh": "i32", "stride_ms": "i32"}
cx1 = dict(common, G=2, BLOCK_G=16, BLOCK_N=64, DIRECT=False, SOFTCAP=True, PDL=False)
for k in cx1:
    s1[k] = "constexpr"
out.append(sorted(triton.compile(ASTSource(fn=_decode_stage1_kernel, signature=s1, constexprs=cx1), target=t).asm))
s2 = {"mid_o_ptr": "*fp32", "mid_lse_ptr": "*fp32", "out_ptr": "*bf16", "qsl_ptr": "*i32", "seq_lens_ptr": "*i32",
      "num_splits": "i32", "window": "i32", "stride_ot": "i32", "stride_oh": "i32", "stride_mb": "i32",
      "stride_mh": "i32", "stride_ms": "i32"}
cx2 = dict(BLOCK_N=64, HEAD=128, HEAD_P2=128, SPLITS_P2=32, PDL=False)
for k in cx2:
    s2[k] = "constexpr"
out.append(sorted(triton.compile(ASTSource(fn=_decode_stage2_kernel, signature=s2, constexprs=cx2), target=t).asm))
print(out)
"""


def test_windowed_kernels_compile_for_sm90():
    """The interpreter accepts code the compiler rejects: compile the windowed, soft-capped variants for an
    H100/H200 target too (on the CPU, in a process without the interpreter)."""
    assert compile_for_sm90(_COMPILE).count("ttgir") == 3
