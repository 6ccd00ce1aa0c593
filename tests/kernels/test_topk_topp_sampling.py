"""The sort-free min-p / top-k / top-p kernel (tokenmill.kernels.triton_topk_topp) against an exact reference.

The reference below is written from the rules alone (float64, O(V^2), no sort): min-p on the temperature-scaled
distribution, then top-k (ties of the k-th value kept), then top-p on the renormalised survivors (a token is kept
when the mass strictly above it is < top_p). Under TRITON_INTERPRET the kernel costs ~50 ms a row, so the kernel's
own statistical test is small; the large-sample test of the same distribution runs on the torch path in
tests/layers/test_sampler_truncation.py, and here every kernel token is checked to be the torch path's token.
"""
from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest
import torch

from tokenmill.kernels.triton_topk_topp import topk_topp_sample
from tokenmill.layers.sampler import Sampler, SamplingMetadata

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def ref_keep(y: torch.Tensor, k: int, p: float, min_p: float) -> torch.Tensor:
    """[V] bool kept set for one row of temperature-scaled logits y (k <= 0, p >= 1, min_p <= 0: off)."""
    y = y.double()
    keep = y >= y.max() + (math.log(min_p) if min_p > 0 else -math.inf)
    above = (y[None, :] > y[:, None]) & keep[None, :]          # above[i, j]: j is a survivor strictly above i
    if k > 0:
        keep &= above.sum(1) < k
        above &= keep[None, :]
    if p < 1:
        e = torch.where(keep, (y - y.max()).exp(), 0.0)
        keep &= (above.double() * e[None, :]).sum(1) < p * e.sum()
    return keep


def ref_probs(y, k, p, min_p):
    keep = ref_keep(y, k, p, min_p)
    e = torch.where(keep, (y.double() - y.double().max()).exp(), 0.0)
    return e / e.sum()


def torch_path(logits, temp, seeds, pos, k, p, mp):
    md = SamplingMetadata(all_greedy=False, all_random=True, temperature=temp, seeds=seeds, positions=pos,
                          top_k=k, max_top_k=int(k.max()) if k is not None else 0, top_p=p, min_p=mp)
    return Sampler(fuse_noise=False)(logits.float().clone(), md).sampled_token_ids


