"""FP8 decode products: the rows' quantization (kernels/triton_fp8_act.py) against the scheme's torch definition
(layers/quantization/fp8.quantize_activation), and gemv's fp8 x fp8 form against float64. On the CPU the kernels
run in Triton's interpreter; the `gpu` test runs the compiled ones through an FP8 layer at an 8B shape."""
from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from tests.kernels.kernel_check import DEV, compile_for_sm90  # noqa: E402
from tokenmill.kernels.gemv_config import GemvConfig, fp8_dot_config  # noqa: E402
from tokenmill.kernels.triton_fp8_act import quantize_rows_fp8  # noqa: E402
from tokenmill.kernels.triton_gemv import gemv  # noqa: E402
from tokenmill.layers.quantization.fp8 import quantize_activation, quantize_rows  # noqa: E402


def _rows(m, k, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * 3
    x[0, 5] = 6.0e4            # an outlier: much of row 0 lands in e4m3's subnormal range
    x[-1, :8] = torch.tensor([84.0, 88.0, 92.0, 0.0, -84.0, 124.3, -125.7, 1e-30])  # ties, carries, a zero
    return x


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("static", [False, True])
def test_quantized_rows_are_the_scheme_s_bytes(dtype, static):
    x = _rows(5, 200, seed=1).to(dtype)
    scale = torch.tensor([0.4]) if static else None
    q, s = quantize_rows_fp8(x.to(DEV), scale.to(DEV) if static else None, block=64)
    ref_q, ref_s = quantize_activation(x, scale)
    assert torch.equal(s.cpu(), ref_s[:, 0])
    assert torch.equal(q.cpu().view(torch.uint8), ref_q.view(torch.uint8))
    if not static:
        assert (q.cpu().float().abs() < 2 ** -6).sum() > 50   # row 0: subnormals were exercised


@pytest.mark.parametrize("m", [1, 3, 16])
@pytest.mark.parametrize("cfg", [None, GemvConfig(block_n=16, block_k=32, split_k=3, num_warps=4, num_stages=1,
                                                   use_dot=True, prefetch=True),
                                 GemvConfig(block_n=32, block_k=64, split_k=1, num_warps=4, num_stages=2)])
def test_fp8_rows_times_fp8_weight(m, cfg):
    """Partial N and K tiles (N 80, K 224), one and several K splits; bf16 output of the scaled fp32 product."""
    g = torch.Generator().manual_seed(m)
    xq, xs = quantize_activation(torch.randn(m, 224, generator=g), None)
    w8, ws = quantize_rows(torch.randn(80, 224, generator=g))
    bias = torch.randn(80, generator=g).to(torch.bfloat16)
    y = gemv(xq.to(DEV), w8.to(DEV), bias.to(DEV), weight_scale=ws.to(DEV), x_scale=xs[:, 0].contiguous().to(DEV),
             config=cfg)
    assert y.dtype == torch.bfloat16 and y.shape == (m, 80)
    ref = (xq.double() * xs.double()) @ (w8.double() * ws.double()[:, None]).T + bias.double()
    err = (y.cpu().double() - ref).abs().max() / ref.abs().max()
    assert err < 8e-3


def test_fp8_rows_refuse_what_they_cannot_run():
    xq, xs = quantize_activation(torch.randn(2, 64), None)
    w8, ws = quantize_rows(torch.randn(32, 64))
    with pytest.raises(TypeError, match="x_scale goes with float8_e4m3fn"):
        gemv(xq.float(), w8, weight_scale=ws, x_scale=xs[:, 0].contiguous())
    with pytest.raises(ValueError, match=r"x_scale must be contiguous float32 \(2,\)"):
        gemv(xq, w8, weight_scale=ws, x_scale=xs)
    with pytest.raises(ValueError, match="block_k >= 32"):
        gemv(xq, w8, weight_scale=ws, x_scale=xs[:, 0].contiguous(), config=GemvConfig(block_n=16, block_k=16))


def test_fp8_dot_config_fills_the_gpu():
    cfg = fp8_dot_config(1, 4096, 4096, 132)
    assert cfg.use_dot and cfg.block_k >= 32 and (4096 // cfg.block_n) * cfg.split_k >= 2 * 132
    assert fp8_dot_config(1, 28672, 4096, 132).split_k == 1


_COMPILE = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from tokenmill.kernels.triton_gemv import _gemv_kernel
from tokenmill.kernels.triton_fp8_act import _quant_rows_kernel
sig = dict(x_ptr="*fp8e4nv", w_ptr="*fp8e4nv", b_ptr="*bf16", y_ptr="*bf16", nw_ptr="*fp8e4nv", res_ptr="*fp8e4nv",
           res_out_ptr="*fp8e4nv", ws_ptr="*fp32", cnt_ptr="*i32", M="i32", N="i32", K="i32", k_per_split="i32",
           split_k="i32", eps="fp32", stride_xm="i32", stride_wn="i32", stride_ym="i32", stride_rm="i32",
           stride_rom="i32", wsc_ptr="*fp32", xsc_ptr="*fp32")
const = dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=256, SPLIT=True, SILU_MUL=False, NORM=False, HAS_RES=False,
             HAS_BIAS=False, USE_DOT=True, EVEN_K=True, DOT_F32=False, PREFETCH=True, ACC2D=False, OUT_SILU=False,
             XPRE=False, PDL=1, W_SCALE=True, X_SCALE=True)
src = ASTSource(fn=_gemv_kernel, signature={**sig, **{k: "constexpr" for k in const}}, constexprs=const)
print(sorted(triton.compile(src, target=GPUTarget("cuda", 90, 32)).asm))
for static in (False, True):
    c = dict(STATIC=static, FP8_MAX=448.0, BLOCK=1024, PDL=1)
    s = dict(x_ptr="*bf16", q_ptr="*fp8e4nv", s_ptr="*fp32", in_scale_ptr="*fp32", K="i32", stride_x="i32",
             stride_q="i32", **{k: "constexpr" for k in c})
    print(sorted(triton.compile(ASTSource(fn=_quant_rows_kernel, signature=s, constexprs=c),
                                target=GPUTarget("cuda", 90, 32)).asm))
"""


def test_the_fp8_kernels_compile_for_sm90():
    assert compile_for_sm90(_COMPILE).count("ttgir") == 3


@pytest.mark.gpu
def test_fp8_layer_decode_rows_match_the_scheme():
    """An FP8 layer's decode product (rows quantized, fp8 x fp8 dots) against the scheme's definition."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from tokenmill.layers.quantization.fp8 import scaled_mm
    g = torch.Generator().manual_seed(0)
    w8, ws = quantize_rows(torch.randn(6144, 4096, generator=g) * 0.02)
    w8, ws = w8.cuda(), ws.cuda()
    for m in (1, 7, 16):
        x = (torch.randn(m, 4096, generator=g)).to(torch.bfloat16).cuda()
        xq, xs = quantize_rows_fp8(x)
        y = gemv(xq, w8, weight_scale=ws, x_scale=xs)
        rq, rs = quantize_activation(x, None)
        assert torch.equal(xq.view(torch.uint8), rq.view(torch.uint8))
        ref = (rq.double() * rs.double()) @ (w8.double() * ws.double()[:, None]).T
        assert ((y.double() - ref).abs().max() / ref.abs().max()).item() < 8e-3
        assert ((y.float() - scaled_mm(x, w8, ws, None).float()).abs().max() / ref.abs().max()).item() < 8e-3
