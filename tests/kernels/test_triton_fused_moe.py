"""The fused MoE kernels against the PyTorch reference and an independent per-token loop: odd H and I (every mask),
one token, empty experts, every token on one expert, int32 and int64 routing ids, several BLOCK_M sizes and K
steps. Under TRITON_INTERPRET=1 on the CPU; the `gpu` tests add bf16 at a real model's shape and a CUDA-graph
replay with new routing (the call must not synchronise with the host)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.kernels.kernel_check import DEV, INTERPRETED, rel_err
from tokenmill.kernels.triton_fused_moe import _align, fused_moe, fused_moe_reference, moe_tiles


def make_inputs(t, e, k, h, i, dtype=torch.float32, ids_dtype=torch.int64, seed=0, ids=None, device=DEV):
    torch.manual_seed(seed)
    x = torch.randn(t, h)
    w13 = torch.randn(e, 2 * i, h) / h ** 0.5
    w2 = torch.randn(e, h, i) / i ** 0.5
    if ids is None:  # k distinct experts per token, as a top-k router picks them
        ids = torch.stack([torch.randperm(e)[:k] for _ in range(t)]) if t else torch.empty(0, k, dtype=torch.int64)
    weights = torch.softmax(torch.randn(t, k), -1)
    return (x.to(device, dtype), w13.to(device, dtype), w2.to(device, dtype), weights.to(device),
            ids.to(device, ids_dtype))


def per_token_loop(x, w13, w2, topk_weights, topk_ids):
    """The definition, one (token, k) at a time in fp32."""
    inter = w13.shape[1] // 2
    y = torch.zeros(x.shape, dtype=torch.float32)
    for t in range(x.shape[0]):
        xt = x[t].float().cpu()
        for k in range(topk_ids.shape[1]):
            e = int(topk_ids[t, k])
            w1, w3 = w13[e, :inter].float().cpu(), w13[e, inter:].float().cpu()
            hid = F.silu(w1 @ xt) * (w3 @ xt)
            y[t] += float(topk_weights[t, k]) * (w2[e].float().cpu() @ hid)
    return y


CASES = [  # (name, T, E, K, H, I, ids dtype, forced ids or None)
    ("one token", 1, 4, 2, 32, 16, torch.int64, None),
    ("T=7 int32", 7, 8, 2, 40, 24, torch.int32, None),
    ("T=7 int64", 7, 8, 2, 40, 24, torch.int64, None),
    ("expert 3 empty", 9, 8, 2, 40, 24, torch.int32,
     torch.tensor([[0, 1], [2, 4], [5, 6], [7, 0], [1, 2], [4, 5], [6, 7], [0, 2], [4, 1]])),
    ("all on expert 5", 40, 8, 1, 40, 24, torch.int64, torch.full((40, 1), 5)),
    ("BLOCK_M 32, 2 K steps", 40, 4, 2, 80, 72, torch.int32, None),
    ("BLOCK_M 64, 2 N tiles", 64, 2, 2, 80, 72, torch.int64, None),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_fused_moe_fp32(case):
    _, t, e, k, h, i, ids_dtype, ids = case
    x, w13, w2, tw, tid = make_inputs(t, e, k, h, i, ids_dtype=ids_dtype, seed=t * 100 + e, ids=ids)
    got = fused_moe(x, w13, w2, tw, tid)
    assert got.shape == (t, h) and got.dtype == torch.float32
    ref = fused_moe_reference(x, w13, w2, tw, tid)
    torch.testing.assert_close(got.cpu(), ref.cpu(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got.cpu(), per_token_loop(x, w13, w2, tw, tid), rtol=1e-5, atol=1e-5)
    assert torch.equal(fused_moe(x, w13, w2, tw, tid), got)  # deterministic: no atomics, a fixed-order K-sum


@pytest.mark.parametrize("t, e, k", [(7, 8, 2), (40, 8, 1), (64, 2, 2), (1, 64, 8), (3, 4, 4)])
def test_align_layout(t, e, k):
    """Every assignment sits once, in its expert's block-aligned segment; blocks past the last segment are -1."""
    _, _, _, _, tid = make_inputs(t, e, k, 8, 8, seed=t + e, device="cpu")
    bm = moe_tiles(t * k, e)[0]
    row_ids, block_expert = _align(tid, e, bm)
    assert row_ids.numel() == block_expert.numel() * bm
    valid = row_ids < t * k
    assert sorted(row_ids[valid].tolist()) == list(range(t * k))
    row_expert = block_expert.long().repeat_interleave(bm)
    assert (row_expert[valid] == tid.reshape(-1).long()[row_ids[valid].long()]).all()
    used = block_expert >= 0
    n_used = int(used.sum())
    assert n_used == sum(-(-int((tid == x).sum()) // bm) for x in range(e))
    assert used[:n_used].all() and not used[n_used:].any()  # the used blocks first, in expert order
    assert (block_expert[1:n_used] >= block_expert[:n_used - 1]).all()
    assert (row_ids.view(-1, bm)[~used] == t * k).all()


@pytest.mark.parametrize("dtype, w_dtype", [(torch.bfloat16, torch.bfloat16), (torch.float16, torch.float32)])
def test_fused_moe_16bit(dtype, w_dtype):
    """16-bit activations and weights, routing weights in x's dtype or fp32; the intermediate rounds to x's dtype.
    (The interpreter gets fp32 dot operands and truncates bf16 stores, hence the loose bound.)"""
    x, w13, w2, tw, tid = make_inputs(7, 8, 2, 40, 24, dtype=dtype, seed=5)
    got = fused_moe(x, w13, w2, tw.to(w_dtype), tid)
    assert got.dtype == dtype
    assert rel_err(got, fused_moe_reference(x, w13, w2, tw, tid)) < 2e-2


def test_out_and_empty():
    x, w13, w2, tw, tid = make_inputs(5, 4, 2, 40, 24, seed=3)
    out = torch.full((5, 40), float("nan"), device=DEV)
    assert fused_moe(x, w13, w2, tw, tid, out=out) is out
    torch.testing.assert_close(out, fused_moe_reference(x, w13, w2, tw, tid), rtol=1e-5, atol=1e-5)
    x, w13, w2, tw, tid = make_inputs(0, 4, 2, 40, 24)
    assert fused_moe(x, w13, w2, tw, tid).shape == (0, 40)
    with pytest.raises(ValueError, match="do not fit"):
        fused_moe(x, w13[:, :, :32], w2, tw, tid)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fused_moe_bf16_model_shape():
    """Qwen3-30B-A3B's expert shape (E=64 of it here), 64 tokens routed to 8 experts each."""
    x, w13, w2, tw, tid = make_inputs(64, 64, 8, 2048, 768, dtype=torch.bfloat16, ids_dtype=torch.int32, seed=1)
    got = fused_moe(x, w13, w2, tw, tid)
    assert rel_err(got, fused_moe_reference(x, w13, w2, tw, tid)) < 1e-2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or INTERPRETED, reason="needs CUDA (compiled)")
@pytest.mark.parametrize("t", [1, 200])
def test_fused_moe_cuda_graph(t):
    """Captured once, replayed with new routing and new tokens: matches eager runs (a host sync would fail the
    capture; a size fixed from the first routing would give wrong results)."""
    x, w13, w2, tw, tid = make_inputs(t, 16, 4, 256, 128, dtype=torch.bfloat16, ids_dtype=torch.int32, seed=t)
    out = torch.empty_like(x)
    fused_moe(x, w13, w2, tw, tid, out=out)  # compiles outside the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fused_moe(x, w13, w2, tw, tid, out=out)
    for seed in range(3):
        x2, _, _, tw2, tid2 = make_inputs(t, 16, 4, 256, 128, dtype=torch.bfloat16, ids_dtype=torch.int32,
                                          seed=1000 + seed, ids=torch.randint(0, 16, (t, 4)) if seed == 2 else None)
        x.copy_(x2), tw.copy_(tw2), tid.copy_(tid2)
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, fused_moe(x, w13, w2, tw, tid))
