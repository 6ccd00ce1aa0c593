"""Triton RMSNorm (+residual), rotary embedding and SiLU-and-mul vs the plain-torch layers in tokenmill/layers.

On the CPU the kernels run in Triton's interpreter (tests/kernels/conftest.py sets TRITON_INTERPRET=1)."""
from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from tests.kernels.kernel_check import DEV, INTERPRETED, rel_err  # noqa: E402
from tokenmill.kernels.triton_norm_rope_act import rms_norm, rotary_embedding, silu_and_mul  # noqa: E402
from tokenmill.layers.activation import SiluAndMul  # noqa: E402
from tokenmill.layers.layernorm import RMSNorm  # noqa: E402
from tokenmill.layers.rotary import RotaryEmbedding  # noqa: E402

# Triton 3.9's interpreter converts fp32 -> bf16 by truncation (the GPU rounds to nearest even), so under the
# interpreter bf16 results carry a one-sided ~1-ulp bias per rounding and get the usual loose bf16 bound; compiled
# on the GPU the kernels round where torch rounds and land far below it.
TOL = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 2e-2 if INTERPRETED else 4e-3}
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _rand(*shape, dtype, seed, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(DEV, dtype)


# ------------------------------------------------------------------------------------------------------- RMSNorm
def _check_rms(m, n, dtype, seed, residual, inplace=False):
    x = _rand(m, n, dtype=dtype, seed=seed, scale=3.0)
    w = _rand(n, dtype=dtype, seed=seed + 1)
    layer = RMSNorm(n, eps=1e-5).to(DEV)
    layer.weight.data = w.clone()
    if residual:
        r = _rand(m, n, dtype=dtype, seed=seed + 2)
        ref_out, ref_res = layer(x, r)
        xx, rr = x.clone(), r.clone()
        out, res = rms_norm(xx, w, 1e-5, rr, inplace=inplace)
        if inplace:
            assert out is xx and res is rr
        else:
            assert torch.equal(xx, x) and torch.equal(rr, r), "inputs must be left alone"
        assert out.dtype == ref_out.dtype and res.dtype == ref_res.dtype
        if dtype != torch.bfloat16 or not INTERPRETED:
            assert torch.equal(res, ref_res), "the new residual is x + residual rounded like torch"
        assert rel_err(res, ref_res) < TOL[dtype]
        assert rel_err(out, ref_out) < TOL[dtype]
    else:
        ref_out = layer(x)
        out = rms_norm(x.clone() if inplace else x, w, 1e-5, inplace=inplace)
        assert out.dtype == ref_out.dtype and out.shape == ref_out.shape
        assert rel_err(out, ref_out) < TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("residual", [False, True])
def test_rms_norm(dtype, residual):
    _check_rms(5, 96, dtype, seed=1, residual=residual)          # 96: a non power-of-two hidden size (masked)


def test_rms_norm_inplace_and_fp32_weight():
    _check_rms(3, 64, torch.bfloat16, seed=3, residual=True, inplace=True)
    _check_rms(3, 64, torch.float16, seed=4, residual=False, inplace=True)
    # fp32 weight with bf16 activations: torch promotes `weight * x` to fp32; so must we.
    x = _rand(4, 32, dtype=torch.bfloat16, seed=5)
    layer = RMSNorm(32).to(DEV)
    layer.weight.data = _rand(32, dtype=torch.float32, seed=6)
    out = rms_norm(x, layer.weight.data, layer.eps)
    assert out.dtype == torch.float32
    assert rel_err(out, layer(x)) < TOL[torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("residual", [False, True])
def test_gemma_rms_norm(dtype, residual):
    """The (1 + w) form in fp32 with one rounding at the end, against GemmaRMSNorm's plain-torch arithmetic (the
    layer runs this kernel on CUDA), with the 3-D per-head shape of q / k norms too."""
    from tokenmill.models.gemma2 import GemmaRMSNorm
    for shape in ((5, 96), (2, 3, 48)):
        x = _rand(*shape, dtype=dtype, seed=11, scale=3.0)
        layer = GemmaRMSNorm(shape[-1], eps=1e-6).to(DEV, dtype)
        layer.weight.data = _rand(shape[-1], dtype=dtype, seed=12, scale=0.3)
        if residual:
            r = _rand(*shape, dtype=dtype, seed=13)
            out, res = rms_norm(x, layer.weight, 1e-6, r, gemma=True)
            if dtype != torch.bfloat16 or not INTERPRETED:  # the interpreter truncates to bf16
                assert torch.equal(res, x + r)
            assert rel_err(res, x + r) < TOL[dtype]
            ref = layer._norm(x + r)
        else:
            out, ref = rms_norm(x, layer.weight, 1e-6, gemma=True), layer._norm(x)
        assert out.dtype == dtype and out.shape == x.shape
        assert rel_err(out, ref) < TOL[dtype]


def test_rms_norm_3d_input():
    x = _rand(2, 3, 48, dtype=torch.float32, seed=7)
    w = _rand(48, dtype=torch.float32, seed=8)
    layer = RMSNorm(48, eps=1e-6).to(DEV)
    layer.weight.data = w
    assert rel_err(rms_norm(x, w, 1e-6), layer(x)) < 1e-5


# ------------------------------------------------------------------------------------------------------- rotary
def _check_rope(t, hq, hkv, head_dim, rotary_dim, is_neox, dtype, seed, max_pos=64, strided=False):
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, rotary_dim, 2).float() / rotary_dim))
    rope = RotaryEmbedding(inv_freq, head_dim, rotary_dim, max_pos, scaling=1.0, is_neox_style=is_neox).to(DEV)
    g = torch.Generator().manual_seed(seed)
    positions = torch.randint(0, max_pos, (t,), generator=g).to(DEV)
    if strided:   # q and k as views of one fused qkv projection output
        qkv = _rand(t, (hq + 2 * hkv) * head_dim, dtype=dtype, seed=seed + 1)
        q, k = qkv[:, :hq * head_dim], qkv[:, hq * head_dim:(hq + hkv) * head_dim]
    else:
        q = _rand(t, hq * head_dim, dtype=dtype, seed=seed + 1)
        k = _rand(t, hkv * head_dim, dtype=dtype, seed=seed + 2)
    ref_q, ref_k = rope(positions, q.clone(), k.clone())
    q2, k2 = rotary_embedding(positions, q, k, rope.cos_cache, rope.sin_cache, head_dim, rotary_dim, is_neox)
    assert q2 is q and k2 is k, "rotary_embedding works in place"
    assert rel_err(q, ref_q) < TOL[dtype] and rel_err(k, ref_k) < TOL[dtype]
    if rotary_dim < head_dim:   # the pass-through dims are bit-identical
        qh, rh = q.view(t, hq, head_dim), ref_q.view(t, hq, head_dim)
        assert torch.equal(qh[..., rotary_dim:], rh[..., rotary_dim:])