def _rows(b, v, seed):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(b, v, generator=g) * 2
    logits[1] = torch.randint(0, 4, (v,), generator=g).float()   # ties everywhere, also at each boundary
    logits[2, : v // 2] = float("-inf")                          # masked tokens are never kept nor drawn
    temp = torch.rand(b, generator=g) + 0.4
    k = torch.randint(0, 12, (b,), generator=g)
    k[0] = 0
    p = torch.rand(b, generator=g) * 0.9 + 0.1
    p[3] = 1.0
    mp = torch.rand(b, generator=g) * 0.3
    mp[4] = 0.0
    seeds = torch.randint(-2 ** 62, 2 ** 62, (b,), generator=g)
    pos = torch.randint(0, 1 << 34, (b,), generator=g)
    return logits, temp, k, p, mp, seeds, pos


@pytest.mark.parametrize("use", ["p", "k", "m", "kp", "kpm", "K", "Kp", "Kpm"])
@pytest.mark.parametrize("want_thr", [False, True])
def test_kernel_draws_the_torch_paths_token_and_keeps_the_exact_set(use, want_thr):
    """k: top-k by the bracket search; K: top-k from torch.topk's k-th value (max_top_k given)."""
    b, v = 6, 160
    logits, temp, k, p, mp, seeds, pos = _rows(b, v, seed=len(use) + 10 * want_thr)
    kk, pp, mm = (k if "k" in use.lower() else None), (p if "p" in use else None), (mp if "m" in use else None)
    tok, thr = topk_topp_sample(logits.to(DEV), seeds.to(DEV), pos.to(DEV), temp.to(DEV),
                                *(t.to(DEV) if t is not None else None for t in (kk, pp, mm)),
                                want_threshold=want_thr, block=64, chunk=32,
                                max_top_k=int(k.max()) if "K" in use else 0)
    tok = tok.cpu()
    assert torch.equal(tok, torch_path(logits, temp, seeds, pos, kk, pp, mm))
    y = logits / temp[:, None]
    for i in range(b):
        keep = ref_keep(y[i], int(kk[i]) if kk is not None else 0, float(pp[i]) if pp is not None else 1.0,
                        float(mm[i]) if mm is not None else 0.0)
        assert keep[tok[i]], (i, tok[i])
        if want_thr:
            assert torch.equal(y[i] >= thr[i].cpu(), keep), i


def test_bf16_logits_and_no_temperature():
    logits = (torch.randn(4, 300, generator=torch.Generator().manual_seed(3)) * 3).bfloat16()
    seeds, pos = torch.tensor([1, 2, 3, 4]), torch.tensor([0, 5, 9, 1 << 40])
    k, p = torch.tensor([5, 0, 0, 1]), torch.tensor([0.9, 0.5, 1.0, 0.3])
    tok, thr = topk_topp_sample(logits.to(DEV), seeds.to(DEV), pos.to(DEV), None, k.to(DEV), p.to(DEV),
                                want_threshold=True, block=128, chunk=128)
    assert torch.equal(tok.cpu(), torch_path(logits, None, seeds, pos, k, p, None))
    for i in range(4):
        assert torch.equal(logits[i].float() >= thr[i].cpu(), ref_keep(logits[i].float(), int(k[i]), float(p[i]),
                                                                        0.0))
    assert int(thr.isfinite().sum()) == 3   # the row with neither top-k nor top-p keeps everything (-inf)


@pytest.mark.parametrize("with_min_p", [False, True])
@pytest.mark.parametrize("rounds_min_rows", [16, 1000])
def test_top_p_alone_through_every_rejection_stage(with_min_p, rounds_min_rows, monkeypatch):
    """Top-p without top-k: a row is decided by the split pass's test, by a round kernel's or by the row program's
    serial loop, depending on how many candidates are rejected (top_p from 0.02 to 0.999 spreads the rows over all
    three); rows with top_p 1 and a fully masked row pass through the rounds. Same token as the torch path, with the
    rounds (40 rows) and without them (as small batches run)."""
    import tokenmill.kernels.triton_topk_topp as kernel
    monkeypatch.setattr(kernel, "_ROUNDS_MIN_ROWS", rounds_min_rows)
    g = torch.Generator().manual_seed(21 + with_min_p)
    b, v = 40, 160
    logits = torch.randn(b, v, generator=g) * 1.5
    logits[5] = float("-inf")
    logits[6] = torch.randint(0, 3, (v,), generator=g).float()
    temp = torch.rand(b, generator=g) + 0.5
    p = torch.linspace(0.02, 0.999, b)
    p[7] = p[8] = 1.0
    mp = (torch.rand(b, generator=g) * 0.2) if with_min_p else None
    seeds = torch.randint(0, 2 ** 40, (b,), generator=g)
    pos = torch.arange(b) * 7
    tok, _ = topk_topp_sample(logits.to(DEV), seeds.to(DEV), pos.to(DEV), temp.to(DEV), None, p.to(DEV),
                              mp.to(DEV) if mp is not None else None, block=64, chunk=32)
    assert torch.equal(tok.cpu(), torch_path(logits, temp, seeds, pos, None, p, mp))
    y = logits / temp[:, None]
    for i in range(b):
        if i != 5:
            assert ref_keep(y[i], 0, float(p[i]), float(mp[i]) if mp is not None else 0.0)[tok[i]], i


@pytest.mark.parametrize("max_top_k", [0, 11])
def test_seeded_rows_do_not_depend_on_the_batch(max_top_k):
    """max_top_k 11: the rows with top-k through torch.topk's candidates (the batch's largest k is 11 or less)."""
    logits, temp, k, p, mp, seeds, pos = _rows(6, 120, seed=5)
    args = lambda idx: [t[idx].to(DEV) for t in (logits, seeds, pos, temp, k, p, mp)]  # noqa: E731
    kw = dict(block=32, chunk=32, max_top_k=max_top_k)
    full, _ = topk_topp_sample(*args(torch.arange(6)), **kw)
    perm = torch.tensor([4, 2, 0])
    part, _ = topk_topp_sample(*args(perm), **kw)
    assert torch.equal(part.cpu(), full.cpu()[perm])
    other = torch.tensor([1, 1, 3])   # another position of the same seed draws independently
    moved = [t.clone() for t in args(other)]
    moved[2] += 1
    assert topk_topp_sample(*moved, **kw)[0].tolist() != full.cpu()[other].tolist()


def _select_rows(v, seed):
    """Rows for the torch.topk path (max_top_k 12 -> 64 candidates when v > 64), each aimed at one of its cases."""
    g = torch.Generator().manual_seed(seed)
    b = 12
    logits = torch.randn(b, v, generator=g) * 2
    logits[1] = torch.randint(0, 2, (v,), generator=g).float()   # ~v/2 ties of the k-th value: past the candidates
    logits[2] = torch.randint(0, 2, (v,), generator=g).float() - 4
    logits[2, :8] = torch.arange(8.0)   # 8 distinct values above a long tie run: top-p cuts above it or keeps it
    logits[3, 3:] = float("-inf")       # 3 finite values, k 8: the k-th value is -inf (massless ties past the list)
    logits[4] = float("-inf")           # everything masked: token 0, keeps everything
    # Neighbouring fp32 values in [1.9, 2) that the division by 0.95 (into [2, 2.1), twice the spacing) often
    # rounds together: ties of y that are not ties of the logits.
    logits[5] = 1.9 + torch.randint(0, v, (v,), generator=g).float() * 2.0 ** -23
    # Mass 100 above v - 1 ties of mass 1, k 2: top_p 0.5 keeps the ties only when the ones past the candidates
    # count in the normaliser (100 < 0.5 * (100 + 159) at v 160, not with 63 of them); top_p 0.3 cuts above them.
    logits[9] = 0.0
    logits[9, 0] = math.log(100.0)
    temp = torch.rand(b, generator=g) + 0.4
    temp[5], temp[9] = 0.95, 1.0
    k = torch.tensor([1, 5, 12, 8, 3, 10, 0, 7, 12, 2, 0, 4])
    p = torch.tensor([0.9, 0.6, 0.5, 0.95, 0.8, 0.7, 0.9, 1e-6, 0.9999, 1.0, 0.3, 0.5])
    p[2] = 0.5 if seed % 2 else 0.99999
    p[9] = 0.5 if seed % 2 else 0.3
    mp = torch.tensor([0.0, 0.1, 0.0, 0.0, 0.2, 0.0, 0.05, 0.0, 0.3, 0.0, 0.0, 0.0])
    seeds = torch.randint(-2 ** 62, 2 ** 62, (b,), generator=g)
    pos = torch.randint(0, 1 << 34, (b,), generator=g)
    return logits, temp, k, p, mp, seeds, pos


def _full_row_pass(y, k, mp, max_top_k):
    """Rows of the select kernel that stream themselves: the tie group of the k-th value may run past the
    candidates (the last one is still kept by min-p and top-k)."""
    from tokenmill.kernels.triton_topk_select import TIE_SLACK
    v = y.shape[1]
    w = min(v, 1 << (max_top_k + TIE_SLACK - 1).bit_length())
    s = y.sort(dim=1, descending=True).values
    floor = torch.maximum(s.gather(1, (k.clamp(min=1) - 1)[:, None]).squeeze(1),
                          s[:, 0] + torch.log(mp.clamp(min=0)))
    return (k > 0) & (w < v) & (s[:, w - 1] >= floor) & (s[:, 0] > float("-inf"))


@pytest.mark.parametrize("v", [160, 40])
@pytest.mark.parametrize("use", ["", "p", "m", "pm"])
@pytest.mark.parametrize("want_thr", [False, True])
def test_select_path_is_the_torch_paths_token_and_exact_set(v, use, want_thr):
    """Top-k from torch.topk's candidates (kernels/triton_topk_select): ties of the k-th value past the candidates,
    at the top-p boundary and made by the temperature division, k 1 and k = V, top_p near 0 and 1, min-p, rows
    without top-k (the full-row kernels), masked rows. v 40: all candidates fetched (no full-row pass)."""
    logits, temp, k, p, mp, seeds, pos = _select_rows(v, seed=v + len(use) + want_thr)
    if v == 40:
        k[8] = v
    pp, mm = (p if "p" in use else None), (mp if "m" in use else None)
    mk = int(k.max())
    y = logits / temp[:, None]
    streamed = _full_row_pass(y, k, mm if mm is not None else torch.zeros_like(mp), mk)
    assert bool(streamed.any()) == (v == 160) and not bool(streamed.all())
    tok, thr = topk_topp_sample(logits.to(DEV), seeds.to(DEV), pos.to(DEV), temp.to(DEV), k.to(DEV),
                                *(t.to(DEV) if t is not None else None for t in (pp, mm)), want_threshold=want_thr,
                                block=32, chunk=32, max_top_k=mk)
    tok = tok.cpu()
    assert torch.equal(tok, torch_path(logits, temp, seeds, pos, k, pp, mm))
    # The search passes (no max_top_k) implement the same rules independently.
    assert torch.equal(tok, topk_topp_sample(logits.to(DEV), seeds.to(DEV), pos.to(DEV), temp.to(DEV), k.to(DEV),
                                             *(t.to(DEV) if t is not None else None for t in (pp, mm)),
                                             block=32, chunk=32)[0].cpu())
    assert int(tok[4]) == 0
    for i in range(len(tok)):
        if i == 4:
            continue
        keep = ref_keep(y[i], int(k[i]), float(pp[i]) if pp is not None else 1.0,
                        float(mm[i]) if mm is not None else 0.0)
        assert keep[tok[i]], (i, tok[i])
        if want_thr:
            assert torch.equal(y[i] >= thr[i].cpu(), keep), i
    if want_thr:
        assert float(thr[4]) == float("-inf")


def test_kernel_frequencies_match_exact_probabilities():
    # 100 draws of one row (temperature 0.8, min_p 0.05, top_k 4, top_p 0.9: min-p drops token 2, top-k token 3,
    # top-p token 5), seeds fixed: a Pearson chi-square over the 3 kept tokens, 2 dof, bound 13.8 = the 0.1% tail
    # (a correct sampler fails it with probability 1e-3 over random seeds; with these fixed seeds the outcome is
    # deterministic). Tokens outside the kept set must never appear.
    n, row = 100, torch.tensor([1.0, 0.5, -2.5, -0.6, 1.6, -0.2])
    temp, k, p, mp = 0.8, 4, 0.9, 0.05
    probs = ref_probs(row / temp, k, p, mp)
    tok, _ = topk_topp_sample(row.expand(n, -1).contiguous().to(DEV), torch.full((n,), 11, device=DEV),
                              torch.arange(n, device=DEV), torch.full((n,), temp, device=DEV),
                              torch.full((n,), k, device=DEV), torch.full((n,), p, device=DEV),
                              torch.full((n,), mp, device=DEV), block=8, chunk=8)
    counts = torch.bincount(tok.cpu(), minlength=6).double()
    keep = probs > 0
    assert int(keep.sum()) == 3
    assert (counts[~keep] == 0).all(), counts
    exp = probs[keep] * n
    chi2 = float(((counts[keep] - exp) ** 2 / exp).sum())
    assert chi2 < 13.8, (chi2, counts, exp)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("sigma", [1.0, 4.0])
@pytest.mark.parametrize("select", [False, True])
def test_full_vocabulary_on_cuda_equals_the_torch_path_and_replays_in_a_graph(sigma, select):
    """select: top-k from torch.topk's k-th value (every k <= TOPK_SELECT_MAX); else the search passes."""
    b, v = 64, 151936
    g = torch.Generator(device="cuda").manual_seed(0)
    logits = (torch.randn(b, v, device="cuda", generator=g) * sigma).bfloat16()
    seeds, pos = torch.arange(b, device="cuda") * 31 - 7, torch.arange(b, device="cuda") + 5
    temp = torch.linspace(0.3, 1.5, b, device="cuda")
    k = torch.tensor(([0, 1, 20, 100, 256] if select else [0, 1, 20, 1000, 50000]) * 12 + [0] * 4, device="cuda")
    p = torch.linspace(0.05, 1.0, b, device="cuda")
    mp = torch.tensor([0.0, 0.05, 0.0, 0.2] * 16, device="cuda")
    mk = int(k.max()) if select else 0
    tok, thr = topk_topp_sample(logits, seeds, pos, temp, k, p, mp, want_threshold=True, max_top_k=mk)
    ref = torch_path(logits, temp, seeds, pos, k, p, mp)
    assert int((tok != ref).sum()) <= 1   # a top-p mass sum may round differently at a boundary, rarely
    y = logits.float() / temp[:, None]
    assert bool((y.gather(1, tok[:, None]) >= thr[:, None]).all())
    plain, _ = topk_topp_sample(logits, seeds, pos, temp, k, p, mp, max_top_k=mk)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured, _ = topk_topp_sample(logits, seeds, pos, temp, k, p, mp, max_top_k=mk)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, plain)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("step", [0.0, 1.0])
