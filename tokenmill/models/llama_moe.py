"""Mixture-of-experts decoders of the Llama family: Qwen2-MoE, Qwen3-MoE and Mixtral.

Each is its dense sibling in models/llama.py (attention, norms, RoPE, pipeline stages) with the MLP of its sparse
layers replaced by layers/fused_moe.py's `SparseMoeBlock` through the `make_mlp` seam:
- Qwen3-MoE: per-head q/k norms, no biases; top-k renormalised when `norm_topk_prob`; layers listed in
  `mlp_only_layers` or off the `decoder_sparse_step` grid keep a dense MLP of `intermediate_size`.
- Qwen2-MoE: q/k/v biases (`qkv_bias`), a shared expert with a sigmoid gate beside the routed ones, the same
  sparse-layer rules.
- Mixtral: Mistral's attention, every layer sparse, top-k always renormalised and kept in fp32; its checkpoints name
  the block `block_sparse_moe` and the experts' projections w1 / w3 / w2.
"""
from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from tokenmill.layers.fused_moe import FusedMoE, SparseMoeBlock, expert_param_target
from tokenmill.layers.layernorm import RMSNorm
from tokenmill.models.llama import LlamaForCausalLM, LlamaMLP
from tokenmill.models.weight_mapping import LLAMA_STACKED, WeightMapping, load_weights


class MoeMLP(SparseMoeBlock):
    """A sparse layer's MLP with LlamaMLP's interface: forward(x, residual, norm) -> (moe(norm(x + residual)),
    x + residual)."""

    def forward(self, x: torch.Tensor, residual: torch.Tensor, norm: RMSNorm) -> tuple[torch.Tensor, torch.Tensor]:
        h, residual = norm(x, residual)
        return super().forward(h), residual


def _is_sparse(cfg, layer_idx: int) -> bool:
    """HF's Qwen2-MoE / Qwen3-MoE rule for which layers route to experts."""
    step = getattr(cfg, "decoder_sparse_step", 1) or 1
    return (layer_idx not in (getattr(cfg, "mlp_only_layers", None) or []) and cfg.num_experts > 0
            and (layer_idx + 1) % step == 0)


class _MoeForCausalLM(LlamaForCausalLM):
    """Shared by the MoE families: the expert-aware weight mapping, no torch.compile on the CPU (the CPU experts
    loop over the experts a batch routes to), and a load that names any expert tensor the checkpoint lacks."""

    supports_torch_compile = False
    weight_mapping = WeightMapping(stacked=LLAMA_STACKED, skipped=(r"rotary_emb\.inv_freq$",),
                                   resolver=expert_param_target)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        loaded = super().load_weights(self._renamed(weights))
        missing = [n for m in self.modules() if isinstance(m, FusedMoE) for n in m.missing_experts()]
        if missing:
            raise ValueError(f"The checkpoint lacks {len(missing)} expert tensors, e.g. {missing[:3]}.")
        return loaded

    def _renamed(self, weights):
        return weights


class _QwenMoeForCausalLM(_MoeForCausalLM):
    """Qwen2-MoE and Qwen3-MoE: dense layers where `_is_sparse` says so, a shared expert where the config sizes
    one."""

    @staticmethod
    def make_mlp(cfg, layer_idx: int, quant_config, prefix: str) -> nn.Module:
        if not _is_sparse(cfg, layer_idx):
            return LlamaMLP(cfg, quant_config, prefix, bias=False)
        return MoeMLP(cfg.hidden_size, cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size,
                      bool(getattr(cfg, "norm_topk_prob", False)), quant_config, prefix,
                      shared_intermediate_size=getattr(cfg, "shared_expert_intermediate_size", 0) or 0)


class Qwen3MoeForCausalLM(_QwenMoeForCausalLM):
    qk_norm = True


class Qwen2MoeForCausalLM(_QwenMoeForCausalLM):
    @staticmethod
    def attention_biases(cfg) -> tuple[bool, bool]:
        return bool(getattr(cfg, "qkv_bias", True)), False


class MixtralForCausalLM(_MoeForCausalLM):
    @staticmethod
    def attention_biases(cfg) -> tuple[bool, bool]:
        return False, False

    @staticmethod
    def make_mlp(cfg, layer_idx: int, quant_config, prefix: str) -> nn.Module:
        return MoeMLP(cfg.hidden_size, cfg.num_local_experts, cfg.num_experts_per_tok,
                      cfg.intermediate_size, True, quant_config, prefix, fp32_weights=True)

    def _renamed(self, weights):
        for name, tensor in weights:
            yield name.replace(".block_sparse_moe.", ".mlp."), tensor
