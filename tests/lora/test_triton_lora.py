"""The Triton shrink/expand kernels against the torch reference on random inputs (the interpreter on the CPU,
compiled on a GPU when there is one), and a compile for sm_90."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.kernels.kernel_check import compile_for_sm90
from tokenmill.lora.ops import lora_delta_ref
from tokenmill.lora.triton_ops import BLOCK_M, lora_delta_triton, make_tiles

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def test_tiles_are_runs_of_one_slot_cut_every_block():
    start, length, slot = (t.tolist() for t in make_tiles(np.array([-1, 0, 0, 1] + [2] * (BLOCK_M + 3) + [-1, 0]),
                                                          torch.device("cpu")))
    assert start == [1, 3, 4, 4 + BLOCK_M, 4 + BLOCK_M + 3 + 1]
    assert length == [2, 1, BLOCK_M, 3, 1] and slot == [0, 1, 2, 2, 0]
    assert make_tiles(np.array([-1, -1]), torch.device("cpu")) is None


@pytest.mark.parametrize("rank, dtype", [(8, torch.float32), (16, torch.float32), (1, torch.float16),
                                         pytest.param(16, torch.bfloat16, marks=pytest.mark.gpu)])
def test_triton_matches_the_reference(rank, dtype):
    g = torch.Generator().manual_seed(rank)
    K, sizes, S = 40, [24, 8, 8], 3
    # A prefill chunk under slot 1 longer than one tile, decode rows of several slots, tokens without adapters.
    slots = np.array([1] * (BLOCK_M + 5) + [-1, 0, 2, 0, -1, 2, 1])
    T = len(slots)
    x = torch.randn(T, K, generator=g).to(DEV, dtype)
    a = [torch.randn(S, rank, K, generator=g).to(DEV, dtype) for _ in sizes]
    b = [torch.randn(S, n, rank, generator=g).to(DEV, dtype) for n in sizes]
    offsets = [int(o) for o in np.cumsum([0, *sizes[:-1]])]
    y0 = torch.randn(T, sum(sizes), generator=g).to(DEV, dtype)
    groups = [(s, torch.from_numpy(np.flatnonzero(slots == s)).to(DEV)) for s in range(S)]
    want, got = y0.clone(), y0.clone()
    lora_delta_ref(x, want, groups, a, b, offsets)
    lora_delta_triton(x, got, make_tiles(slots, DEV), a, b, offsets)
    tol = 1e-4 if dtype == torch.float32 else (5e-2 if dtype == torch.bfloat16 else 2e-2)
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol * 10)
    assert torch.equal(got[slots < 0], y0[slots < 0])


_COMPILE = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from tokenmill.lora.triton_ops import _expand_kernel, _shrink_kernel
common = {"start_ptr": "*i32", "len_ptr": "*i32", "slot_ptr": "*i32", "R": "i32"}
shrink = dict(common, x_ptr="*bf16", a_ptr="*bf16", h_ptr="*fp32", K="i32", x_stride="i32", a_slot_stride="i32",
              a_row_stride="i32", h_stride="i32", BLOCK_M="constexpr", BLOCK_R="constexpr", BLOCK_K="constexpr")
expand = dict(common, h_ptr="*fp32", b_ptr="*bf16", y_ptr="*bf16", N="i32", h_stride="i32", b_slot_stride="i32",
              b_row_stride="i32", y_stride="i32", y_offset="i32", BLOCK_M="constexpr", BLOCK_R="constexpr",
              BLOCK_N="constexpr")
for fn, sig, c in ((_shrink_kernel, shrink, {"BLOCK_M": 16, "BLOCK_R": 16, "BLOCK_K": 32}),
                   (_expand_kernel, expand, {"BLOCK_M": 16, "BLOCK_R": 16, "BLOCK_N": 64})):
    sig = {k: sig[k] for k in fn.arg_names}
    print(sorted(triton.compile(ASTSource(fn=fn, signature=sig, constexprs=c), target=GPUTarget("cuda", 90, 32)).asm))
"""


def test_the_kernels_compile_for_sm90():
    assert compile_for_sm90(_COMPILE).count("ttgir") == 2
