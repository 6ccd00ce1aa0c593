"""Decode attention straight from the qkv projection (tokenmill/kernels/triton_decode_attention_qkv.py: q/k-norm,
RoPE, KV store and attention in one launch) against the separate kernels it replaces: qk_norm_rope_store, then
decode_attention.

On the CPU the kernels run in Triton's interpreter (tests/kernels/conftest.py sets TRITON_INTERPRET=1)."""
from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from tests.kernels.kernel_check import DEV, check_pdl_chain, rel_err  # noqa: E402
from tests.kernels.test_triton_attention import make_batch  # noqa: E402
from tokenmill.kernels.triton_decode_attention import decode_attention  # noqa: E402
from tokenmill.kernels.triton_decode_attention_qkv import QkvRope, decode_attention_qkv  # noqa: E402
from tokenmill.kernels.triton_qk_norm_rope_store import qk_norm_rope_store  # noqa: E402
from tokenmill.layers.rotary import RotaryEmbedding  # noqa: E402

TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


def _rope_inputs(t, pad_rows, d, rot, is_neox, norm, dtype, gen, max_pos=512):
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, rot, 2).float() / rot))
    rope = RotaryEmbedding(inv_freq, d, rot, max_pos, scaling=1.0, is_neox_style=is_neox).to(DEV)
    positions = torch.randint(0, max_pos, (t + pad_rows,), generator=gen).to(DEV)
    qw = (torch.randn(d, generator=gen) * 0.5 + 1).to(DEV, dtype) if norm else None
    kw = (torch.randn(d, generator=gen) * 0.5 + 1).to(DEV, dtype) if norm else None
    return rope, positions, qw, kw


@torch.no_grad()
def check_qkv(ctx_lens, *, hq, hkv, d, rot=None, is_neox=True, norm=True, dtype=torch.float32, bs=16, splits=1,
              pad_rows=0, seed=0):
    rot = rot or d
    n = len(ctx_lens)
    md, kv_cache, _, _, _ = make_batch([1] * n, ctx_lens, hq=hq, hkv=hkv, d=d, block_size=bs, dtype=dtype,
                                       seed=seed, pad_rows=pad_rows)
    gen = torch.Generator().manual_seed(seed + 1)
    rows = n + pad_rows
    qkv = (torch.randn(rows, (hq + 2 * hkv) * d, generator=gen) * 2).to(DEV, dtype)
    rope, positions, qw, kw = _rope_inputs(n, pad_rows, d, rot, is_neox, norm, dtype, gen)
    scale = d ** -0.5

    # Reference: the separate kernels (store + rotate, then attention).
    ref_cache = kv_cache.clone()
    q = qk_norm_rope_store(qkv, positions, md.slot_mapping, ref_cache, rope.cos_cache, rope.sin_cache,
                           num_heads=hq, num_kv_heads=hkv, head_dim=d, rotary_dim=rot, is_neox=is_neox,
                           q_norm_weight=qw, k_norm_weight=kw, eps=1e-6)
    ref = torch.full((rows, hq, d), float("nan"), dtype=dtype, device=DEV)
    decode_attention(q.view(rows, hq, d), ref_cache[0], ref_cache[1], ref, md.query_start_loc, md.seq_lens,
                     md.block_table, scale, num_splits=splits, block_n=16)

    cache = kv_cache.clone()
    out = torch.full((rows, hq, d), float("nan"), dtype=dtype, device=DEV)
    spec = QkvRope(positions, md.slot_mapping, rope.cos_cache, rope.sin_cache, rot, is_neox, qw, kw, 1e-6)
    decode_attention_qkv(qkv, spec, cache[0], cache[1], out, md.query_start_loc, md.seq_lens, md.block_table,
                         scale, num_splits=splits, block_n=16)
    assert torch.equal(cache[1], ref_cache[1]), "v is stored bit for bit at the same slots"
    assert rel_err(cache[0], ref_cache[0]) < TOL[dtype] / 10, "k differs after the store"
    nb, bsz = kv_cache.shape[1], kv_cache.shape[2]
    written = torch.zeros(nb * bsz, dtype=torch.bool, device=DEV)
    slots = md.slot_mapping[:n]
    written[slots[slots >= 0]] = True
    written = written.view(nb, bsz)
    assert torch.equal(cache[:, ~written], kv_cache[:, ~written]), "a slot outside slot_mapping was written"
    err = rel_err(out[:n], ref[:n])
    assert err < TOL[dtype], f"rel err {err:.2e}"
    assert torch.equal(out[n:], torch.zeros_like(out[n:])), "padding rows must be zeros"


@pytest.mark.parametrize("splits", [1, 2, 4])
def test_qkv_gqa_norm_neox(splits):
    """Qwen3-like: GQA 4, per-head norm, neox; contexts crossing blocks and splits, padded rows."""
    check_qkv([0, 15, 16, 40], hq=8, hkv=2, d=64, splits=splits, pad_rows=2, seed=3 + splits)


