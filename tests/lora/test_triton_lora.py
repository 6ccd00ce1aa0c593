"""The Triton shrink/expand kernels against the torch reference on random inputs (the interpreter on the CPU,
compiled on a GPU when there is one), and a compile for sm_90."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.kernels.kernel_check import check_pdl_chain, compile_for_sm90
from tokenmill.kernels.triton_gemv import _counters
from tokenmill.lora.ops import build_lora_map, lora_delta_ref, map_groups
from tokenmill.lora.triton_ops import lora_delta_triton, map_to_device, max_tiles

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def test_lora_map_lists_each_slots_tokens_in_order():
    m = build_lora_map(np.array([-1, 2, 0, 0, -1, 2, 1]), 4)
    assert m.dtype == np.int32 and m[:5].tolist() == [0, 2, 3, 5, 5]
    assert m[5:].tolist() == [2, 3, 6, 1, 5]
    assert [(s, r.tolist()) for s, r in map_groups(m, 4)] == [(0, [2, 3]), (1, [6]), (2, [1, 5])]
    assert build_lora_map(np.array([-1, -1]), 3).tolist() == [0, 0, 0, 0]
    assert build_lora_map(np.array([], dtype=np.int64), 2).tolist() == [0, 0, 0]


def test_the_grid_covers_every_split_of_the_tokens_between_slots():
    """The kernels' row-tile axis has max_tiles programs whatever the step's adapters; a tile past it would be
    dropped silently, so the bound must hold for every split of the tokens between slots; the fixed cases are
    splits that reach it (17 = 16 + 1, 40 = 17 + 17 + 6, ...)."""
    rng = np.random.default_rng(0)
    for _ in range(2000):
        t, s, bm = int(rng.integers(1, 200)), int(rng.integers(1, 9)), int(rng.choice([16, 64]))
        slots = rng.integers(-1, s, t)
        counts = np.bincount(slots[slots >= 0], minlength=s)
        assert sum(-(-c // bm) for c in counts) <= max_tiles(t, s, bm)
    assert [max_tiles(17, 2, 16), max_tiles(2, 8, 16), max_tiles(1, 8, 16), max_tiles(40, 3, 16)] == [2, 2, 1, 5]


# A prefill chunk under slot 1 longer than a row tile, decode rows of several slots, tokens without adapters; the
# longer batch takes the large-tile path (64 rows).
_SHORT = [1] * 21 + [-1, 0, 2, 0, -1, 2, 1]
_LONG = [1] * 70 + [-1, 0] * 5 + [2] * 3


@pytest.mark.parametrize("rank, dtype, slots", [
    (8, torch.float32, _SHORT), (16, torch.float32, _LONG), (1, torch.float16, _SHORT),
    pytest.param(16, torch.bfloat16, _SHORT, marks=pytest.mark.gpu),
    pytest.param(16, torch.bfloat16, _LONG, marks=pytest.mark.gpu)])
@pytest.mark.parametrize("sizes", [[24, 8, 8], [40]])
def test_triton_matches_the_reference(rank, dtype, slots, sizes):
    g = torch.Generator().manual_seed(rank)
    K, S = 600, 3  # K long enough for several split partials
    slots = np.array(slots)
    T, R = len(slots), rank
    x = torch.randn(T, K, generator=g).to(DEV, dtype)
    a = torch.randn(S, len(sizes) * R, K, generator=g).to(DEV, dtype) / K ** 0.5
    b = torch.randn(S, sum(sizes), R, generator=g).to(DEV, dtype)
    y0 = torch.randn(T, sum(sizes), generator=g).to(DEV, dtype)
    lora_map = build_lora_map(slots, S)
    groups = [(s, torch.from_numpy(r.astype(np.int64)).to(DEV)) for s, r in map_groups(lora_map, S)]
    want, got = y0.clone(), y0.clone()
    lora_delta_ref(x, want, groups, a, b, sizes, R)
    lora_delta_triton(x, got, map_to_device(lora_map, DEV), a, b, sizes, R)
    tol = 1e-4 if dtype == torch.float32 else (5e-2 if dtype == torch.bfloat16 else 2e-2)
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol * 10)
    assert torch.equal(got[slots < 0], y0[slots < 0])
    assert not torch.equal(got[slots >= 0], y0[slots >= 0])
    # The splits' arrival counters are back at zero for the next call (or graph replay).
    assert not _counters(got.device, "lora").any()


def test_an_empty_map_leaves_the_output_alone():
    x = torch.randn(5, 32).to(DEV)
    y = torch.randn(5, 16).to(DEV)
    a, b = torch.randn(2, 8, 32).to(DEV), torch.randn(2, 16, 8).to(DEV)
    got = y.clone()
    lora_delta_triton(x, got, map_to_device(build_lora_map(np.full(5, -1), 2), DEV), a, b, [16], 8)
    assert torch.equal(got, y)


@pytest.mark.gpu
@pytest.mark.parametrize("slots", [[0, -1, 1, 1], [-1, -1, -1, -1]])
def test_pdl_launches_in_a_graph_are_bit_identical(slots):
    """Behind a product (an early-triggering PDL gemv) and in front of a plain kernel, with and without adapter
    tokens: the second case is the one where every program but program 0 returns before its wait."""
    from tokenmill.layers.linear_ops import linear
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 512, generator=g).to(DEV, torch.bfloat16)
    w = torch.randn(96, 512, generator=g).to(DEV, torch.bfloat16)
    a = torch.randn(2, 3 * 16, 512, generator=g).to(DEV, torch.bfloat16) / 20
    b = torch.randn(2, 96, 16, generator=g).to(DEV, torch.bfloat16)
    lora_map = map_to_device(build_lora_map(np.array(slots), 2), DEV)

    def chain():
        y = linear(x, w, None)
        lora_delta_triton(x, y, lora_map, a, b, [64, 16, 16], 16)
        return y * 2

    check_pdl_chain(chain)


_COMPILE = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from tokenmill.lora.triton_ops import _expand_kernel, _shrink_kernel
common = {"map_ptr": "*i32", "h_stride": "i32", "NUM_SLOTS": "constexpr", "SLOTS_P2": "constexpr",
          "BLOCK_M": "constexpr", "BLOCK_R": "constexpr", "IEEE": "constexpr", "PDL": "constexpr"}
shrink = dict(common, x_ptr="*bf16", a_ptr="*bf16", h_ptr="*fp32", ws_ptr="*fp32", cnt_ptr="*i32", K="i32",
              R_TOT="i32", K_PER="i32", x_stride="i32", a_slot_stride="i32", a_row_stride="i32",
              ws_split_stride="i32", BLOCK_K="constexpr")
expand = dict(common, h_ptr="*fp32", b_ptr="*bf16", y_ptr="*bf16", R="i32", b_slot_stride="i32",
              b_row_stride="i32", y_stride="i32", n0="i32", n1="i32", n2="i32", nb0="i32", nb01="i32",
              BLOCK_N="constexpr")
c = {"NUM_SLOTS": 8, "SLOTS_P2": 8, "BLOCK_M": 16, "BLOCK_R": 64, "IEEE": False, "PDL": 1}
variants = [(_shrink_kernel, shrink, dict(c, BLOCK_K=64)), (_expand_kernel, expand, dict(c, BLOCK_N=64))]
for fn, sig, c in variants:
    sig = {k: sig[k] for k in fn.arg_names}
    print(sorted(triton.compile(ASTSource(fn=fn, signature=sig, constexprs=c), target=GPUTarget("cuda", 90, 32)).asm))
"""


