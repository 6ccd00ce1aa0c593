"""The fp8 KV scheme in the torch reference backend (CPU): stored bytes, clamping, and attention over an fp8 cache
equal to attention over a float cache holding the dequantised values."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from tokenmill.attention.backend import AttentionMetadata
from tokenmill.attention.backends.torch_ref import TorchRefBackend, write_kv
from tokenmill.kernels.kv_fp8 import dequantize, fp8_max, quantize

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]


@pytest.mark.parametrize("fp8", FP8)
def test_write_kv_stores_x_over_scale_and_clamps(fp8):
    ks, vs = torch.tensor(0.3), torch.tensor(7.0)
    cache = torch.zeros(2, 3, 4, 2, 8, dtype=fp8)
    k = torch.randn(5, 2, 8) * 3
    v = torch.randn(5, 2, 8) * 3
    k[0, 0, 0] = 1e6                                   # far beyond fp8 range once divided by the scale
    slots = torch.tensor([0, 5, 6, 11, 2])
    write_kv(cache, k, v, slots, ks, vs)
    flat = cache.view(2, -1, 2, 8)
    assert torch.equal(flat[0, slots].float(), (k / ks).clamp(-fp8_max(fp8), fp8_max(fp8)).to(fp8).float())
    assert torch.equal(flat[1, slots].float(), (v / vs).to(fp8).float())
    assert flat[0, 0, 0, 0].float().item() == fp8_max(fp8)
    # Read back: fp8 * scale, within half an fp8 step of the input (3 / 2 mantissa bits).
    back = dequantize(flat[1, slots], vs, torch.float32)
    rel = 2.0 ** -4 if fp8 == torch.float8_e4m3fn else 2.0 ** -3
    big = v.abs() > 0.2                                # v / 7 stays clear of the subnormal range
    assert ((back - v).abs()[big] <= rel * v.abs()[big] + 1e-7).all()


def test_write_kv_fp8_needs_scales():
    with pytest.raises(ValueError, match="k_scale and v_scale"):
        write_kv(torch.zeros(2, 1, 4, 1, 8, dtype=torch.float8_e4m3fn), torch.zeros(1, 1, 8), torch.zeros(1, 1, 8),
                 torch.tensor([0]))


def _metadata(query_lens, ctx_lens, block_size, num_blocks, g):
    seq = [c + q for c, q in zip(ctx_lens, query_lens)]
    nb = max(-(-s // block_size) for s in seq)
    table = torch.randperm(num_blocks, generator=g)[:len(seq) * nb].view(len(seq), nb).to(torch.int32)
    slots = [int(table[b, p // block_size]) * block_size + p % block_size
             for b, (c, q) in enumerate(zip(ctx_lens, query_lens)) for p in range(c, c + q)]
    qsl = np.concatenate([[0], np.cumsum(query_lens)])
    return AttentionMetadata(len(slots), torch.tensor(slots), torch.tensor(qsl, dtype=torch.int32),
                             torch.tensor(seq, dtype=torch.int32), table, max(query_lens), max(seq), qsl,
                             np.array(seq))


@pytest.mark.parametrize("fp8", FP8)
def test_reference_over_fp8_equals_reference_over_dequantised_cache(fp8):
    """Prefill, chunked and decode rows (GQA 2): the fp8 path must be exactly "dequantise, then attend"."""
    g = torch.Generator().manual_seed(0)
    hq, hkv, d, bs, n = 4, 2, 16, 4, 24
    md = _metadata([5, 1, 3, 1], [0, 7, 6, 13], bs, n, g)
    ks, vs = torch.tensor(0.21), torch.tensor(1.7)
    cache8 = torch.stack([quantize(torch.randn(n, bs, hkv, d, generator=g), s, fp8) for s in (ks, vs)])
    q = torch.randn(md.num_actual_tokens, hq * d, generator=g)
    k = torch.randn(md.num_actual_tokens, hkv * d, generator=g)
    v = torch.randn(md.num_actual_tokens, hkv * d, generator=g)
    ref = TorchRefBackend(hq, d, hkv, 0.25)
    out8 = ref.forward(q, k, v, cache8, md, ks, vs)
    # The float cache sees the same contents: old entries dequantised, new K/V quantised and dequantised.
    cache32 = torch.stack([dequantize(cache8[0], ks, torch.float32), dequantize(cache8[1], vs, torch.float32)])
    kq = dequantize(quantize(k, ks, fp8), ks, torch.float32)
    vq = dequantize(quantize(v, vs, fp8), vs, torch.float32)
    out32 = ref.forward(q, kq, vq, cache32, md)
    assert torch.equal(out8, out32)
    assert torch.equal(dequantize(cache8[0], ks, torch.float32), cache32[0])   # the store wrote the same values
