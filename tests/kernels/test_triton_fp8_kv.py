"""Triton fp8 KV cache (store, prefill, decode) vs the torch reference backend reading the same fp8 cache.

The reference stores fp8(clamp(x / scale)) and reads float(fp8) * scale (kernels/kv_fp8.py) in float64; the
kernels must agree with it.

On the CPU the kernels run in Triton's interpreter (triton 3.9), which loads, stores and widens fp8 correctly but
rounds float -> fp8 wrongly: it rounds half-up on the mantissa without carrying into the exponent, so e.g. 1.99
becomes 1.0 instead of 2.0 (triton/runtime/interpreter.py `_convert_float`). The GPU does the cast in hardware
(round to nearest even). So on the CPU the store is checked with inputs that are exactly x = fp8 value * scale with
power-of-two scales (the cast then rounds nothing: indexing, masking, scaling and clamping are what is tested), and
the attention kernels are checked on caches filled by the reference with arbitrary scales. The `gpu` tests use fresh
random inputs and arbitrary scales throughout.
"""
from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from test_triton_attention import DEV, TOL, make_batch, real_rows, rel_err  # noqa: E402

from tokenmill.attention.backends.torch_ref import TorchRefBackend  # noqa: E402
from tokenmill.attention.backends.triton_attn import TritonAttentionBackend  # noqa: E402
from tokenmill.kernels.kv_fp8 import fp8_max, quantize  # noqa: E402
from tokenmill.kernels.triton_decode_attention import decode_attention  # noqa: E402
from tokenmill.kernels.triton_kv_store import store_kv  # noqa: E402
from tokenmill.kernels.triton_prefill_attention import prefill_attention  # noqa: E402

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
ON_GPU = DEV.type == "cuda"


def scalar(x: float) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.float32, device=DEV)


def fp8_cache(x, fp8, k_scale, v_scale):
    """An fp8 cache holding 3 * x [2, ...] as the reference stores it (so every byte is a valid value)."""
    return torch.stack([quantize(x[0].float() * 3, k_scale, fp8), quantize(x[1].float() * 3, v_scale, fp8)])


def random_cache(shape, fp8, k_scale, v_scale, seed):
    return fp8_cache(torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(DEV), fp8, k_scale, v_scale)


def representable(shape, fp8, scale, seed, dtype):
    """x with x / scale an exact fp8 value (scale a power of two), a few of them beyond the fp8 range (clamped)."""
    g = torch.Generator().manual_seed(seed)
    vals = (torch.randn(shape, generator=g) * 4).to(fp8).float()
    x = vals * scale
    flat = x.view(-1)
    flat[::17] = 3.0 * fp8_max(fp8) * scale * torch.sign(torch.randn(flat[::17].shape, generator=g))
    return x.to(DEV, dtype)


def reference(md, cache, q, k, v, hq, hkv, d, scale, k_scale, v_scale):
    """TorchRefBackend in float64 on a copy of the fp8 cache. Returns (out, cache after the store)."""
    cache = cache.clone()
    out = TorchRefBackend(hq, d, hkv, scale).forward(q.double(), k.double(), v.double(), cache, md, k_scale, v_scale)
    return out, cache


def assert_same_fp8(a: torch.Tensor, b: torch.Tensor, exact: bool) -> None:
    """Equal bytes; on the GPU a division rounded differently may move a rare value by one fp8 step."""
    if exact:
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), "fp8 cache differs"
        return
    diff = a.view(torch.int8).int() - b.view(torch.int8).int()     # adjacent fp8 values of one sign differ by 1
    assert diff.abs().max().item() <= 1, "fp8 cache differs by more than one step"
    assert (diff != 0).float().mean().item() < 1e-3, "fp8 cache differs in too many places"