def test_select_path_on_cuda_with_long_ties(step):
    """Top-k from torch.topk's candidates at the real vocabulary, against the torch path, the search passes and a
    CUDA graph; step 1: integer logits, so the k-th value ties with tens to hundreds of others, often past the
    candidates (the full-row pass)."""
    b, v = 64, 151936
    g = torch.Generator(device="cuda").manual_seed(1)
    logits = torch.randn(b, v, device="cuda", generator=g) * 2
    if step:
        logits = (logits / step).round() * step
    logits = logits.bfloat16()
    seeds, pos = torch.arange(b, device="cuda") * 17 + 3, torch.arange(b, device="cuda") * 5
    temp = torch.linspace(0.5, 1.2, b, device="cuda")
    k = torch.tensor([1, 20, 20, 64, 256, 0, 20, 7] * 8, device="cuda")
    p = torch.tensor([0.95, 0.8, 0.95, 1.0, 0.5, 0.9, 0.999, 0.01] * 8, device="cuda")
    mp = torch.tensor([0.0, 0.0, 0.1, 0.0] * 16, device="cuda")
    mk = int(k.max())
    tok, thr = topk_topp_sample(logits, seeds, pos, temp, k, p, mp, want_threshold=True, max_top_k=mk)
    ref = torch_path(logits, temp, seeds, pos, k, p, mp)
    assert int((tok != ref).sum()) <= 1   # a top-p mass sum may round differently at a boundary, rarely
    search, _ = topk_topp_sample(logits, seeds, pos, temp, k, p, mp)
    assert int((tok != search).sum()) <= 1
    y = logits.float() / temp[:, None]
    assert bool((y.gather(1, tok[:, None]) >= thr[:, None]).all())
    only_k = (k > 0) & (mp == 0) & (p >= 1)   # top-k alone keeps k values and every tie of the k-th
    assert bool(((y >= thr[:, None]).sum(1)[only_k] >= k[only_k]).all())
    plain, _ = topk_topp_sample(logits, seeds, pos, temp, k, p, mp, max_top_k=mk)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured, _ = topk_topp_sample(logits, seeds, pos, temp, k, p, mp, max_top_k=mk)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, plain) and torch.equal(plain, tok)


