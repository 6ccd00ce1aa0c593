"""Mixture-of-experts MLP: a softmax top-k router, the experts stacked into two tensors, an optional shared expert.

`SparseMoeBlock` is what a decoder layer calls in place of its dense MLP (Qwen2-MoE, Qwen3-MoE, Mixtral, Qwen3.5's
MoE sizes). Its routing follows HF's modeling code: router logits in the model dtype, softmax in fp32, the top k
probabilities, renormalised to sum to 1 where the family does (`norm_topk_prob`; Mixtral and Qwen3.5 always), then
cast to the model dtype except for Mixtral, which keeps them in fp32.

`FusedMoE` holds the experts as `w13_weight` [E, 2 I, H] (gate rows, then up rows, each as an nn.Linear weight)
and `w2_weight` [E, H, I]. On CUDA the experts run as two grouped Triton GEMMs without host synchronisation (so CUDA
graphs capture them, kernels/triton_fused_moe.py); on the CPU one product pair per expert present in the batch
(`experts_per_expert`). Under tensor parallelism every rank holds all experts with the intermediate dim split (like
a dense MLP's gate/up and down) and the partial outputs are summed with one all-reduce.

Checkpoints store experts either per expert (`experts.<e>.gate_proj.weight`, `up_proj`, `down_proj`; Mixtral's
`w1`, `w3`, `w2`) or fused as HF's modeling code holds them (`experts.gate_up_proj` [E, 2 I, H],
`experts.down_proj` [E, H, I]); `expert_param_target` maps both onto the stacked parameters and `WeightMapping`
consults it before its other rules.
"""
from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill import envs
from tokenmill.distributed import divide, get_parallel_state, get_tp_size
from tokenmill.distributed.communication_op import tensor_model_parallel_all_reduce
from tokenmill.layers.linear import MergedColumnParallelLinear, RowParallelLinear, default_weight_loader
from tokenmill.layers.quantization.base import QuantizationConfig

_PER_EXPERT = re.compile(r"\.experts\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w3|w2)\.weight$")
_FUSED = re.compile(r"\.experts\.(gate_up_proj|down_proj)(\.weight)?$")
_KIND = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up", "down_proj": "down", "w2": "down"}


def expert_param_target(name: str) -> tuple[str, tuple[int | None, str]] | None:
    """(stacked parameter name, (expert or None for all, "gate" / "up" / "down" / "gate_up")) for a checkpoint
    name of an expert weight; None for any other name."""
    m = _PER_EXPERT.search(name)
    if m is not None:
        kind = _KIND[m[2]]
        return name[:m.start()] + (".experts.w2_weight" if kind == "down" else ".experts.w13_weight"), \
            (int(m[1]), kind)
    m = _FUSED.search(name)
    if m is not None:
        if m[1] == "gate_up_proj":
            return name[:m.start()] + ".experts.w13_weight", (None, "gate_up")
        return name[:m.start()] + ".experts.w2_weight", (None, "down")
    return None