# --------------------------------------------------------------------------------------------------- KV store
@pytest.mark.parametrize("fp8", FP8)
def test_store_kv_fp8_quantises_with_scales_and_skips_negative_slots(fp8):
    n, bs, h, d, t = 5, 8, 2, 32, 9
    k_scale, v_scale = scalar(0.25), scalar(8.0)
    cache = random_cache((2, n, bs, h, d), fp8, k_scale, v_scale, seed=1)
    before = cache.clone()
    slots = torch.randperm(n * bs, generator=torch.Generator().manual_seed(2))[:t].to(DEV)
    slots[[2, 5]] = -1
    k = representable((t, h, d), fp8, 0.25, seed=3, dtype=torch.float32)
    qkv = torch.cat([k.view(t, -1), k.view(t, -1),
                     representable((t, h * d), fp8, 8.0, seed=4, dtype=torch.float32)], dim=1)
    v = qkv[:, 2 * h * d:].view(t, h, d)                  # v as a strided view of a fused projection
    store_kv(k, v, cache, slots, k_scale, v_scale)
    exp = before.view(torch.uint8).clone().view(2, n * bs, h, d)
    keep = slots >= 0
    exp[0, slots[keep]] = quantize(k[keep], k_scale, fp8).view(torch.uint8)
    exp[1, slots[keep]] = quantize(v[keep], v_scale, fp8).view(torch.uint8)
    assert torch.equal(cache.view(torch.uint8), exp.view(cache.shape))
    # Out-of-range inputs were clamped to the largest finite value, not turned into NaN / inf.
    assert cache.float().isfinite().all()
    assert (cache[0].float().abs() == fp8_max(fp8)).any()


def test_store_kv_fp8_needs_scales():
    cache = torch.zeros(2, 2, 4, 1, 16, dtype=torch.float8_e4m3fn, device=DEV)
    k = torch.zeros(1, 16, device=DEV)
    with pytest.raises(ValueError, match="k_scale and v_scale"):
        store_kv(k, k, cache, torch.zeros(1, dtype=torch.long, device=DEV))


# --------------------------------------------------------------------------------- attention kernels, fp8 read
# (query_lens, ctx_lens, hq, hkv, d, block_size, fp8)
KERNEL_CASES = [
    ([3, 1, 17, 1, 33], [0, 9, 5, 0, 14], 2, 2, 64, 16, torch.float8_e4m3fn),    # GQA 1
    ([17, 1, 3], [16, 31, 7], 4, 2, 64, 8, torch.float8_e5m2),                  # GQA 2, block 8
    ([1, 33, 3], [40, 0, 23], 4, 1, 128, 16, torch.float8_e4m3fn),               # GQA 4, D 128
    ([1, 9, 1], [33, 8, 70], 8, 2, 32, 8, torch.float8_e5m2),                    # D 32
]


def both_kernels_err(md, cache, q, k, v, hq, hkv, d, scale, k_scale, v_scale) -> float:
    """Relative error against the float64 reference of the prefill kernel's rows (query_len > 1) and the split
    decode kernel's (query_len 1), both reading the fp8 cache the reference filled, in q's dtype."""
    ref_out, ref_cache = reference(md, cache, q, k, v, hq, hkv, d, scale, k_scale, v_scale)
    t = md.num_actual_tokens
    out = torch.full((t, hq, d), float("nan"), dtype=q.dtype, device=DEV)
    qv = q.view(t, hq, d)
    prefill_attention(qv, ref_cache[0], ref_cache[1], out, md.query_start_loc, md.seq_lens, md.block_table, scale,
                      num_tokens=t, skip_single=True, k_scale=k_scale, v_scale=v_scale)
    decode_attention(qv, ref_cache[0], ref_cache[1], out, md.query_start_loc, md.seq_lens, md.block_table, scale,
                     num_splits=2, block_n=16, k_scale=k_scale, v_scale=v_scale)
    return rel_err(out.view(t, -1), ref_out)


@pytest.mark.parametrize("case", range(len(KERNEL_CASES)))
def test_prefill_and_decode_kernels_read_fp8_with_scales(case):
    """Both kernels on a cache the reference filled (arbitrary scales): prefill rows from the prefill kernel,
    query_len-1 rows from the split decode kernel, each against the float64 reference over the dequantised cache."""
    ql, ctx, hq, hkv, d, bs, fp8 = KERNEL_CASES[case]
    md, base, q, k, v = make_batch(ql, ctx, hq=hq, hkv=hkv, d=d, block_size=bs, dtype=torch.float32,
                                   seed=500 + case)
    k_scale, v_scale = scalar(0.37), scalar(2.9)
    cache = fp8_cache(base, fp8, k_scale, v_scale)
    scale = d ** -0.5
    assert both_kernels_err(md, cache, q, k, v, hq, hkv, d, scale, k_scale, v_scale) < TOL[torch.float32]


