"""layers/fused_moe.py: the CPU experts path and the Triton kernels (interpreted) against the fp32 oracle, the
router against HF's, and the expert weights' checkpoint forms (per expert, fused, a tensor-parallel rank's slice)."""
from __future__ import annotations

import pytest
import torch

from tokenmill.kernels.triton_fused_moe import fused_moe, fused_moe_reference
from tokenmill.layers.fused_moe import FusedMoE, SparseMoeBlock, expert_param_target, experts_per_expert


def _inputs(t: int, e: int, k: int, h: int, i: int, dtype=torch.float32, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, generator=g).to(dtype)
    w13 = (torch.randn(e, 2 * i, h, generator=g) / h ** 0.5).to(dtype)
    w2 = (torch.randn(e, h, i, generator=g) / i ** 0.5).to(dtype)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    w = torch.rand(t, k, generator=g)
    return x, w13, w2, w / w.sum(-1, keepdim=True), ids


@pytest.mark.parametrize("t,e,k", [(1, 4, 2), (9, 8, 3), (16, 3, 3)])
def test_cpu_path_and_kernels_match_the_oracle(t, e, k):
    x, w13, w2, w, ids = _inputs(t, e, k, 40, 24, seed=t)
    want = fused_moe_reference(x, w13, w2, w, ids)
    torch.testing.assert_close(experts_per_expert(x, w13, w2, w, ids), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fused_moe(x, w13, w2, w, ids), want, rtol=1e-5, atol=1e-5)


def test_cpu_path_in_bf16_keeps_the_dtype_and_stays_close():
    x, w13, w2, w, ids = _inputs(12, 6, 2, 64, 32, torch.bfloat16, seed=3)
    got = experts_per_expert(x, w13, w2, w.to(torch.bfloat16), ids)
    assert got.dtype == torch.bfloat16
    want = fused_moe_reference(x.float(), w13.float(), w2.float(), w, ids)
    torch.testing.assert_close(got.float(), want, rtol=3e-2, atol=3e-2)


def test_router_matches_hf():
    import transformers as tf
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter
    cfg = tf.Qwen3MoeConfig(hidden_size=32, num_experts=8, num_experts_per_tok=3, norm_topk_prob=True)
    torch.manual_seed(0)
    hf = Qwen3MoeTopKRouter(cfg)
    torch.nn.init.normal_(hf.weight)
    block = SparseMoeBlock(32, 8, 3, 16, True, None, "mlp")
    block.gate.weight.data.copy_(hf.weight)
    x = torch.randn(5, 32)
    _, hf_w, hf_ids = hf(x)
    w, ids = block.route(x)
    assert torch.equal(ids, hf_ids)
    torch.testing.assert_close(w, hf_w)


def test_checkpoint_names_map_onto_the_stacked_parameters():
    assert expert_param_target("model.layers.3.mlp.experts.17.up_proj.weight") == \
        ("model.layers.3.mlp.experts.w13_weight", (17, "up"))
    assert expert_param_target("model.layers.0.mlp.experts.2.w2.weight") == \
        ("model.layers.0.mlp.experts.w2_weight", (2, "down"))
    assert expert_param_target("model.layers.1.mlp.experts.gate_up_proj") == \
        ("model.layers.1.mlp.experts.w13_weight", (None, "gate_up"))
    assert expert_param_target("model.layers.1.mlp.shared_expert.gate_proj.weight") is None
    assert expert_param_target("model.layers.1.mlp.gate.weight") is None


def _load_per_expert(layer: FusedMoE, w13: torch.Tensor, w2: torch.Tensor) -> None:
    i = w13.shape[1] // 2
    for e in range(w13.shape[0]):
        layer.weight_loader(layer.w13_weight, w13[e, :i], (e, "gate"))
        layer.weight_loader(layer.w13_weight, w13[e, i:], (e, "up"))
        layer.weight_loader(layer.w2_weight, w2[e], (e, "down"))


def test_weight_forms_load_the_same_and_missing_experts_are_named():
    _, w13, w2, _, _ = _inputs(1, 3, 1, 8, 4)
    a = FusedMoE(3, 8, 4, None, "model.layers.0.mlp.experts")
    assert len(a.missing_experts()) == 9
    _load_per_expert(a, w13, w2)
    assert a.missing_experts() == []
    b = FusedMoE(3, 8, 4, None, "p")
    b.weight_loader(b.w13_weight, w13, (None, "gate_up"))
    b.weight_loader(b.w2_weight, w2, (None, "down"))
    assert torch.equal(a.w13_weight, w13) and torch.equal(b.w13_weight, w13) and torch.equal(b.w2_weight, w2)
    c = FusedMoE(3, 8, 4, None, "model.layers.0.mlp.experts")
    c.weight_loader(c.w13_weight, w13[1, :4], (1, "gate"))
    assert "model.layers.0.mlp.experts.1.up_proj.weight" in c.missing_experts()
    with pytest.raises(ValueError, match="expert 3 is outside"):
        c.weight_loader(c.w2_weight, w2[0], (3, "down"))
    with pytest.raises(ValueError, match="intermediate features"):
        c.weight_loader(c.w2_weight, w2[0, :, :3], (0, "down"))


def test_a_tensor_parallel_rank_takes_its_slice_of_every_expert(monkeypatch):
    """Rank 1 of 2 holds each expert's second half of the intermediate features, for gate and up alike."""
    from tokenmill.distributed.parallel_state import ParallelState
    from tokenmill.layers import fused_moe as mod
    _, w13, w2, _, _ = _inputs(1, 2, 1, 8, 6)
    state = ParallelState(world_size=2, rank=1, tp_size=2, tp_rank=1)
    monkeypatch.setattr(mod, "get_parallel_state", lambda: state)
    monkeypatch.setattr(mod, "get_tp_size", lambda: 2)
    layer = FusedMoE(2, 8, 6, None, "p")
    _load_per_expert(layer, w13, w2)
    assert torch.equal(layer.w13_weight, torch.cat([w13[:, 3:6], w13[:, 9:12]], dim=1))
    assert torch.equal(layer.w2_weight, w2[:, :, 3:])