class FusedMoE(nn.Module):
    """The experts of one layer. forward(x [T, H], topk_weights [T, K], topk_ids [T, K]) -> [T, H], the routed sum
    of silu(x W1_e^T) * (x W3_e^T) W2_e^T over each row's K experts, summed over the tensor-parallel ranks.

    Contract: parameters `w13_weight` [E, 2 I / tp, H] and `w2_weight` [E, H, I / tp] load through
    `weight_loader(param, tensor, (expert, kind))` from per-expert or fused checkpoint tensors (see
    `expert_param_target`) or, with shard None, from the full stacked tensor (the dummy loader's form);
    `missing_experts()` names checkpoint tensors that never arrived."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int,
                 quant_config: QuantizationConfig | None, prefix: str) -> None:
        super().__init__()
        if quant_config is not None:
            raise ValueError(f"{prefix}: MoE experts with quantization {quant_config.name!r} are not supported yet; "
                             "serve this model unquantized (no --quantization, a bf16 / fp16 checkpoint).")
        self.parallel = get_parallel_state()
        self.num_experts, self.hidden_size, self.prefix = num_experts, hidden_size, prefix
        self.intermediate = intermediate_size
        self.i_rank = divide(intermediate_size, get_tp_size(), "moe_intermediate_size over the TP ranks")
        dtype = torch.get_default_dtype()
        self.w13_weight = nn.Parameter(torch.empty(num_experts, 2 * self.i_rank, hidden_size, dtype=dtype),
                                       requires_grad=False)
        self.w2_weight = nn.Parameter(torch.empty(num_experts, hidden_size, self.i_rank, dtype=dtype),
                                      requires_grad=False)
        self.w13_weight.full_shape = torch.Size((num_experts, 2 * intermediate_size, hidden_size))
        self.w2_weight.full_shape = torch.Size((num_experts, hidden_size, intermediate_size))
        for p in (self.w13_weight, self.w2_weight):
            p.weight_loader = self.weight_loader
        self._loaded: set[tuple[int, str]] = set()

    def _rank_slice(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        if t.shape[dim] != self.intermediate:
            raise ValueError(f"{self.prefix}: expert tensor of shape {tuple(t.shape)} has {t.shape[dim]} "
                             f"intermediate features, the config says {self.intermediate}.")
        return t.narrow(dim, self.parallel.tp_rank * self.i_rank, self.i_rank)

    def _copy(self, target: torch.Tensor, loaded: torch.Tensor) -> None:
        if target.shape != loaded.shape:
            raise ValueError(f"{self.prefix}: expert tensor slice of shape {tuple(loaded.shape)} does not fit "
                             f"{tuple(target.shape)}.")
        target.copy_(loaded)

    def weight_loader(self, param: torch.Tensor, loaded: torch.Tensor, shard=None) -> None:
        expert, kind = shard if shard is not None else (None, "gate_up" if param is self.w13_weight else "down")
        experts = range(self.num_experts) if expert is None else (expert,)
        if expert is not None and not 0 <= expert < self.num_experts:
            raise ValueError(f"{self.prefix}: expert {expert} is outside the config's {self.num_experts} experts.")
        dst = param.data if expert is None else param.data[expert]
        ir = self.i_rank
        if kind == "down":
            self._copy(dst, self._rank_slice(loaded, -1))
        elif kind == "gate_up":
            if loaded.shape[-2] != 2 * self.intermediate:
                raise ValueError(f"{self.prefix}: fused gate_up tensor of shape {tuple(loaded.shape)} needs "
                                 f"{2 * self.intermediate} rows.")
            gate, up = loaded.split(self.intermediate, dim=-2)
            self._copy(dst[..., :ir, :], self._rank_slice(gate, -2))
            self._copy(dst[..., ir:, :], self._rank_slice(up, -2))
        else:
            rows = slice(0, ir) if kind == "gate" else slice(ir, 2 * ir)
            self._copy(dst[rows], self._rank_slice(loaded, 0))
        parts = ("gate", "up") if kind == "gate_up" else (kind,)
        self._loaded.update((e, k) for e in experts for k in parts)

    def missing_experts(self) -> list[str]:
        """Checkpoint tensors (per-expert names) this layer never received."""
        return [f"{self.prefix}.{e}.{k}_proj.weight" for e in range(self.num_experts) for k in ("gate", "up", "down")
                if (e, k) not in self._loaded]

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        if x.is_cuda:
            from tokenmill.kernels.triton_fused_moe import fused_moe
            y = fused_moe(x, self.w13_weight, self.w2_weight, topk_weights, topk_ids)
        else:
            y = experts_per_expert(x, self.w13_weight, self.w2_weight, topk_weights, topk_ids)
        return tensor_model_parallel_all_reduce(y, self.parallel)


def experts_per_expert(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                       topk_ids: torch.Tensor) -> torch.Tensor:
    """The routed experts' sum (FusedMoE's contract) as one product pair per expert the batch routes to, in the
    weights' dtype as HF computes it: the assignments sorted by expert so each expert multiplies one contiguous
    slice of rows. Reads the routing on the host: the CPU path, not a CUDA-graph one."""
    t, k = topk_ids.shape
    inter = w13.shape[1] // 2
    flat = topk_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=w13.shape[0]).tolist()
    xs = x[order // k]
    rows = torch.empty(t * k, x.shape[1], dtype=x.dtype, device=x.device)
    start = 0
    for e, c in enumerate(counts):
        if c:
            gate_up = xs[start:start + c] @ w13[e].t()
            rows[start:start + c] = (F.silu(gate_up[:, :inter]) * gate_up[:, inter:]) @ w2[e].t()
            start += c
    scaled = torch.empty(t * k, x.shape[1], dtype=torch.promote_types(x.dtype, topk_weights.dtype),
                         device=x.device)
    scaled[order] = rows * topk_weights.reshape(-1)[order, None]
    return scaled.to(x.dtype).view(t, k, -1).sum(1)


class GatedMLP(nn.Module):
    """down(silu(gate) * up), tensor-parallel: a MoE block's shared expert (Qwen2-MoE, Qwen3.5-MoE) and Qwen3.5's
    dense MLP."""

    def __init__(self, hidden_size: int, intermediate_size: int, quant_config: QuantizationConfig | None,
                 prefix: str) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size] * 2,
                                                       quant_config=quant_config, prefix=f"{prefix}.gate_up_proj")
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, quant_config=quant_config,
                                           prefix=f"{prefix}.down_proj")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.gate_up_proj(x), act="silu_mul")


class SparseMoeBlock(nn.Module):
    """Router + experts (+ shared expert with its sigmoid gate). forward(x [T, H], already normalised) -> [T, H].

    renormalize: divide the top-k probabilities by their sum. fp32_weights: keep the routing weights in fp32
    (Mixtral) instead of casting them to the model dtype (Qwen)."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, intermediate_size: int, renormalize: bool,
                 quant_config: QuantizationConfig | None, prefix: str, shared_intermediate_size: int = 0,
                 fp32_weights: bool = False) -> None:
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"{prefix}: num_experts_per_tok must be in 1..{num_experts} (the number of experts), "
                             f"got {top_k}.")
        self.top_k, self.renormalize, self.fp32_weights = top_k, renormalize, fp32_weights
        self.gate = _Replicated(num_experts, hidden_size)
        self.experts = FusedMoE(num_experts, hidden_size, intermediate_size, quant_config, f"{prefix}.experts")
        self.shared_expert = self.shared_expert_gate = None
        if shared_intermediate_size:
            self.shared_expert = GatedMLP(hidden_size, shared_intermediate_size, quant_config,
                                                 f"{prefix}.shared_expert")
            self.shared_expert_gate = _Replicated(1, hidden_size)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(topk_weights [T, K], topk_ids [T, K]) as HF's router computes them."""
        logits = F.linear(x, self.gate.weight)
        out_dtype = torch.float32 if self.fp32_weights else logits.dtype
        if x.is_cuda and envs.TOKENMILL_MOE_ROUTING_KERNELS:
            from tokenmill.kernels.triton_moe_routing import topk_softmax
            return topk_softmax(logits, self.top_k, self.renormalize, out_dtype)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(out_dtype), ids

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.route(x)
        y = self.experts(x, weights, ids)
        if self.shared_expert is not None:
            y = y + torch.sigmoid(F.linear(x, self.shared_expert_gate.weight)) * self.shared_expert(x)
        return y


class _Replicated(nn.Module):
    """A bias-free weight [out, in] every rank holds whole (the router, the shared expert's gate)."""

    def __init__(self, out_features: int, in_features: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.weight.weight_loader = default_weight_loader