_COMPILE = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from tokenmill.kernels import triton_topk_select as sel, triton_topk_topp as m
salts = dict(SALT_SEED=m.rng._SALT_SEED, SALT_POS=m.rng._SALT_POS, SALT_COL=m.rng._SALT_COL)
def build(fn, sig, cx, warps):
    sig = {**sig, **{name: "constexpr" for name in cx}}
    print(sorted(triton.compile(ASTSource(fn=fn, signature=sig, constexprs=cx), target=GPUTarget("cuda", 90, 32),
                                options={"num_warps": warps}).asm))
head = {"logits_ptr": "*bf16", "stride_b": "i32", "seeds_ptr": "*i64", "pos_ptr": "*i64", "temp_ptr": "*fp32"}
chunks = {"cmax_ptr": "*fp32", "cbest_ptr": "*fp32", "cidx_ptr": "*i32"}
build(m._chunks_kernel, {**head, "k_ptr": "*i64", **chunks, "V": "i32", "n_chunks": "i32"},
      dict(**salts, BLOCK=m._CHUNK, HAS_TEMP=True, SELECTED=True, PDL=1), 8)
split = {"smass_ptr": "*fp32", "sabove_ptr": "*fp32", "swin_ptr": "*fp32", "swidx_ptr": "*i32"}
build(m._split_kernel, {**head, "minp_ptr": "*fp32", "k_ptr": "*i64", **chunks, **split, "V": "i32",
                        "n_chunks": "i32", "draw": "i32"},
      dict(KEY_NEG_INF=m._KEY_NEG_INF, **salts, BLOCK=m._CHUNK, CHUNKS_P2=128, HAS_TEMP=True, HAS_MINP=True,
           SELECTED=True, PDL=1), 8)
