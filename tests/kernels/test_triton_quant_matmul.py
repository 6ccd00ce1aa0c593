"""The dequantize-in-registers Triton products against dequantize-then-matmul: FP8 weights with row or block scales,
packed 4- and 8-bit integer weights with grouped scales, zero points and act-order group indices; odd sizes exercise
every mask. Under TRITON_INTERPRET=1 on the CPU; compiled for sm_90 too."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.kernels.kernel_check import INTERPRETED, compile_for_sm90
from tokenmill.kernels.triton_quant_matmul import fp8_matmul, int_dequantize, int_matmul

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
FP8 = torch.float8_e4m3fn


@pytest.mark.parametrize("m, n, k", [(1, 48, 64), (5, 33, 80), (20, 64, 128)])
def test_fp8_row_scales(m, n, k):
    g = torch.Generator().manual_seed(m)
    w = (torch.randn(n, k, generator=g) * 50).clamp(-448, 448).to(FP8)
    s = torch.rand(n, generator=g) + 0.01
    x = torch.randn(m, k, generator=g)
    ref = F.linear(x, w.float() * s[:, None])
    got = fp8_matmul(x.to(DEV), w.to(DEV), s.to(DEV)).cpu()
    torch.testing.assert_close(got, ref, rtol=1e-3, atol=1e-2)


# (128, 128): the published blocks, where each 64 x 64 tile takes one scale (200: partial last blocks and tiles)
@pytest.mark.parametrize("m, n, k, block", [(2, 64, 128, (32, 64)), (17, 48, 96, (16, 32)), (1, 256, 256, (128, 128)),
                                            (3, 200, 200, (128, 128))])
def test_fp8_block_scales(m, n, k, block):
    g = torch.Generator().manual_seed(k)
    w = (torch.randn(n, k, generator=g) * 50).clamp(-448, 448).to(FP8)
    s = torch.rand(-(-n // block[0]), -(-k // block[1]), generator=g) + 0.01
    x = torch.randn(3, m, k, generator=g)  # leading dims are flattened
    full = s.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)[:n, :k]
    ref = F.linear(x, w.float() * full)
    got = fp8_matmul(x.to(DEV), w.to(DEV), s.to(DEV), block).cpu()
    assert got.shape == (3, m, n)
    torch.testing.assert_close(got, ref, rtol=1e-3, atol=1e-2)


def pack_along_k(q: torch.Tensor, bits: int) -> torch.Tensor:
    """[K, N] integers in [0, 2^bits) -> int32 [K * bits / 32, N], value j of a word in bits j*bits.. (documented
    layout of the kernel)."""
    per = 32 // bits
    q = q.to(torch.int64).reshape(q.shape[0] // per, per, q.shape[1])
    word = sum(q[:, j] << (j * bits) for j in range(per))
    return (word & 0xFFFFFFFF).to(torch.uint32).view(torch.int32) if hasattr(torch, "uint32") else \
        torch.where(word >= 2**31, word - 2**32, word).to(torch.int32)


# split_k: K per program, the programs' shares summed by atomic adds (what decode-sized products use on a GPU);
# 64 of k = 200 leaves a partial last share
@pytest.mark.parametrize("bits, m, n, k, group, act_order, split_k", [
    (4, 1, 40, 64, 32, False, None), (4, 6, 64, 128, 64, True, None), (8, 18, 33, 64, 16, False, None),
    (8, 3, 32, 96, 32, True, None), (4, 1, 40, 256, 32, False, 64), (4, 5, 72, 200, 8, True, 64),
    (8, 2, 33, 192, 16, False, 128)])
def test_int_weights(bits, m, n, k, group, act_order, split_k):
    g = torch.Generator().manual_seed(bits * 100 + m)
    q = torch.randint(0, 2 ** bits, (k, n), generator=g)
    groups = k // group
    scales = torch.rand(groups, n, generator=g) * 0.1 + 0.01
    zeros = torch.randint(0, 2 ** bits, (groups, n), generator=g)
    g_idx = (torch.arange(k) // group)[torch.randperm(k, generator=g)] if act_order else torch.arange(k) // group
    w = (q - zeros[g_idx]).float() * scales[g_idx]
    x = torch.randn(m, k, generator=g)
    got = int_matmul(x.to(DEV), pack_along_k(q, bits).to(DEV), scales.to(DEV), zeros.to(torch.uint8).to(DEV), bits,
                     group, g_idx.to(torch.int32).to(DEV) if act_order else None, split_k=split_k).cpu()
    assert got.dtype == x.dtype
    torch.testing.assert_close(got, x @ w, rtol=1e-3, atol=1e-3)
    if split_k:
        with pytest.raises(ValueError, match="multiple of the K tile"):
            int_matmul(x.to(DEV), pack_along_k(q, bits).to(DEV), scales.to(DEV), zeros.to(torch.uint8).to(DEV),
                       bits, group, split_k=split_k + 8)


@pytest.mark.parametrize("bits, group", [(4, 32), (8, 16)])
def test_int_weights_with_float_offsets(bits, group):
    """GGUF's affine blocks: w = q * s + m with a float offset m per (group, column), fp16 scales and offsets."""
    g = torch.Generator().manual_seed(bits)
    k, n, m = 128, 48, 5
    q = torch.randint(0, 2 ** bits, (k, n), generator=g)
    scales = (torch.rand(k // group, n, generator=g) * 0.1 + 0.01).half()
    offsets = (torch.randn(k // group, n, generator=g) * 0.3).half()
    gi = torch.arange(k) // group
    w = q.float() * scales.float()[gi] + offsets.float()[gi]
    x = torch.randn(m, k, generator=g)
    got = int_matmul(x.to(DEV), pack_along_k(q, bits).to(DEV), scales.to(DEV), offsets.to(DEV), bits, group).cpu()
    torch.testing.assert_close(got, x @ w, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("bits, n, k, group, act_order, float_zero, dtype", [
    (4, 200, 96, 32, False, False, torch.bfloat16), (4, 64, 256, 128, True, False, torch.float16),
    (8, 33, 64, 16, False, True, torch.float32), (4, 130, 40, 8, False, True, torch.bfloat16)])
def test_int_dequantize(bits, n, k, group, act_order, float_zero, dtype):
    """The weight large-row products hand to cuBLAS: each value computed in fp32 and rounded once to `dtype`
    (partial K and N blocks: k 40 / 96 against the 32-row blocks, n 130 / 200 / 33 against 128 columns)."""
    g = torch.Generator().manual_seed(bits + n)
    q = torch.randint(0, 2 ** bits, (k, n), generator=g)
    groups = -(-k // group)
    scales = torch.rand(groups, n, generator=g) * 0.1 + 0.01
    zeros = torch.randn(groups, n, generator=g) * 0.3 if float_zero else torch.randint(0, 2 ** bits, (groups, n),
                                                                                       generator=g)
    g_idx = (torch.arange(k) // group)[torch.randperm(k, generator=g)] if act_order else torch.arange(k) // group
    w = q.float() * scales[g_idx] + zeros[g_idx] if float_zero else (q - zeros[g_idx]).float() * scales[g_idx]
    got = int_dequantize(pack_along_k(q, bits).to(DEV), scales.to(DEV), (zeros if float_zero else
                         zeros.to(torch.uint8)).to(DEV), bits, group,
                         g_idx.to(torch.int32).to(DEV) if act_order else None, dtype).cpu()
    assert got.dtype == dtype and got.shape == (k, n)
    if INTERPRETED and dtype == torch.bfloat16:   # the interpreter truncates fp32 -> bf16 (the GPU rounds)
        torch.testing.assert_close(got.float(), w, rtol=2 ** -7, atol=0)
    else:
        # q * s + m may be one fused multiply-add (one rounding, the GPU) or two (the interpreter)
        fused = (q.double() * scales.double()[g_idx] + zeros.double()[g_idx]).float() if float_zero else w
        assert ((got == w.to(dtype)) | (got == fused.to(dtype))).all()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (the cuBLAS path)")
@pytest.mark.parametrize("extra_rows, act_order", [(-40, False), (3, False), (-40, True)])
def test_int_matmul_many_rows_take_magic_tiles_then_cublas(monkeypatch, extra_rows, act_order):
    """Past 16 rows, 4-bit codes with whole-group steps run int_gemv's magic tiles up to MAX_TILE_M rows, then (and
    for act-order at once) W dequantized once for cuBLAS."""
    from tokenmill.kernels import triton_quant_matmul as tqm
    from tokenmill.kernels.triton_int_gemv import MAX_TILE_M
    dequantized = []
    real = tqm.int_dequantize
    monkeypatch.setattr(tqm, "int_dequantize", lambda *a, **kw: dequantized.append(1) or real(*a, **kw))
    g = torch.Generator().manual_seed(7)
    k, n, m = 512, 384, MAX_TILE_M + extra_rows
    q = torch.randint(0, 16, (k, n), generator=g)
    scales = (torch.rand(k // 128, n, generator=g) * 0.02).to(torch.bfloat16)
    zeros = torch.randint(0, 16, (k // 128, n), generator=g)
    g_idx = (torch.arange(k) // 128)[torch.randperm(k, generator=g)] if act_order else torch.arange(k) // 128
    x = torch.randn(m, k, generator=g).to(torch.bfloat16)
    args = (pack_along_k(q, 4).cuda(), scales.cuda(), zeros.to(torch.uint8).cuda(), 4, 128,
            g_idx.to(torch.int32).cuda() if act_order else None)
    got = int_matmul(x.cuda(), *args)
    assert len(dequantized) == (extra_rows > 0 or act_order)
    tiles = int_matmul(x.cuda(), *args, split_k=0)       # the in-register tile kernel, for reference
    ref = x.double() @ ((q - zeros[g_idx]).double() * scales.double()[g_idx])
    assert got.dtype == torch.bfloat16
    for y in (got, tiles):
        assert ((y.double().cpu() - ref).norm() / ref.norm()).item() < 5e-3


_COMPILE = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from tokenmill.kernels.triton_quant_matmul import _fp8_matmul_kernel, _int_matmul_kernel
common = {"M": "i32", "N": "i32", "K": "i32", "stride_xm": "i32", "stride_ym": "i32"}
fp8 = dict(x_ptr="*bf16", w_ptr="*fp8e4nv", s_ptr="*fp32", y_ptr="*bf16", **common, s_cols="i32", BN_SCALE="i32",
           BK_SCALE="i32", BLOCK_SCALES="constexpr", BLOCK_M="constexpr", BLOCK_N="constexpr", BLOCK_K="constexpr",
           TILE_SCALE="constexpr")
for blocks, tile in ((False, False), (True, False), (True, True)):
    src = ASTSource(fn=_fp8_matmul_kernel, signature=fp8, constexprs={
        "BLOCK_SCALES": blocks, "BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 64, "TILE_SCALE": tile})
    print(sorted(triton.compile(src, target=GPUTarget("cuda", 90, 32)).asm))
ints = dict(x_ptr="*bf16", q_ptr="*i32", s_ptr="*bf16", z_ptr="*u8", g_ptr="*i32", y_ptr="*bf16", **common,
            GROUP="i32", BITS="constexpr", HAS_G_IDX="constexpr", FLOAT_ZERO="constexpr", BLOCK_M="constexpr",
            BLOCK_N="constexpr", BLOCK_K="constexpr", K_PER_SPLIT="constexpr")
for bits, gi, fz, split in ((4, False, False, 0), (8, True, False, 0), (4, False, True, 832)):
    sig = {**ints, "s_ptr": "*fp16", "z_ptr": "*fp16"} if fz else ints
    if split:
        sig = {**sig, "y_ptr": "*fp32"}
    src = ASTSource(fn=_int_matmul_kernel, signature=sig, constexprs={
        "BITS": bits, "HAS_G_IDX": gi, "FLOAT_ZERO": fz, "BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 64,
        "K_PER_SPLIT": split})
    print(sorted(triton.compile(src, target=GPUTarget("cuda", 90, 32)).asm))
from tokenmill.kernels.triton_quant_matmul import _int_dequant_kernel
deq = dict(q_ptr="*i32", s_ptr="*bf16", z_ptr="*u8", g_ptr="*i32", w_ptr="*bf16", N="i32", K="i32", GROUP="i32",
           BITS="constexpr", HAS_G_IDX="constexpr", FLOAT_ZERO="constexpr", BLOCK_K="constexpr", BLOCK_N="constexpr")
for bits, gi, fz in ((4, False, False), (8, True, True)):
    sig = {**deq, "s_ptr": "*fp16", "z_ptr": "*fp16", "w_ptr": "*fp16"} if fz else deq
    src = ASTSource(fn=_int_dequant_kernel, signature=sig, constexprs={
        "BITS": bits, "HAS_G_IDX": gi, "FLOAT_ZERO": fz, "BLOCK_K": 32, "BLOCK_N": 128})
    print(sorted(triton.compile(src, target=GPUTarget("cuda", 90, 32)).asm))
"""


def test_the_kernels_compile_for_sm90():
    """The interpreter accepts code the compiler rejects: compile for an H100/H200 target too (on the CPU, in a
    process without the interpreter; where this triton cannot, the test says so and skips)."""
    assert compile_for_sm90(_COMPILE).count("ttgir") == 8