def test_qkv_gptj_no_norm_partial_rotary_fp16():
    """Llama-like without q/k norm, gptj pairs, a partial rotary_dim (the rest passes through), fp16."""
    check_qkv([3, 33, 1], hq=4, hkv=4, d=64, rot=32, is_neox=False, norm=False, dtype=torch.float16, splits=2,
              seed=11)


def test_qkv_odd_group_and_head():
    """G = 3 (padded to 16 rows inside) and head size 96 (padded to 128)."""
    check_qkv([5, 20], hq=6, hkv=2, d=96, splits=2, seed=12)


def test_qkv_several_tiles_per_split():
    """Splits of several 16-key tiles: the new token sits in a tile read after the PDL wait, not the prefetched one."""
    check_qkv([70, 47, 100], hq=4, hkv=2, d=64, splits=1, seed=13)
    check_qkv([70, 47, 100], hq=4, hkv=2, d=64, splits=2, seed=14)


def test_qkv_rejects_bad_arguments():
    md, kv_cache, _, _, _ = make_batch([1], [4], hq=4, hkv=2, d=64, block_size=16, dtype=torch.float32, seed=0)
    gen = torch.Generator().manual_seed(0)
    rope, positions, _, _ = _rope_inputs(1, 0, 64, 64, True, False, torch.float32, gen)
    spec = QkvRope(positions, md.slot_mapping, rope.cos_cache, rope.sin_cache, 64)
    out = torch.empty(1, 4, 64, device=DEV)
    with pytest.raises(ValueError, match="qkv must be"):
        decode_attention_qkv(torch.zeros(1, 500, device=DEV), spec, kv_cache[0], kv_cache[1], out,
                             md.query_start_loc, md.seq_lens, md.block_table, 0.1)
    with pytest.raises(ValueError, match="cache dtype"):
        decode_attention_qkv(torch.zeros(1, 512, device=DEV, dtype=torch.float16), spec, kv_cache[0], kv_cache[1],
                             out, md.query_start_loc, md.seq_lens, md.block_table, 0.1)
    bad = QkvRope(positions, md.slot_mapping, rope.cos_cache, rope.sin_cache, 63)
    with pytest.raises(ValueError, match="rotary_dim"):
        decode_attention_qkv(torch.zeros(1, 512, device=DEV), bad, kv_cache[0], kv_cache[1], out,
                             md.query_start_loc, md.seq_lens, md.block_table, 0.1)


# ------------------------------------------------------------------------------------------------------------ GPU
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_qkv_gpu(dtype):
    """Benchmark-like shapes: Qwen3-0.6B (16/8 heads, 128, q/k norm) and Llama-3-8B (32/8) heads, long contexts,
    the split counts the CUDA graphs use."""
    ctx = [0, 5, 63, 64, 65, 700, 1500, 2046, 300]
    for seed, (hq, hkv, norm, splits) in enumerate(((16, 8, True, 8), (32, 8, False, 4), (16, 8, True, 1))):
        check_qkv(ctx, hq=hq, hkv=hkv, d=128, norm=norm, dtype=dtype, splits=splits, pad_rows=3, seed=seed)


@pytest.mark.gpu
def test_qkv_gpu_pdl_chain_in_graph(monkeypatch):
    """Six fused decode launches, each reading the previous output as its qkv (as a forward's layers do), captured
    with programmatic dependent launch: bit-identical to plain stream order on every replay."""
    from tokenmill.kernels import pdl
    if not pdl.pdl_enabled(torch.device(DEV)):
        pytest.skip("programmatic dependent launch needs compute capability 9.0+")
    hq, hkv, d = 16, 8, 128
    n = 9
    md, kv_cache, _, _, _ = make_batch([1] * n, [0, 5, 63, 64, 65, 700, 1500, 2046, 300], hq=hq, hkv=hkv, d=d,
                                       block_size=16, dtype=torch.bfloat16, seed=21, pad_rows=3)
    gen = torch.Generator().manual_seed(5)
    rows = n + 3
    rope, positions, qw, kw = _rope_inputs(n, 3, d, d, True, True, torch.bfloat16, gen)
    spec = QkvRope(positions, md.slot_mapping, rope.cos_cache, rope.sin_cache, d, True, qw, kw, 1e-6)
    qkv0 = torch.randn(rows, (hq + 2 * hkv) * d, generator=gen).to(DEV, torch.bfloat16)
    base = kv_cache.clone()

    def chain() -> torch.Tensor:
        kv_cache.copy_(base)
        x = qkv0
        for _ in range(6):
            out = torch.empty((rows, hq, d), dtype=x.dtype, device=DEV)
            decode_attention_qkv(x, spec, kv_cache[0], kv_cache[1], out, md.query_start_loc, md.seq_lens,
                                 md.block_table, d ** -0.5, num_splits=8)
            x = torch.cat([out.view(rows, -1), qkv0[:, hq * d:]], dim=1)
        return x

    check_pdl_chain(chain, monkeypatch)
