"""Triton KV store, prefill and decode attention vs the torch reference backend, on fresh random paged batches.

On the CPU the kernels run in Triton's interpreter (tests/kernels/conftest.py sets TRITON_INTERPRET=1), so shapes are
tiny; the `gpu` variants run compiled with larger shapes and bf16."""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from tests.kernels.kernel_check import DEV, check_pdl_chain, rel_err  # noqa: E402
from tokenmill.attention.backend import AttentionMetadata  # noqa: E402
from tokenmill.attention.backends.torch_ref import TorchRefBackend  # noqa: E402
from tokenmill.attention.backends.triton_attn import TritonAttentionBackend  # noqa: E402
from tokenmill.kernels.triton_decode_attention import decode_attention  # noqa: E402
from tokenmill.kernels.triton_kv_store import store_kv  # noqa: E402
from tokenmill.kernels.triton_prefill_attention import prefill_attention  # noqa: E402

TOL = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 1e-2}


def make_batch(query_lens, ctx_lens, *, hq, hkv, d, block_size, dtype, seed, pad_rows=0, extra_blocks=3):
    """Random paged batch: request b has ctx_lens[b] cached positions (random K/V already in the cache) and
    query_lens[b] new tokens. Blocks are a random permutation of the pool, so tables are non-contiguous.
    pad_rows appends CUDA-graph style padding rows (query_len 1, seq_len 0, slot -1)."""
    g = torch.Generator().manual_seed(seed)
    query_lens = list(query_lens) + [1] * pad_rows
    ctx_lens = list(ctx_lens) + [0] * pad_rows
    seq_lens = [c + q for c, q in zip(ctx_lens, query_lens)]
    for i in range(len(seq_lens) - pad_rows, len(seq_lens)):
        seq_lens[i] = 0
    need = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(need) + extra_blocks
    perm = torch.randperm(num_blocks, generator=g)
    max_blocks = max(need + [1]) + 1
    # Unused entries point at random blocks (random data): a kernel that fails to mask them reads garbage.
    table = torch.randint(0, num_blocks, (len(seq_lens), max_blocks), generator=g, dtype=torch.int32)
    used = 0
    for b, n in enumerate(need):
        table[b, :n] = perm[used:used + n].to(torch.int32)
        used += n
    slots = []
    for b, (c, q) in enumerate(zip(ctx_lens, query_lens)):
        if b >= len(seq_lens) - pad_rows:
            slots.append(-1)
            continue
        for p in range(c, c + q):
            slots.append(int(table[b, p // block_size]) * block_size + p % block_size)
    t = sum(query_lens)
    qsl = torch.zeros(len(seq_lens) + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(torch.tensor(query_lens), 0)
    md = AttentionMetadata(
        num_actual_tokens=t,
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=DEV),
        query_start_loc=qsl.to(DEV),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=DEV),
        block_table=table.to(DEV),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        query_start_loc_cpu=qsl.numpy(),
        seq_lens_cpu=torch.tensor(seq_lens, dtype=torch.int32).numpy(),
    )
    kv_cache = torch.randn(2, num_blocks, block_size, hkv, d, generator=g).to(DEV, dtype)
    q = torch.randn(t, hq * d, generator=g).to(DEV, dtype)
    k = torch.randn(t, hkv * d, generator=g).to(DEV, dtype)
    v = torch.randn(t, hkv * d, generator=g).to(DEV, dtype)
    return md, kv_cache, q, k, v


def real_rows(md: AttentionMetadata, n: int) -> AttentionMetadata:
    """The metadata of the first n requests (drops padding rows, which the reference cannot take)."""
    t = int(md.query_start_loc_cpu[n])
    return AttentionMetadata(t, md.slot_mapping[:t], md.query_start_loc[:n + 1], md.seq_lens[:n],
                             md.block_table[:n], md.max_query_len, md.max_seq_len,
                             md.query_start_loc_cpu[:n + 1], md.seq_lens_cpu[:n])


def reference(md, kv_cache, q, k, v, hq, hkv, d, scale):
    """TorchRefBackend on float64 copies (the oracle). Returns (out, cache after the store)."""
    cache = kv_cache.double().clone()
    ref = TorchRefBackend(hq, d, hkv, scale)
    out = ref.forward(q.double(), k.double(), v.double(), cache, md)
    return out, cache


def check_backend(query_lens, ctx_lens, *, hq, hkv, d, block_size, dtype, seed, pad_rows=0, splits=None):
    md, kv_cache, q, k, v = make_batch(query_lens, ctx_lens, hq=hq, hkv=hkv, d=d, block_size=block_size,
                                       dtype=dtype, seed=seed, pad_rows=pad_rows)
    scale = d ** -0.5
    ref_md = real_rows(md, len(query_lens)) if pad_rows else md
    ref_out, ref_cache = reference(ref_md, kv_cache, q, k, v, hq, hkv, d, scale)
    be = TritonAttentionBackend(hq, d, hkv, scale)
    be.decode_num_splits = splits
    cache = kv_cache.clone()
    out = be.forward(q, k, v, cache, md)
    assert torch.equal(cache.double(), ref_cache.to(cache.dtype).double()), "KV cache differs after the store"
    n_real = len(query_lens) if pad_rows else None
    real_t = int(md.query_start_loc_cpu[n_real]) if pad_rows else md.num_actual_tokens
    err = rel_err(out[:real_t], ref_out[:real_t])
    assert err < TOL[dtype], f"rel err {err:.2e}"
    if pad_rows:
        assert torch.equal(out[real_t:], torch.zeros_like(out[real_t:])), "padding rows must be zeros"


def captured_mixed_layout(md: AttentionMetadata, size: int, reqs: int, extra_blocks: int = 2) -> AttentionMetadata:
    """md laid out as a mixed CUDA graph of `size` tokens and `reqs` requests sees it (worker/cuda_graph.py): the
    padding helper's buffers, a block table with spare columns of junk, and no host copies to plan from."""
    from tokenmill.worker.cuda_graph import pad_mixed_inputs
    n, t = md.seq_lens.shape[0], md.num_actual_tokens
    zeros = np.zeros(t, dtype=np.int64)
    vec, ints, _ = pad_mixed_inputs(size, reqs, zeros, zeros, md.slot_mapping.cpu().numpy(),
                                    md.query_start_loc_cpu, md.seq_lens_cpu)
    ints_t = torch.from_numpy(ints).to(DEV)
    nb = md.block_table.shape[1]
    table = torch.randint(0, 3, (reqs, nb + extra_blocks), dtype=torch.int32).to(DEV)
    table[:n, :nb] = md.block_table
    return AttentionMetadata(size, torch.from_numpy(vec[2]).to(DEV), ints_t[:reqs + 1], ints_t[reqs + 1:],
                             table, size, 4096, np.zeros(reqs + 1, dtype=np.int64), np.zeros(reqs, dtype=np.int64),
                             captured_mixed=True)


@pytest.mark.parametrize("case", [0, 1, 2])
def test_backend_captured_mixed_layout(case):
    """A mixed batch padded to a graph's capacity (extra tokens with slot -1, extra requests with no query) gives the
    real rows the unpadded result, stores nothing for the padding, and plans without the host copies."""
    ql, ctx, hq, hkv, d, bs, dtype = MIXED[case]
    md, kv_cache, q, k, v = make_batch(ql, ctx, hq=hq, hkv=hkv, d=d, block_size=bs, dtype=dtype, seed=500 + case)
    t, scale = md.num_actual_tokens, d ** -0.5
    size, reqs = t + 7, len(ql) + 3
    pad = lambda x: torch.cat([x, torch.randn(size - t, x.shape[1], dtype=x.dtype).to(DEV)])
    ref_out, ref_cache = reference(md, kv_cache, q, k, v, hq, hkv, d, scale)
    be = TritonAttentionBackend(hq, d, hkv, scale)
    be.decode_num_splits = 2
    cache = kv_cache.clone()
    out = be.forward(pad(q), pad(k), pad(v), cache, captured_mixed_layout(md, size, reqs))
    assert out.shape[0] == size
    assert torch.equal(cache.double(), ref_cache.to(cache.dtype).double()), "padding tokens must store nothing"
    err = rel_err(out[:t], ref_out)
    assert err < TOL[dtype], f"rel err {err:.2e}"


def test_pad_mixed_inputs():
    from tokenmill.worker.cuda_graph import pad_mixed_inputs
    qsl, lens = np.array([0, 3, 4, 9]), np.array([10, 5, 5])
    vec, ints, last = pad_mixed_inputs(12, 5, np.arange(9) + 100, np.arange(9), np.arange(9) + 50, qsl, lens)
    assert vec.shape == (3, 12) and list(vec[2, 9:]) == [-1, -1, -1] and list(vec[0, :9]) == list(range(100, 109))
    assert list(ints[:6]) == [0, 3, 4, 9, 9, 9] and list(ints[6:]) == [10, 5, 5, 0, 0]
    assert list(last) == [2, 3, 8, 0, 0]


# ------------------------------------------------------------------------------------------------------- KV store
def test_store_kv_skips_negative_slots():
    torch.manual_seed(0)
    n, bs, h, d, t = 5, 8, 2, 32, 9
    cache = torch.randn(2, n, bs, h, d, device=DEV)
    before = cache.clone()
    slots = torch.randperm(n * bs)[:t].to(DEV)
    slots[[2, 5]] = -1
    k = torch.randn(t, h, d, device=DEV)
    qkv = torch.randn(t, 3 * h * d, device=DEV)           # v as a strided view of a fused projection
    v = qkv[:, 2 * h * d:].view(t, h, d)
    store_kv(k, v, cache, slots)
    exp = before.clone().view(2, n * bs, h, d)
    keep = slots >= 0
    exp[0, slots[keep]] = k[keep]
    exp[1, slots[keep]] = v[keep]
    assert torch.equal(cache, exp.view_as(cache))


def test_store_kv_casts_to_cache_dtype():
    torch.manual_seed(1)
    n, bs, h, d, t = 3, 16, 1, 64, 4
    cache = torch.zeros(2, n, bs, h, d, dtype=torch.float16, device=DEV)
    slots = torch.tensor([0, 17, 33, 47], device=DEV)
    k, v = torch.randn(t, h * d, device=DEV), torch.randn(t, h * d, device=DEV)
    store_kv(k, v, cache, slots)
    flat = cache.view(2, -1, h, d)
    assert torch.equal(flat[0, slots], k.view(t, h, d).half())
    assert torch.equal(flat[1, slots], v.view(t, h, d).half())


# -------------------------------------------------------------------------------------------------------- backend
# Mixed ragged batches: query lens 1, 3, 17, 33 with prefix-cached contexts crossing block boundaries.
MIXED = [
    # (query_lens, ctx_lens, hq, hkv, d, block_size, dtype)
    ([3, 1, 17, 1, 33], [0, 9, 5, 0, 14], 2, 2, 64, 16, torch.float32),        # GQA 1
    ([17, 1, 3], [16, 31, 7], 4, 2, 64, 8, torch.float32),                   # GQA 2, block 8
    ([1, 33, 3], [40, 0, 23], 4, 1, 128, 16, torch.float16),                  # GQA 4, D 128, fp16
    ([3, 1, 17], [5, 20, 0], 4, 2, 16, 16, torch.float32),                    # D 16 (the tiny test models)
    ([1, 9], [33, 8], 8, 2, 32, 8, torch.float16),                            # D 32
]


@pytest.mark.parametrize("case", range(len(MIXED)))
def test_backend_mixed_batch(case):
    ql, ctx, hq, hkv, d, bs, dtype = MIXED[case]
    check_backend(ql, ctx, hq=hq, hkv=hkv, d=d, block_size=bs, dtype=dtype, seed=100 + case)


def test_backend_pure_decode_split_and_padding():
    """Pure decode (the CUDA-graph shape): several splits, contexts crossing blocks, padded rows -> zeros."""
    check_backend([1, 1, 1], [37, 5, 64], hq=4, hkv=2, d=64, block_size=16, dtype=torch.float32, seed=7,
                  pad_rows=2, splits=4)


def test_backend_pure_prefill_and_empty_rows():
    """No decode rows (the prefill kernel alone, skip_single off) with a query_len-0 row in the batch."""
    check_backend([33, 0, 3], [0, 12, 15], hq=4, hkv=4, d=64, block_size=16, dtype=torch.float32, seed=8)


def _sweep_cases(n, seed):
    g = torch.Generator().manual_seed(seed)
    cases = []
    combos = [(hq, hkv, d, bs, dt) for hkv, grp in ((2, 1), (2, 2), (1, 4)) for hq in (hkv * grp,)
              for d in (64, 128) for bs in (8, 16) for dt in (torch.float32, torch.float16)]
    pick = torch.randperm(len(combos), generator=g)[:n]
    for i in pick.tolist():
        nreq = int(torch.randint(1, 5, (1,), generator=g))
        ql = [(1, 3, 17, 33)[int(j)] for j in torch.randint(0, 4, (nreq,), generator=g)]
        ctx = [int(c) for c in torch.randint(0, 45, (nreq,), generator=g)]
        cases.append((ql, ctx) + combos[i])
    return cases


SWEEP = _sweep_cases(10, seed=2024)


@pytest.mark.parametrize("case", range(len(SWEEP)))
def test_backend_random_sweep(case):
    """Random ragged batches over GQA 1/2/4, head 64/128, block 8/16, fp32/fp16 (a fixed random subset)."""
    ql, ctx, hq, hkv, d, bs, dtype = SWEEP[case]
    check_backend(ql, ctx, hq=hq, hkv=hkv, d=d, block_size=bs, dtype=dtype, seed=300 + case)


@pytest.mark.parametrize("splits", [1, 2, 8])
def test_decode_splits(splits):
    """Split counts incl. more splits than a short row can use (unused splits are skipped in both stages)."""
    check_backend([1, 1, 1, 1], [0, 15, 16, 70], hq=8, hkv=2, d=128, block_size=16, dtype=torch.float32,
                  seed=40 + splits, splits=splits)


# ------------------------------------------------------------------------------------- kernels, poisoned outputs
def test_prefill_kernel_small_tiles_and_odd_head():
    """Small tiles (several query tiles per request, many key tiles), G=3 (non power of two) and head size 96
    (padded to 128 inside); the output is NaN-poisoned and every query row must be written."""
    ql, ctx, hq, hkv, d, bs = [3, 1, 17, 5], [7, 0, 20, 0], 6, 2, 96, 8
    md, kv_cache, q, k, v = make_batch(ql, ctx, hq=hq, hkv=hkv, d=d, block_size=bs, dtype=torch.float32, seed=11)
    scale = 0.3
    ref_out, ref_cache = reference(md, kv_cache, q, k, v, hq, hkv, d, scale)
    cache = ref_cache.float()
    t = md.num_actual_tokens
    out = torch.full((t, hq, d), float("nan"), device=DEV)
    prefill_attention(q.view(t, hq, d), cache[0], cache[1], out, md.query_start_loc, md.seq_lens, md.block_table,
                      scale, num_tokens=t, block_m=16, block_n=16)
    assert rel_err(out.view(t, -1), ref_out) < TOL[torch.float32]


def test_decode_kernel_skips_prefill_rows():
    """Decode kernel alone on a mixed batch: it must write exactly the query_len-1 rows (others stay NaN)."""
    ql, ctx, hq, hkv, d, bs = [1, 4, 1, 1], [50, 3, 0, 17], 8, 2, 64, 16
    md, kv_cache, q, k, v = make_batch(ql, ctx, hq=hq, hkv=hkv, d=d, block_size=bs, dtype=torch.float32, seed=12)
    ref_out, ref_cache = reference(md, kv_cache, q, k, v, hq, hkv, d, 0.125)
    cache = ref_cache.float()
    t = md.num_actual_tokens
    out = torch.full((t, hq, d), float("nan"), device=DEV)
    decode_attention(q.view(t, hq, d), cache[0], cache[1], out, md.query_start_loc, md.seq_lens, md.block_table,
                     0.125, num_splits=2, block_n=16)
    qsl = md.query_start_loc_cpu
    dec_tok = [int(qsl[b]) for b in range(len(ql)) if ql[b] == 1]
    other = [i for i in range(t) if i not in dec_tok]
    out = out.view(t, -1)
    assert rel_err(out[dec_tok], ref_out[dec_tok]) < TOL[torch.float32]
    assert out[other].isnan().all()


# ------------------------------------------------------------------------------------------------------------ GPU
GPU_CASES = [
    # (query_lens, ctx_lens, hq, hkv, d, block_size, dtype, splits)
    ([1, 3, 17, 33, 1, 200, 1], [0, 100, 17, 250, 1000, 0, 4095], 32, 8, 128, 16, torch.bfloat16, None),
    ([1, 3, 17, 33, 1, 129], [77, 100, 17, 250, 3000, 64], 16, 16, 64, 16, torch.bfloat16, None),
    ([512, 1, 1], [1024, 2000, 9], 28, 4, 128, 16, torch.float16, None),               # G = 7
    ([1] * 64, [i * 37 % 3000 for i in range(64)], 32, 8, 128, 16, torch.bfloat16, 8),
    ([1] * 96, [101 + i * 53 % 1944 for i in range(96)], 16, 8, 128, 16, torch.bfloat16, None),  # 128-key tiles
    ([1] * 70, [i * 29 % 700 for i in range(70)], 16, 4, 128, 16, torch.float16, 2),
    ([1] * 5, [8191, 100, 4000, 1, 0], 16, 2, 256, 16, torch.bfloat16, 16),
    ([40, 1, 7], [30, 600, 0], 12, 4, 96, 32, torch.bfloat16, None),
    ([1, 17, 33], [300, 20, 40], 8, 4, 64, 16, torch.float32, None),
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", range(len(GPU_CASES)))
def test_backend_gpu(case):
    ql, ctx, hq, hkv, d, bs, dtype, splits = GPU_CASES[case]
    for seed in range(3):
        check_backend(ql, ctx, hq=hq, hkv=hkv, d=d, block_size=bs, dtype=dtype, seed=1000 * case + seed,
                      splits=splits, pad_rows=3 if all(x == 1 for x in ql) else 0)


@pytest.mark.gpu
def test_store_kv_gpu_bf16():
    torch.manual_seed(2)
    n, bs, h, d, t = 300, 16, 8, 128, 1000
    cache = torch.randn(2, n, bs, h, d, dtype=torch.bfloat16, device=DEV)
    before = cache.clone()
    slots = torch.randperm(n * bs, device=DEV)[:t]
    slots[::7] = -1
    k = torch.randn(t, h, d, dtype=torch.bfloat16, device=DEV)
    v = torch.randn(t, h, d, dtype=torch.bfloat16, device=DEV)
    store_kv(k, v, cache, slots)
    exp = before.view(2, n * bs, h, d)
    keep = slots >= 0
    exp[0, slots[keep]] = k[keep]
    exp[1, slots[keep]] = v[keep]
    assert torch.equal(cache, exp.view_as(cache))


@pytest.mark.gpu
def test_decode_gpu_pdl_chain_in_graph():
    """A chain of decode launches (each layer reads the previous output as its query, as a forward does) captured
    in a CUDA graph with programmatic dependent launch: bit-identical to the chain in plain stream order, on every
    replay."""
    from tokenmill.kernels import pdl
    if not pdl.pdl_enabled(torch.device(DEV)):
        pytest.skip("programmatic dependent launch needs compute capability 9.0+")
    ql = [1] * 9
    ctx = [0, 5, 63, 64, 65, 700, 1500, 2047, 300]
    hq, hkv, d, bs = 16, 8, 128, 16
    md, kv_cache, q, k, v = make_batch(ql, ctx, hq=hq, hkv=hkv, d=d, block_size=bs, dtype=torch.bfloat16,
                                       seed=21, pad_rows=3)
    cache = kv_cache.clone()
    store_kv(k.view(-1, hkv, d), v.view(-1, hkv, d), cache, md.slot_mapping)
    t = md.num_actual_tokens
    q0 = q.view(t, hq, d).clone()

    def chain() -> torch.Tensor:
        x = q0
        for _ in range(6):
            out = torch.empty_like(x)
            decode_attention(x, cache[0], cache[1], out, md.query_start_loc, md.seq_lens, md.block_table,
                             d ** -0.5, num_splits=8)
            x = out
        return x

    check_pdl_chain(chain)


def test_decode_num_splits_aims_at_one_tile_per_split(monkeypatch):
    """Small batches get a split per 64-key tile of max_seq_len (up to 32, and a power of two); large batches
    still get only enough programs to fill the GPU about twice."""
    from tokenmill.kernels import triton_decode_attention as tda
    monkeypatch.setattr(tda, "_num_sms", lambda index: 132)
    gpu = torch.device("cuda", 0)            # only its SM count is read, patched above
    assert tda.decode_num_splits(1, 8, 2048, gpu) == 32
    assert tda.decode_num_splits(1, 8, 300, gpu) == 8          # 5 tiles, rounded up to a power of two
    assert tda.decode_num_splits(1, 8, 64, gpu) == 1
    assert tda.decode_num_splits(1, 8, 2048, gpu, block_n=32) == 32
    assert tda.decode_num_splits(1, 8, 2048, gpu, min_keys_per_split=256) == 8
    assert tda.decode_num_splits(16, 8, 2048, gpu) == 4         # 3 wanted to fill 132 SMs twice
    assert tda.decode_num_splits(256, 8, 2048, gpu) == 1
    assert tda.decode_num_splits(0, 8, 2048, gpu) == 1