def test_the_kernels_compile_for_sm90():
    assert compile_for_sm90(_COMPILE).count("ttgir") == 2


@pytest.mark.gpu
def test_no_variant_compiles_for_a_new_token_count():
    """Once a small and a large batch have run, any other token count reuses their compiled kernels: a server
    never stalls on a Triton compile when a step of a new size arrives."""
    from tokenmill.kernels.compile_stats import CompileStats
    g = torch.Generator().manual_seed(0)
    a = torch.randn(4, 2 * 16, 1024, generator=g).to(DEV, torch.bfloat16) / 32  # K splits from 4 down to 1
    b = torch.randn(4, 384, 16, generator=g).to(DEV, torch.bfloat16)

    def run(t: int) -> None:
        x = torch.randn(t, 1024, generator=g).to(DEV, torch.bfloat16)
        y = torch.zeros(t, 384, device=DEV, dtype=torch.bfloat16)
        lora_map = map_to_device(build_lora_map(np.arange(t) % 5 - 1, 4), DEV)
        lora_delta_triton(x, y, lora_map, a, b, [256, 128], 16)

    for t in (20, 100, 4096):
        run(t)
    torch.cuda.synchronize()
    stats = CompileStats.track()
    try:
        for t in (17, 23, 32, 48, 63, 65, 99, 128, 257, 1000, 2048, 9000, 20000):
            run(t)
        torch.cuda.synchronize()
    finally:
        stats.stop()
    if not stats.available:
        pytest.skip("this Triton has no compilation listener")
    assert stats.compiled + stats.cache_hits == 0
