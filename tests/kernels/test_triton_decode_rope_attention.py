"""Decode attention straight from qkv (tokenmill/kernels/triton_decode_rope_attention.py) vs the two kernels it
fuses: qk_norm_rope_store (norm, RoPE, K/V store) then decode_attention, on fresh random paged decode batches.

On the CPU the kernels run in Triton's interpreter (tests/kernels/conftest.py sets TRITON_INTERPRET=1)."""
from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from tests.kernels.kernel_check import DEV, rel_err  # noqa: E402
from tests.kernels.test_triton_attention import make_batch  # noqa: E402
from tokenmill.kernels.triton_decode_attention import decode_attention  # noqa: E402
from tokenmill.kernels.triton_decode_rope_attention import decode_rope_attention  # noqa: E402
from tokenmill.kernels.triton_qk_norm_rope_store import qk_norm_rope_store  # noqa: E402
from tokenmill.layers.rotary import RotaryEmbedding  # noqa: E402

TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}

# (ctx lens, hq, hkv, d, rotary dim, neox, q/k norm, dtype, splits, padding rows)
CASES = [
    ([37, 5, 64], 4, 2, 64, 64, True, True, torch.float32, 4, 2),
    ([0, 15, 16, 70], 8, 2, 128, 128, True, False, torch.float16, 1, 0),   # bf16 dots: garbage interpreted
    ([20, 47], 4, 4, 64, 32, False, True, torch.float16, 2, 1),
    ([90], 4, 1, 128, 128, True, True, torch.float32, 8, 0),
    ([130, 64, 63], 4, 2, 64, 64, True, True, torch.float32, 2, 0),      # the new key alone in its split, or last
]


@pytest.mark.parametrize("case", range(len(CASES)))
@torch.no_grad()
def test_matches_separate_kernels(case):
    ctx, hq, hkv, d, rot, neox, norm, dtype, splits, pad = CASES[case]
    bs = 16
    md, cache, _, _, _ = make_batch([1] * len(ctx), ctx, hq=hq, hkv=hkv, d=d, block_size=bs, dtype=dtype,
                                    seed=50 + case, pad_rows=pad)
    g = torch.Generator().manual_seed(case)
    rows = len(ctx) + pad
    qkv = (torch.randn(rows, (hq + 2 * hkv) * d, generator=g) * 2).to(DEV, dtype)
    positions = (md.seq_lens.long() - 1).clamp_min(0)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, rot, 2).float() / rot))
    rope = RotaryEmbedding(inv_freq, d, rot, 4096, scaling=1.0, is_neox_style=neox).to(DEV)
    qw = kw = None
    if norm:
        qw, kw = (torch.randn(d, generator=g) + 1).to(DEV, dtype), (torch.randn(d, generator=g) + 1).to(DEV, dtype)
    kw_args = dict(num_heads=hq, num_kv_heads=hkv, head_dim=d, rotary_dim=rot, is_neox=neox,
                   q_norm_weight=qw, k_norm_weight=kw, eps=1e-6)

    ref_cache = cache.clone()
    q = qk_norm_rope_store(qkv, positions, md.slot_mapping, ref_cache, rope.cos_cache, rope.sin_cache, **kw_args)
    ref = torch.empty(rows, hq, d, dtype=dtype, device=DEV)
    decode_attention(q.view(rows, hq, d), ref_cache[0], ref_cache[1], ref, md.query_start_loc, md.seq_lens,
                     md.block_table, d ** -0.5, num_splits=splits)

    got_cache = cache.clone()
    out = decode_rope_attention(qkv, positions, md.slot_mapping, got_cache, rope.cos_cache, rope.sin_cache,
                                md.query_start_loc, md.seq_lens, md.block_table, scale=d ** -0.5,
                                num_splits=splits, **kw_args)
    n = len(ctx)
    assert torch.equal(got_cache[1], ref_cache[1]), "V store differs"
    assert rel_err(got_cache[0], ref_cache[0]) < TOL[dtype] / 10, "K store differs"
    assert rel_err(out[:n].view(n, hq, d), ref[:n]) < TOL[dtype]
    if pad:
        assert torch.equal(out[n:], torch.zeros_like(out[n:])), "padding rows must be zeros"


def test_rejects_bad_inputs():
    md, cache, _, _, _ = make_batch([1], [3], hq=4, hkv=2, d=64, block_size=16, dtype=torch.float32, seed=1)
    qkv = torch.zeros(1, 8 * 64, device=DEV)
    rope = RotaryEmbedding(torch.ones(32), 64, 64, 16, scaling=1.0).to(DEV)
    args = (qkv, torch.zeros(1, dtype=torch.long, device=DEV), md.slot_mapping, cache, rope.cos_cache,
            rope.sin_cache, md.query_start_loc, md.seq_lens, md.block_table)
    with pytest.raises(ValueError, match="rotary_dim"):
        decode_rope_attention(*args, num_heads=4, num_kv_heads=2, head_dim=64, scale=1.0, num_splits=1,
                              rotary_dim=63)
    with pytest.raises(ValueError, match="kv_cache"):
        decode_rope_attention(*args[:3], cache.half(), *args[4:], num_heads=4, num_kv_heads=2, head_dim=64,
                              scale=1.0, num_splits=1)


@pytest.mark.gpu
@pytest.mark.parametrize("case", [
    ([0, 5, 63, 64, 65, 700, 1500, 2047, 300], 16, 8, 128, 128, True, True, torch.bfloat16, 8, 3),
    ([1, 200, 1000], 32, 8, 128, 128, True, False, torch.bfloat16, 8, 1),
    ([77, 513], 16, 8, 64, 64, False, True, torch.float16, 1, 2),
])
@torch.no_grad()
def test_matches_separate_kernels_gpu(case):
    """Compiled, at the benchmark models' head shapes (Qwen3-0.6B 16/8, Llama-3-8B 32/8) with long contexts."""
    CASES.append(case)
    try:
        test_matches_separate_kernels(len(CASES) - 1)
    finally:
        CASES.pop()
