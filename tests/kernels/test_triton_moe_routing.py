"""The MoE routing kernels (kernels/triton_moe_routing.py) against their torch forms, interpreted on the CPU: the
router's softmax + top-k (+ renormalisation) against torch.softmax + torch.topk, and the one-program alignment
against triton_fused_moe._align (identical buffers: same rows, same sentinels, same block experts)."""
from __future__ import annotations

import pytest
import torch

from tests.kernels.kernel_check import DEV
from tokenmill.kernels.triton_fused_moe import _align
from tokenmill.kernels.triton_moe_routing import align_fits, align_small, topk_softmax


@pytest.mark.parametrize("t,e,k,renorm", [(1, 8, 2, True), (5, 60, 8, True), (3, 128, 8, False), (4, 6, 1, False)])
def test_topk_softmax_matches_torch(t, e, k, renorm):
    torch.manual_seed(t * e + k)
    logits = (torch.randn(t, e) * 3).to(DEV)
    w, ids = topk_softmax(logits, k, renorm, torch.float32)
    probs = torch.softmax(logits.float(), -1)
    want_w, want_ids = torch.topk(probs, k, -1)
    if renorm:
        want_w = want_w / want_w.sum(-1, keepdim=True)
    assert ids.dtype == torch.int32 and torch.equal(ids.long().cpu(), want_ids.cpu())
    torch.testing.assert_close(w.cpu(), want_w.cpu(), rtol=1e-6, atol=1e-7)


def test_topk_softmax_casts_and_breaks_ties_to_the_lower_id():
    logits = torch.tensor([[0.0, 2.0, 2.0, 1.0, 2.0]], dtype=torch.bfloat16).to(DEV)
    w, ids = topk_softmax(logits, 3, True, torch.bfloat16)
    assert ids.cpu().tolist() == [[1, 2, 4]] and w.dtype == torch.bfloat16
    torch.testing.assert_close(w.float().cpu(), torch.full((1, 3), 1 / 3), rtol=1e-2, atol=1e-3)


@pytest.mark.parametrize("t,e,k,bm", [(1, 128, 8, 16), (7, 8, 2, 16), (16, 64, 8, 16), (40, 4, 2, 32),
                                      (9, 8, 2, 16), (3, 512, 8, 16), (64, 2, 2, 64)])
def test_align_small_equals_the_sorted_layout(t, e, k, bm):
    torch.manual_seed(t + e)
    ids = torch.stack([torch.randperm(e)[:k] for _ in range(t)]).to(DEV, torch.int32)
    if t == 9:  # an empty expert and a crowded one
        ids = torch.tensor([[0, 1], [2, 4], [5, 6], [7, 0], [1, 2], [4, 5], [6, 7], [0, 2], [4, 1]],
                           dtype=torch.int32, device=DEV)
    assert align_fits(ids.numel(), e)
    rows, blocks = align_small(ids, e, bm)
    want_rows, want_blocks = _align(ids, e, bm)
    assert torch.equal(rows.cpu(), want_rows.cpu())
    assert torch.equal(blocks.cpu(), want_blocks.cpu())


def test_align_fits_bounds_the_one_program():
    assert align_fits(8, 128) and align_fits(512, 128) and align_fits(128, 512)
    assert not align_fits(513, 128) and not align_fits(0, 8)


def test_fused_moe_and_the_router_take_them_when_switched_on():
    from tokenmill import envs
    from tokenmill.kernels.triton_fused_moe import fused_moe, fused_moe_reference
    torch.manual_seed(5)
    t, e, k, h, i = 5, 16, 4, 40, 24
    x = torch.randn(t, h).to(DEV)
    w13, w2 = (torch.randn(e, 2 * i, h) / h ** 0.5).to(DEV), (torch.randn(e, h, i) / i ** 0.5).to(DEV)
    w, ids = topk_softmax(torch.randn(t, e).to(DEV), k, True, torch.float32)
    with envs.override(TOKENMILL_MOE_ROUTING_KERNELS=True):
        got = fused_moe(x, w13, w2, w, ids)
    torch.testing.assert_close(got.cpu(), fused_moe_reference(x, w13, w2, w, ids).cpu(), rtol=1e-5, atol=1e-5)