@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary(is_neox, dtype):
    _check_rope(7, 4, 2, 64, 64, is_neox, dtype, seed=10)


@pytest.mark.parametrize("is_neox", [True, False])
def test_rotary_partial_and_strided(is_neox):
    _check_rope(5, 3, 1, 32, 16, is_neox, torch.float32, seed=11, strided=True)     # partial rotary, GQA 3
    _check_rope(4, 2, 2, 96, 48, is_neox, torch.bfloat16, seed=12)                  # rot/2 = 24: masked lanes


# --------------------------------------------------------------------------------------------------- SiLU-and-mul
@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul(dtype):
    x = _rand(6, 2 * 80, dtype=dtype, seed=20, scale=3.0)
    ref = SiluAndMul()(x)
    out = silu_and_mul(x)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    assert rel_err(out, ref) < TOL[dtype]


def test_silu_and_mul_3d_and_out():
    x = _rand(2, 3, 2 * 40, dtype=torch.float32, seed=21)
    out = torch.full((2, 3, 40), float("nan"), device=DEV)
    assert silu_and_mul(x, out=out) is out
    assert rel_err(out, SiluAndMul()(x)) < 1e-5


# ------------------------------------------------------------------------------------------------------------ GPU
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fused_elementwise_gpu(dtype):
    for residual in (False, True):
        _check_rms(4096, 4096, dtype, seed=30, residual=residual)
        _check_rms(333, 5120, dtype, seed=31, residual=residual, inplace=True)
    for is_neox in (True, False):
        _check_rope(2048, 32, 8, 128, 128, is_neox, dtype, seed=32, max_pos=8192)
        _check_rope(1000, 16, 2, 128, 64, is_neox, dtype, seed=33, max_pos=4096, strided=True)
        _check_rope(517, 14, 2, 64, 64, is_neox, dtype, seed=34, max_pos=4096, strided=True)
    x = _rand(4096, 2 * 14336, dtype=dtype, seed=35, scale=3.0)
    assert rel_err(silu_and_mul(x), SiluAndMul()(x)) < TOL[dtype]
