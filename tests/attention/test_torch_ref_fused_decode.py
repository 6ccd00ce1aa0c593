"""The CPU backend's fused decode from the qkv output (TorchRefBackend.forward_decode_qkv) against the unfused
path (rotary_emb, then forward): the same cache contents and attention outputs, and None where it does not apply."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from tokenmill.attention.backend import AttentionMetadata
from tokenmill.attention.backends.torch_ref import TorchRefBackend, write_kv
from tokenmill.layers.rotary import RotaryEmbedding


def _decode_metadata(ctx_lens, block_size, num_blocks, g):
    seq = [c + 1 for c in ctx_lens]
    nb = max(-(-s // block_size) for s in seq)
    table = torch.randperm(num_blocks, generator=g)[:len(seq) * nb].view(len(seq), nb).to(torch.int32)
    slots = [int(table[b, c // block_size]) * block_size + c % block_size for b, c in enumerate(ctx_lens)]
    qsl = np.arange(len(seq) + 1)
    return AttentionMetadata(len(slots), torch.tensor(slots), torch.tensor(qsl, dtype=torch.int32),
                             torch.tensor(seq, dtype=torch.int32), table, 1, max(seq), qsl, np.array(seq))


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("ctx_lens", [[13], [7], [0, 5, 16, 9]])
@pytest.mark.parametrize("heads", [(4, 2), (3, 3)])
def test_fused_decode_equals_rotary_then_forward(ctx_lens, heads, cache_dtype):
    g = torch.Generator().manual_seed(len(ctx_lens) + heads[0])
    hq, hkv = heads
    d, bs, n = 16, 4, 24
    inv_freq = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    rope = RotaryEmbedding(inv_freq, d, d, 64)
    be = TorchRefBackend(hq, d, hkv, d ** -0.5)
    md = _decode_metadata(ctx_lens, bs, n, g)
    t = len(ctx_lens)
    positions = torch.tensor(ctx_lens)
    qkv = torch.randn(t, (hq + 2 * hkv) * d, generator=g)
    cache = torch.randn(2, n, bs, hkv, d, generator=g)
    ref_cache, fused_cache = cache.to(cache_dtype), cache.to(cache_dtype)
    fp32_cache = ref_cache.float()    # the same history, attended to in fp32 by the general decode path

    q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
    q, k = rope(positions, q, k)
    want = be.forward(q, k, v.contiguous(), ref_cache, md)

    rope._rows = rope._full = None   # the fused path builds its own tables for the same positions
    got = be.forward_decode_qkv(qkv, positions, rope, None, None, fused_cache, _decode_metadata(ctx_lens, bs, n,
                                torch.Generator().manual_seed(len(ctx_lens) + heads[0])))
    assert got is not None and got.dtype == torch.float32
    assert torch.equal(fused_cache, ref_cache)      # the same rotated K and the same V in the same slots
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    if cache_dtype == torch.bfloat16:
        # bf16 attention (q rounded too) against fp32 attention over fp32 K/V: within bf16's rounding
        write_kv(fp32_cache, k.view(t, hkv, d), v.view(t, hkv, d), md.slot_mapping)
        exact = torch.empty_like(q).view(t, hq, d)
        be._decode(q.view(t, hq, d), fp32_cache, md, np.arange(t), exact, (None, None))
        assert not torch.equal(got, exact.view(t, -1))
        torch.testing.assert_close(got, exact.view(t, -1), rtol=0, atol=3e-2)


def test_fused_decode_declines_what_it_does_not_cover():
    g = torch.Generator().manual_seed(0)
    d, bs, n = 16, 4, 8
    rope = RotaryEmbedding(1.0 / (10000 ** (torch.arange(0, d, 2).float() / d)), d, d, 64)
    md = _decode_metadata([5], bs, n, g)
    qkv = torch.randn(1, 4 * d)
    cache = torch.zeros(2, n, bs, 1, d)
    assert TorchRefBackend(2, d, 1, 0.25, sliding_window=4).forward_decode_qkv(
        qkv, torch.tensor([5]), rope, None, None, cache, md) is None
    assert TorchRefBackend(2, d, 1, 0.25, logits_soft_cap=30.0).forward_decode_qkv(
        qkv, torch.tensor([5]), rope, None, None, cache, md) is None
    assert TorchRefBackend(2, d, 1, 0.25).forward_decode_qkv(
        qkv, torch.tensor([5]), rope, object(), object(), cache, md) is None   # per-head q/k norms
    partial = RotaryEmbedding(1.0 / (10000 ** (torch.arange(0, d // 2, 2).float() / (d // 2))), d, d // 2, 64)
    assert TorchRefBackend(2, d, 1, 0.25).forward_decode_qkv(
        qkv, torch.tensor([5]), partial, None, None, cache, md) is None
    md.max_query_len = 2   # a prefill in the step
    assert TorchRefBackend(2, d, 1, 0.25).forward_decode_qkv(
        qkv, torch.tensor([5]), rope, None, None, cache, md) is None
    assert torch.equal(cache, torch.zeros_like(cache))   # nothing written when declining


def test_rotate_heads_is_the_halves_rotation_bit_for_bit():
    g = torch.Generator().manual_seed(1)
    d = 16
    rope = RotaryEmbedding(1.0 / (10000 ** (torch.arange(0, d, 2).float() / d)), d, d, 64)
    x = torch.randn(5, 3, d, generator=g)
    positions = torch.tensor([0, 3, 9, 40, 63])
    cos, sin = rope._cos_sin(positions, torch.float32)
    x1, x2 = x[..., :d // 2], x[..., d // 2:]
    want = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    assert torch.equal(rope.rotate_heads(x, cos, sin), want)
