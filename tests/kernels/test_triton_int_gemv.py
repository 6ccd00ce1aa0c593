"""The packed-integer decode GEMV against dequantize-then-matmul: 4- and 8-bit codes, integer zero points and float
offsets (GGUF), act-order group indices, small groups, splits over K, and the 4-bit codes-as-float-bits path (bf16 and
fp16) that applies each group's scale after the product, and the one-row register-FMA kernel. Interpreted on the
CPU; compiled for sm_90 too."""
from __future__ import annotations

import pytest
import torch

from tests.kernels.kernel_check import DEV, check_pdl_chain, compile_for_sm90, rel_err
from tests.kernels.test_triton_quant_matmul import pack_along_k
from tokenmill.kernels.triton_int_gemv import IntGemvConfig, int_gemv


def _case(bits, m, n, k, group, act_order, float_zero, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 2 ** bits, (k, n), generator=g)
    groups = -(-k // group)
    scales = torch.rand(groups, n, generator=g) * 0.1 + 0.01
    zeros = torch.randn(groups, n, generator=g) * 0.3 if float_zero else \
        torch.randint(0, 2 ** bits, (groups, n), generator=g)
    g_idx = (torch.arange(k) // group)[torch.randperm(k, generator=g)] if act_order else torch.arange(k) // group
    w = q.float() * scales[g_idx] + zeros[g_idx] if float_zero else (q - zeros[g_idx]).float() * scales[g_idx]
    x = torch.randn(m, k, generator=g)
    return q, scales, zeros, g_idx, w, x


# (bits, m, n, k, group, act_order, float zero, config): group 128 with 128-deep steps is the one-scale-per-step
# path (4-bit: codes as float bits); 200 and 72 leave partial K and N tiles; splits 2-3 sum partial products
CASES = [
    (4, 1, 40, 256, 128, False, False, IntGemvConfig(64, 128, 1)),
    (4, 3, 72, 512, 128, False, False, IntGemvConfig(32, 128, 2)),
    (4, 16, 48, 128, 32, False, True, IntGemvConfig(64, 32, 2)),
    (4, 5, 72, 200, 8, True, False, IntGemvConfig(64, 64, 2)),
    (8, 2, 33, 192, 16, False, False, IntGemvConfig(32, 64, 3)),
    (8, 1, 48, 256, 64, False, True, IntGemvConfig(16, 64, 1)),
    (4, 2, 64, 256, 128, False, False, IntGemvConfig(64, 128, 2, magic=False)),
    # one row: the register-FMA kernels (4-bit codes shifted to the top of a float's mantissa for 16-bit x, with
    # and without splits (summed in-kernel by the last split to arrive), float offsets, a K past the last whole step;
    # the per-code kernel: 8-bit, fp32 x, or asked for), and the tile kernel
    (4, 1, 72, 512, 128, False, False, IntGemvConfig(64, 128, 3)),
    (4, 1, 40, 200, 128, False, False, IntGemvConfig(32, 128, 2)),
    (4, 1, 72, 512, 128, False, False, IntGemvConfig(64, 128, 3, nibble_words=False)),
    (4, 1, 40, 256, 64, False, True, IntGemvConfig(32, 64, 2)),
    (8, 1, 33, 256, 128, False, False, IntGemvConfig(16, 128, 1)),
    (4, 1, 40, 256, 128, False, False, IntGemvConfig(64, 128, 2, row_kernel=False)),
    # the next step's words in flight: several steps a split, a partial last step, one step a split (N a multiple
    # of the tile, as below: columns not clamped)
    (4, 1, 72, 1000, 128, False, False, IntGemvConfig(32, 128, 2, prefetch=True)),
    (4, 1, 64, 256, 128, False, True, IntGemvConfig(32, 128, 2, prefetch=True)),
    (8, 1, 64, 256, 128, False, False, IntGemvConfig(16, 128, 2)),
    # row tiles (4-bit magic tiles past 16 rows; the generic path too): a partial last row tile, splits
    (4, 40, 72, 512, 128, False, False, IntGemvConfig(64, 128, 2, block_m=32)),
    (4, 33, 48, 256, 128, False, True, IntGemvConfig(32, 128, 1, block_m=16)),
    (8, 20, 40, 192, 64, False, False, IntGemvConfig(32, 64, 2, block_m=32)),
]


@pytest.mark.parametrize("bits, m, n, k, group, act_order, float_zero, cfg", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_int_gemv_matches_dequantized_product(bits, m, n, k, group, act_order, float_zero, cfg, dtype):
    q, scales, zeros, g_idx, w, x = _case(bits, m, n, k, group, act_order, float_zero, seed=bits * 100 + m)
    x = x.to(dtype)
    got = int_gemv(x.to(DEV), pack_along_k(q, bits).to(DEV), scales.to(dtype).to(DEV),
                   (zeros.to(dtype) if float_zero else zeros.to(torch.uint8)).to(DEV), bits, group,
                   g_idx.to(torch.int32).to(DEV) if act_order else None, config=cfg).cpu()
    assert got.dtype == dtype and got.shape == (m, n)
    ref = x.float() @ (w if dtype == torch.float32 else
                       (q.float() * scales.to(dtype).float()[g_idx] + zeros.to(dtype).float()[g_idx]) if float_zero
                       else (q - zeros[g_idx]).float() * scales.to(dtype).float()[g_idx])
    # fp32: the dot runs in full precision; 16-bit: the output's rounding (and the generic path's rounding of each
    # dequantized weight to x's dtype) bound the error
    assert rel_err(got, ref) < (1e-6 if dtype == torch.float32 else 8e-3)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (PDL and CUDA graphs)")
def test_row_kernels_in_a_pdl_graph_chain():
    """One-row products feeding each other, with in-kernel split sums, prefetch and PDL, in a CUDA graph: the same
    bits as plain stream order, and the arrival counters left at zero."""
    from tokenmill.kernels import triton_gemv
    # (N, K, config): K splits with and without prefetch, one split, the per-code kernel
    steps = [(2048, 1024, IntGemvConfig(128, 128, 4)), (1024, 2048, IntGemvConfig(64, 128, 8, prefetch=True)),
             (3072, 1024, IntGemvConfig(128, 128, 1, prefetch=True)),
             (1024, 3072, IntGemvConfig(64, 128, 3, nibble_words=False))] * 2
    packed = []
    for i, (n, k, _) in enumerate(steps):
        q, scales, zeros, _, _, _ = _case(4, 1, n, k, 128, False, False, seed=i)
        packed.append((pack_along_k(q, 4).cuda(), (scales * k ** -0.5).to(torch.bfloat16).cuda(),
                       zeros.to(torch.uint8).cuda()))
    x0 = torch.randn(1, 1024, device="cuda").to(torch.bfloat16)

    def chain():
        x = x0
        for (_, _, cfg), (q, s, z) in zip(steps, packed):
            x = int_gemv(x, q, s, z, 4, 128, config=cfg)      # each N is the next step's K
            x = x / x.float().abs().amax().clamp_min(1e-6).to(x.dtype)
        return x

    check_pdl_chain(chain)
    assert not any(c.any() for c in triton_gemv._COUNTERS.values())


def test_int_gemv_refuses_bad_steps():
    q, scales, zeros, _, _, x = _case(4, 17, 32, 64, 32, False, False, seed=0)
    with pytest.raises(ValueError, match="block_k=4"):
        int_gemv(x[:2].to(DEV), pack_along_k(q, 4).to(DEV), scales.to(DEV), zeros.to(torch.uint8).to(DEV), 4, 32,
                 config=IntGemvConfig(32, 4, 1))


_COMPILE = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from tokenmill.kernels.triton_int_gemv import _int_gemv_kernel


def aligned(sig):
    # what a launch specializes on: 16-aligned pointers and sizes divisible by 16
    return {(i,): [["tt.divisibility", 16]] for i, (a, t) in enumerate(sig.items())
            if t.startswith("*") or a in ("N", "K", "GROUP")}


sig = dict(x_ptr="*bf16", q_ptr="*i32", s_ptr="*bf16", z_ptr="*u8", g_ptr="*i32", y_ptr="*fp32", M="i32", N="i32",
           K="i32", stride_xm="i32", stride_ym="i32", GROUP="i32", k_per_split="i32")
const = ("BITS", "HAS_G_IDX", "FLOAT_ZERO", "GROUP_STEP", "SPLIT", "DOT_F32", "BLOCK_M", "BLOCK_N", "BLOCK_K",
         "MAGIC", "OFFSET", "EVEN_N")
for bits, g_idx, fz, step, magic, off in ((4, False, False, True, 0x4300, 128.0), (4, False, True, True, 0x4300, 128.0),
                                         (4, True, False, False, 0, 0.0), (8, False, False, True, 0, 0.0)):
    s = {**sig, **{c: "constexpr" for c in const}}
    if fz:
        s = {**s, "z_ptr": "*bf16"}
    src = ASTSource(fn=_int_gemv_kernel, signature=s, attrs=aligned(s), constexprs={
        "BITS": bits, "HAS_G_IDX": g_idx, "FLOAT_ZERO": fz, "GROUP_STEP": step, "SPLIT": True, "DOT_F32": False,
        "BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 128, "MAGIC": magic, "OFFSET": off, "EVEN_N": not fz})
    print(sorted(triton.compile(src, target=GPUTarget("cuda", 90, 32)).asm))
from tokenmill.kernels.triton_int_gemv import _int_gemv_row_kernel
row = dict(x_ptr="*bf16", q_ptr="*i32", s_ptr="*bf16", z_ptr="*u8", y_ptr="*bf16", ws_ptr="*fp32", cnt_ptr="*i32",
           N="i32", K="i32", GROUP="i32", k_per_split="i32", split_k="i32", BITS="constexpr", FLOAT_ZERO="constexpr",
           SPLIT="constexpr", BLOCK_N="constexpr", BLOCK_K="constexpr", EVEN_N="constexpr", PDL="constexpr")
for bits in (4, 8):
    src = ASTSource(fn=_int_gemv_row_kernel, signature=row, attrs=aligned(row), constexprs={
        "BITS": bits, "FLOAT_ZERO": False, "SPLIT": True, "BLOCK_N": 128, "BLOCK_K": 128, "EVEN_N": bits == 4,
        "PDL": 0})
    print(sorted(triton.compile(src, target=GPUTarget("cuda", 90, 32)).asm))
from tokenmill.kernels.triton_int_gemv import _int4_gemv_row_kernel
row4 = {**{k: v for k, v in row.items() if k != "BITS"}, "PREFETCH": "constexpr"}
for fz, split, pre, even, pdl in ((False, True, False, True, 2), (True, True, True, False, 0),
                                  (False, False, True, True, 2)):
    sig4 = {**row4, "z_ptr": "*bf16" if fz else "*u8"}
    src = ASTSource(fn=_int4_gemv_row_kernel, signature=sig4, attrs=aligned(sig4), constexprs={
        "FLOAT_ZERO": fz, "SPLIT": split, "BLOCK_N": 128, "BLOCK_K": 128, "PREFETCH": pre, "EVEN_N": even,
        "PDL": pdl})
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32))
    print(sorted(k.asm))
    if even:
        # whole tiles along N: the words arrive in 16-byte loads
        assert ".v4.b32" in k.asm["ptx"], "the words are not loaded 16 bytes at a time"
"""


def test_the_kernel_compiles_for_sm90():
    """The interpreter accepts code the compiler rejects (the codes-as-float-bits bitcast among them)."""
    assert compile_for_sm90(_COMPILE).count("ttgir") == 9


def test_row_tiles_past_16_rows_for_4bit_magic_codes_only():
    from tokenmill.kernels.triton_int_gemv import MAX_M, MAX_TILE_M, default_config, magic_tile_rows
    assert magic_tile_rows(torch.bfloat16, 4, 128, None) == magic_tile_rows(torch.float16, 4, 256, None) == MAX_TILE_M
    act_order = torch.zeros(8, dtype=torch.int32)
    for args in ((torch.float32, 4, 128, None), (torch.bfloat16, 4, 32, None), (torch.bfloat16, 8, 128, None),
                 (torch.bfloat16, 4, 128, act_order)):
        assert magic_tile_rows(*args) == MAX_M
    # 224 N tiles of gate/up cover an H100's 132 SMs: no split; down's 32 tiles split to about two per SM
    assert default_config(40, 28672, 4096, 4, 132) == IntGemvConfig(128, 128, 1, block_m=64)
    assert default_config(20, 4096, 14336, 4, 132) == IntGemvConfig(128, 128, 9, block_m=32)
    assert default_config(16, 4096, 14336, 4, 132).block_m == 16


def test_one_row_without_a_row_kernel_keeps_the_tile_width():
    from tokenmill.kernels.triton_int_gemv import default_config
    assert default_config(1, 4096, 4096, 4, 132).block_n == 256
    assert default_config(1, 4096, 4096, 4, 132, row_kernel=False) == default_config(2, 4096, 4096, 4, 132)