@pytest.mark.parametrize("fp8", FP8)
def test_kernels_dot_fp8_in_fp16_for_16_bit_queries(fp8):
    """bf16 queries with an fp8 cache take the fp16 dots (q pre-scaled, K/V widened to fp16): both kernels against
    the float64 reference, with queries beyond fp16's range before the scale is applied."""
    ql, ctx, hq, hkv, d, bs = [5, 1, 1], [11, 40, 3], 8, 2, 64, 16
    md, base, q, k, v = make_batch(ql, ctx, hq=hq, hkv=hkv, d=d, block_size=bs, dtype=torch.bfloat16, seed=77)
    q = q * 2e4                     # some |q| above 65504, fp16's largest value
    k_scale, v_scale = scalar(0.8), scalar(1.9)
    cache = fp8_cache(base, fp8, k_scale, v_scale)
    scale = 2e-5
    assert both_kernels_err(md, cache, q, k, v, hq, hkv, d, scale, k_scale, v_scale) < TOL[torch.bfloat16]


def test_scales_change_the_result():
    """Guards against a kernel ignoring a scale: the same bytes read with other scales give other outputs."""
    ql, ctx, hq, hkv, d, bs = [1, 5], [20, 3], 4, 2, 32, 8
    md, base, q, k, v = make_batch(ql, ctx, hq=hq, hkv=hkv, d=d, block_size=bs, dtype=torch.float32, seed=9)
    fp8 = torch.float8_e4m3fn
    cache = fp8_cache(base, fp8, scalar(1.0), scalar(1.0))
    t = md.num_actual_tokens
    outs = []
    for ks, vs in ((1.0, 1.0), (0.5, 1.0), (1.0, 0.5)):
        out = torch.zeros((t, hq, d), device=DEV)
        args = (q.view(t, hq, d), cache[0], cache[1], out, md.query_start_loc, md.seq_lens, md.block_table, 0.2)
        prefill_attention(*args, num_tokens=t, skip_single=True, k_scale=scalar(ks), v_scale=scalar(vs))
        decode_attention(*args, k_scale=scalar(ks), v_scale=scalar(vs))
        outs.append(out)
    assert not torch.allclose(outs[0], outs[1], rtol=1e-3, atol=1e-3)       # k_scale sharpens / flattens softmax
    assert torch.allclose(outs[2], outs[0] * 0.5, rtol=1e-5, atol=1e-6)     # v_scale scales the output linearly


# ------------------------------------------------------------------------------------------- backend end to end
def check_fp8_backend(query_lens, ctx_lens, *, hq, hkv, d, block_size, dtype, fp8, scales, seed, pad_rows=0,
                      splits=None, exact_inputs):
    md, base, q, k, v = make_batch(query_lens, ctx_lens, hq=hq, hkv=hkv, d=d, block_size=block_size, dtype=dtype,
                                   seed=seed, pad_rows=pad_rows)
    k_scale, v_scale = scalar(scales[0]), scalar(scales[1])
    cache = fp8_cache(base, fp8, k_scale, v_scale)
    if exact_inputs:
        k = representable(k.shape, fp8, scales[0], seed + 2, dtype)
        v = representable(v.shape, fp8, scales[1], seed + 3, dtype)
    scale = d ** -0.5
    ref_md = real_rows(md, len(query_lens)) if pad_rows else md
    ref_out, ref_cache = reference(ref_md, cache, q, k, v, hq, hkv, d, scale, k_scale, v_scale)
    be = TritonAttentionBackend(hq, d, hkv, scale)
    be.decode_num_splits = splits
    out = be.forward(q, k, v, cache, md, k_scale, v_scale)
    assert_same_fp8(cache, ref_cache, exact=exact_inputs)
    real_t = int(md.query_start_loc_cpu[len(query_lens)])
    err = rel_err(out[:real_t], ref_out[:real_t])
    assert err < TOL[dtype], f"rel err {err:.2e}"
    if pad_rows:
        assert torch.equal(out[real_t:], torch.zeros_like(out[real_t:])), "padding rows must be zeros"