rnd = {"pabove_ptr": "*fp32", "pwin_ptr": "*fp32", "pwidx_ptr": "*i32", "pstate_ptr": "*i32", "above_ptr": "*fp32",
       "win_ptr": "*fp32", "widx_ptr": "*i32", "state_ptr": "*i32"}
for first in (True, False):
    build(m._round_kernel, {**head, "p_ptr": "*fp32", "minp_ptr": "*fp32", "k_ptr": "*i64", **chunks,
                            "smass_ptr": "*fp32", **rnd, "out_ptr": "*i64", "V": "i32", "n_chunks": "i32"},
          dict(KEY_NEG_INF=m._KEY_NEG_INF, **salts, BLOCK=m._CHUNK, CHUNKS_P2=128, HAS_TEMP=True, HAS_MINP=True,
               FIRST=first, SELECTED=True, PDL=1), 8)
for want, has_split in ((False, False), (True, False), (False, True), (True, True)):
    build(m._topk_topp_kernel, {**head, "k_ptr": "*i64", "p_ptr": "*fp32", "minp_ptr": "*fp32", **chunks, **split,
                                "state_ptr": "*i32", "out_ptr": "*i64", "thr_ptr": "*fp32", "V": "i32",
                                "n_chunks": "i32", "rounds": "i32"},
          dict(KEY_NEG_INF=m._KEY_NEG_INF, **salts, BLOCK=m._BLOCK, NP=m._NP, CHUNKS_P2=128, HAS_TEMP=True,
               HAS_K=not has_split, HAS_P=True, HAS_MINP=True, WANT_THR=want, HAS_SPLIT=has_split,
               SELECTED=has_split, PDL=1), m._ROW_WARPS)
