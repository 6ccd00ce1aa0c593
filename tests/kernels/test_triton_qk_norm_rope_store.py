"""Fused q/k RMSNorm + RoPE + paged KV store (tokenmill/kernels/triton_qk_norm_rope_store.py) vs the torch code of
the layers it replaces (RMSNorm._norm, RotaryEmbedding._rotate, a slot-by-slot cache write).

On the CPU the kernel runs in Triton's interpreter (tests/kernels/conftest.py sets TRITON_INTERPRET=1)."""
from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from tests.kernels.kernel_check import DEV, INTERPRETED, rel_err  # noqa: E402
from tokenmill.kernels.triton_qk_norm_rope_store import qk_norm_rope_store  # noqa: E402
from tokenmill.layers.layernorm import RMSNorm  # noqa: E402
from tokenmill.layers.rotary import RotaryEmbedding  # noqa: E402

# Compiled, the kernel rounds where torch rounds (near bit-exact); the interpreter truncates fp32 -> bf16.
TOL = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 2e-2 if INTERPRETED else 4e-3}


@torch.no_grad()
def _case(t, hq, hkv, d, rot, *, is_neox=True, norm=True, dtype=torch.bfloat16, seed=0, bs=16, skip=(),
          in_place=False, write_k=False, pad_rows=0, max_pos=512):
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(DEV, dtype)

    rows = t + pad_rows
    qkv = rand(rows, (hq + 2 * hkv) * d, scale=2.0)
    positions = torch.randint(0, max_pos, (rows,), generator=gen).to(DEV)
    nb = (t + bs - 1) // bs + 3
    slots = torch.randperm(nb * bs, generator=gen)[:rows]
    for i in skip:
        slots[i] = -1
    slots = slots.to(DEV)
    cache = rand(2, nb, bs, hkv, d)                       # random, not zeros: untouched slots must stay as they were
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, rot, 2).float() / rot))
    rope = RotaryEmbedding(inv_freq, d, rot, max_pos, scaling=1.0, is_neox_style=is_neox).to(DEV)
    qn, kn = RMSNorm(d, eps=1e-6).to(DEV), RMSNorm(d, eps=1e-6).to(DEV)
    qn.weight.data, kn.weight.data = rand(d), rand(d)

    # Reference: the torch code paths of the layers the kernel replaces.
    q, k, v = qkv[:t].split([hq * d, hkv * d, hkv * d], dim=-1)
    if norm:
        q = qn._norm(q.reshape(t, hq, d)).reshape(t, hq * d)
        k = kn._norm(k.reshape(t, hkv, d)).reshape(t, hkv * d)
    cos = rope.cos_cache[positions[:t]].to(dtype)[:, None, :]
    sin = rope.sin_cache[positions[:t]].to(dtype)[:, None, :]
    ref_q, ref_k = rope._rotate(q, cos, sin), rope._rotate(k, cos, sin)
    ref_cache = cache.clone()
    written = torch.zeros(2, nb, bs, dtype=torch.bool, device=DEV)
    for i in range(t):
        s = int(slots[i])
        if s >= 0:
            ref_cache[0, s // bs, s % bs] = ref_k[i].view(hkv, d)
            ref_cache[1, s // bs, s % bs] = v[i].view(hkv, d)
            written[:, s // bs, s % bs] = True

    qkv_in = qkv.clone()
    q_out = qkv_in[:, :hq * d] if in_place else None
    k_out = qkv_in[:, hq * d:(hq + hkv) * d] if write_k else None
    out = qk_norm_rope_store(qkv_in, positions, slots, cache, rope.cos_cache, rope.sin_cache, num_heads=hq,
                             num_kv_heads=hkv, head_dim=d, rotary_dim=rot, is_neox=is_neox,
                             q_norm_weight=qn.weight.data if norm else None,
                             k_norm_weight=kn.weight.data if norm else None, eps=1e-6, q_out=q_out, k_out=k_out,
                             num_tokens=t if pad_rows else None)
    if in_place:
        assert out is q_out
    tol = TOL[dtype]
    assert rel_err(out[:t], ref_q) < tol
    if write_k:
        assert rel_err(k_out[:t], ref_k) < tol
    else:
        assert torch.equal(qkv_in[:, hq * d:], qkv[:, hq * d:]), "k and v of qkv are left alone without k_out"
    assert torch.equal(cache[~written], ref_cache[~written]), "slots not in slot_mapping (or -1) are untouched"
    assert torch.equal(cache[1][written[1]], ref_cache[1][written[1]]), "v is copied bit for bit"
    if written[0].any():
        assert rel_err(cache[0][written[0]], ref_cache[0][written[0]]) < tol
    if rot < d and not norm:                       # pass-through dims are copied bit for bit
        assert torch.equal(out[:t].view(t, hq, d)[..., rot:], ref_q.view(t, hq, d)[..., rot:])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("is_neox", [True, False])
def test_gqa_with_norm(dtype, is_neox):
    _case(5, 4, 2, 64, 64, is_neox=is_neox, dtype=dtype, seed=1, skip=(2,))


@pytest.mark.parametrize("is_neox", [True, False])
def test_partial_rotary_head128(is_neox):
    _case(3, 6, 2, 128, 64, is_neox=is_neox, dtype=torch.float32, seed=2)
    _case(3, 2, 1, 128, 32, is_neox=is_neox, norm=False, dtype=torch.float16, seed=3, skip=(0,))


def test_odd_head_dim_and_odd_half():
    _case(4, 3, 3, 96, 48, dtype=torch.float32, seed=4, bs=8)          # head 96 and half 24: masked lanes
    _case(2, 5, 1, 80, 80, dtype=torch.bfloat16, seed=5)


def test_in_place_q_k_out_and_padded_rows():
    _case(4, 4, 2, 64, 64, dtype=torch.float16, seed=6, in_place=True, write_k=True, pad_rows=3, skip=(1, 3))


def test_all_slots_skipped_still_writes_q():
    _case(3, 2, 2, 64, 64, dtype=torch.float32, seed=7, skip=(0, 1, 2))


def test_rejects_bad_arguments():
    qkv = torch.zeros(2, 4 * 64, device=DEV)
    cache = torch.zeros(2, 4, 16, 1, 64, device=DEV)
    pos = torch.zeros(2, dtype=torch.long, device=DEV)
    cs = torch.zeros(64, 32, device=DEV)
    kw = dict(num_heads=2, num_kv_heads=1, head_dim=64)
    with pytest.raises(ValueError, match="rotary_dim"):
        qk_norm_rope_store(qkv, pos, pos, cache, cs, cs, rotary_dim=63, **kw)
    with pytest.raises(ValueError, match="both"):
        qk_norm_rope_store(qkv, pos, pos, cache, cs, cs, q_norm_weight=torch.ones(64, device=DEV), **kw)
    with pytest.raises(ValueError, match="qkv"):
        qk_norm_rope_store(qkv[:, :200], pos, pos, cache, cs, cs, **kw)
    with pytest.raises(ValueError, match="kv_cache"):
        qk_norm_rope_store(qkv, pos, pos, cache[:, :, :, :, :32], cs, cs, **kw)
    with pytest.raises(ValueError, match="cos/sin"):
        qk_norm_rope_store(qkv, pos, pos, cache, cs, cs, rotary_dim=32, **kw)
    with pytest.raises(ValueError, match="num_tokens"):
        qk_norm_rope_store(qkv, pos[:1], pos, cache, cs, cs, **kw)


# ------------------------------------------------------------------------------------------------------------ GPU
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_qk_norm_rope_store_gpu(dtype):
    for t in (1, 7, 256):
        _case(t, 16, 8, 128, 128, dtype=dtype, seed=100 + t, skip=(0,), max_pos=8192)               # Qwen3-0.6B
        _case(t, 32, 8, 128, 128, norm=False, dtype=dtype, seed=200 + t, max_pos=8192)             # Llama-3-8B
        _case(t, 14, 2, 64, 64, is_neox=False, dtype=dtype, seed=300 + t, in_place=True, write_k=True)
        _case(t, 8, 4, 256, 64, dtype=dtype, seed=400 + t, bs=32)
    _case(2048, 16, 8, 128, 128, dtype=dtype, seed=500, max_pos=8192)