@pytest.mark.parametrize("fp8", FP8)
def test_backend_fp8_mixed_batch(fp8):
    check_fp8_backend([3, 1, 17, 1], [0, 9, 5, 20], hq=4, hkv=2, d=64, block_size=16, dtype=torch.float32, fp8=fp8,
                      scales=(0.5, 4.0), seed=700, exact_inputs=not ON_GPU)


def test_backend_fp8_pure_decode_split_and_padding():
    check_fp8_backend([1, 1, 1], [37, 5, 64], hq=4, hkv=1, d=32, block_size=16, dtype=torch.float32,
                      fp8=torch.float8_e4m3fn, scales=(2.0, 0.125), seed=710, pad_rows=2, splits=4,
                      exact_inputs=not ON_GPU)


# ------------------------------------------------------------------------------------------------------------ GPU
GPU_CASES = [
    # (query_lens, ctx_lens, hq, hkv, d, block_size, dtype, splits)
    ([1, 3, 17, 33, 1, 200, 1], [0, 100, 17, 250, 1000, 0, 4095], 32, 8, 128, 16, torch.bfloat16, None),
    ([1, 3, 17, 33, 1, 129], [77, 100, 17, 250, 3000, 64], 16, 16, 64, 16, torch.bfloat16, None),
    ([512, 1, 1], [1024, 2000, 9], 28, 4, 128, 16, torch.float16, None),               # G = 7
    ([1] * 64, [i * 37 % 3000 for i in range(64)], 32, 8, 128, 16, torch.bfloat16, 8),
    ([1] * 5, [8191, 100, 4000, 1, 0], 16, 2, 64, 16, torch.float16, 16),
    ([40, 1, 7], [30, 600, 0], 12, 4, 64, 32, torch.bfloat16, None),
]


@pytest.mark.gpu
@pytest.mark.parametrize("fp8", FP8, ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("case", range(len(GPU_CASES)))
def test_backend_fp8_gpu(case, fp8):
    ql, ctx, hq, hkv, d, bs, dtype, splits = GPU_CASES[case]
    for seed, scales in enumerate(((0.037, 0.051), (1.0, 1.0), (3.7, 0.6))):
        check_fp8_backend(ql, ctx, hq=hq, hkv=hkv, d=d, block_size=bs, dtype=dtype, fp8=fp8, scales=scales,
                          seed=2000 * case + 10 * seed, splits=splits,
                          pad_rows=3 if all(x == 1 for x in ql) else 0, exact_inputs=False)


@pytest.mark.gpu
@pytest.mark.parametrize("fp8", FP8, ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_store_kv_fp8_gpu(fp8, dtype):
    n, bs, h, d, t = 300, 16, 8, 128, 1000
    k_scale, v_scale = scalar(0.023), scalar(1.7)
    cache = random_cache((2, n, bs, h, d), fp8, k_scale, v_scale, seed=3)
    before = cache.clone()
    slots = torch.randperm(n * bs, device=DEV)[:t]
    slots[::7] = -1
    k = (torch.randn(t, h, d, device=DEV) * 4).to(dtype)
    v = (torch.randn(t, h, d, device=DEV) * 4).to(dtype)
    k[0, 0, :4] = torch.tensor([1e4, -1e4, 0.0, 1e-6])                    # clamped, clamped, zero, subnormal
    store_kv(k, v, cache, slots, k_scale, v_scale)
    exp = before.clone().view(2, n * bs, h, d)
    keep = slots >= 0
    exp.view(torch.uint8)[0, slots[keep]] = quantize(k[keep], k_scale, fp8).view(torch.uint8)
    exp.view(torch.uint8)[1, slots[keep]] = quantize(v[keep], v_scale, fp8).view(torch.uint8)
    assert_same_fp8(cache, exp.view_as(cache), exact=False)
    assert cache.float().isfinite().all()