for want in (False, True):
    build(sel._select_kernel, {**head, "vals_ptr": "*bf16", "cols_ptr": "*i64", "W": "i32", "k_ptr": "*i64",
                               "p_ptr": "*fp32", "minp_ptr": "*fp32", "out_ptr": "*i64", "thr_ptr": "*fp32",
                               "V": "i32"},
          dict(**salts, W_P2=64, BLOCK=m._BLOCK, HAS_TEMP=True, HAS_P=True, HAS_MINP=True, WANT_THR=want, PDL=1), 4)
"""


def test_the_kernel_compiles_for_sm90():
    """The interpreter accepts code the compiler rejects: compile for an H100/H200 target too (on the CPU, in a
    process without the interpreter; where this triton cannot, the test says so and skips)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-c", _COMPILE], env=env, capture_output=True, text=True, timeout=300)
    if r.returncode != 0 and ("ImportError" in r.stderr or "ptxas" in r.stderr):
        pytest.skip(f"no sm_90 compile here: {r.stderr.strip().splitlines()[-1]}")
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.count("ttgir") == 10  # chunks, split, two rounds, four row programs and two select kernels


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_small_top_p_batch_also_compiles_the_round_kernels():
    """A batch under _ROUNDS_MIN_ROWS runs no round kernels; its first call samples a throwaway larger batch once,
    so the round kernels are compiled before a large batch needs them. The small batch's tokens are unchanged."""
    import tokenmill.kernels.triton_topk_topp as kernel
    b, v = 3, 151936
    g = torch.Generator(device="cuda").manual_seed(4)
    logits = (torch.randn(b, v, device="cuda", generator=g) * 2).bfloat16()
    seeds, pos = torch.arange(b, device="cuda") + 11, torch.arange(b, device="cuda")
    temp, p = torch.full((b,), 0.6, device="cuda"), torch.full((b,), 0.95, device="cuda")
    kernel._ROUNDS_COMPILED.clear()
    tok, _ = topk_topp_sample(logits, seeds, pos, temp, None, p)
    assert len(kernel._ROUNDS_COMPILED) == 1
    assert torch.equal(tok, torch_path(logits, temp, seeds, pos, None, p, None))
    again, _ = topk_topp_sample(logits, seeds, pos, temp, None, p)
    assert torch.equal(again, tok) and len(kernel._ROUNDS_COMPILED) == 1
