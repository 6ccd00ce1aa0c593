"""Qwen3.5 text (the hybrid of Qwen3-Next's line): Gated DeltaNet layers (layers/gated_deltanet.py) with a gated
full-attention layer every `full_attention_interval`-th layer (HF's config turns that into `layer_types`, which is
what is read here), a dense SiLU MLP after each, (1 + w) RMSNorms.

Full attention: q_proj gives per head a query and an output gate (head_dim each, interleaved per head); per-head
(1 + w) q / k norms; RoPE on the first partial_rotary_factor of each head (the multimodal RoPE sections coincide
for text positions, so plain RoPE is exact there); the attention output times sigmoid(gate) before o_proj.

Qwen3.5-MoE (`Qwen3_5Moe*`, a config with `num_experts`) is the same hybrid with layers/fused_moe.py's
SparseMoeBlock (routed experts plus a gated shared expert) as every layer's MLP.

`Qwen3_5ForConditionalGeneration` checkpoints run their text path: the language model loads under the text
model's names; the vision tower and the multi-token-prediction (MTP) head are skipped with one log line each.
"""
from __future__ import annotations

import re
from typing import Iterable

import torch
from torch import nn

from tokenmill.attention.layer import Attention
from tokenmill.core.kv_cache_spec import RecurrentStateSpec
from tokenmill.distributed import get_parallel_state
from tokenmill.layers.gated_deltanet import GatedDeltaNet, recurrent_state_bytes
from tokenmill.layers.fused_moe import FusedMoE, GatedMLP, SparseMoeBlock, expert_param_target
from tokenmill.layers.linear import QKVParallelLinear, RowParallelLinear
from tokenmill.layers.quantization.base import QuantizationConfig
from tokenmill.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from tokenmill.logger import init_logger
from tokenmill.models.gemma2 import GemmaRMSNorm
from tokenmill.models.llama import make_rotary, rope_long_switch
from tokenmill.models.weight_mapping import LLAMA_STACKED, WeightMapping, load_weights

logger = init_logger(__name__)

LINEAR, FULL = "linear_attention", "full_attention"


def layer_kinds(cfg) -> list[str]:
    """Each layer's kind: HF's `layer_types`, or every `full_attention_interval`-th layer full attention."""
    types = getattr(cfg, "layer_types", None)
    if types is None:
        every = getattr(cfg, "full_attention_interval", 4)
        types = [FULL if (i + 1) % every == 0 else LINEAR for i in range(cfg.num_hidden_layers)]
    unknown = sorted(set(types) - {LINEAR, FULL})
    if unknown or len(types) != cfg.num_hidden_layers:
        raise ValueError(f"Qwen3.5: layer_types must name {cfg.num_hidden_layers} layers of {LINEAR!r} / {FULL!r} "
                         f"(got {len(types)}, unknown {unknown}).")
    return list(types)


class Qwen3_5Attention(nn.Module):
    def __init__(self, cfg, layer_idx: int, rotary, backend_cls: type, quant_config, prefix: str) -> None:
        super().__init__()
        self.head_dim = hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        bias = bool(getattr(cfg, "attention_bias", False))
        # The q slot holds (query, gate) per head: 2 * heads "heads" of head_dim split over ranks keeps pairs whole.
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, hd, 2 * heads, kv_heads, bias=bias,
                                          quant_config=quant_config, prefix=f"{prefix}.qkv_proj")
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads // 2, self.qkv_proj.num_kv_heads
        self.o_proj = RowParallelLinear(heads * hd, cfg.hidden_size, bias=bias, quant_config=quant_config,
                                        prefix=f"{prefix}.o_proj")
        self.q_norm = GemmaRMSNorm(hd, cfg.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(hd, cfg.rms_norm_eps)
        self.rotary_emb = rotary
        self.attn = Attention(layer_idx, self.num_heads, hd, self.num_kv_heads, hd ** -0.5, backend_cls)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        t, hd = x.shape[0], self.head_dim
        qg, k, v = self.qkv_proj(x).split([2 * self.num_heads * hd, self.num_kv_heads * hd,
                                           self.num_kv_heads * hd], dim=-1)
        q, gate = qg.reshape(t, self.num_heads, 2 * hd).split([hd, hd], dim=-1)
        q = self.q_norm(q.contiguous()).reshape(t, -1)
        k = self.k_norm(k.reshape(t, self.num_kv_heads, hd)).reshape(t, -1)
        q, k = self.rotary_emb(positions, q, k)
        out = self.attn(q, k, v.contiguous())
        return self.o_proj(out * torch.sigmoid(gate.reshape(t, -1)))


class Qwen3_5DecoderLayer(nn.Module):
    def __init__(self, cfg, layer_idx: int, kind: str, rotary, backend_cls: type, quant_config, prefix: str):
        super().__init__()
        self.kind = kind
        if kind == LINEAR:
            self.linear_attn = GatedDeltaNet(cfg, layer_idx, quant_config, f"{prefix}.linear_attn")
        else:
            self.self_attn = Qwen3_5Attention(cfg, layer_idx, rotary, backend_cls, quant_config,
                                              f"{prefix}.self_attn")
        if getattr(cfg, "num_experts", 0):  # Qwen3.5-MoE: routed experts plus a gated shared expert, every layer
            self.mlp = SparseMoeBlock(cfg.hidden_size, cfg.num_experts, cfg.num_experts_per_tok,
                                      cfg.moe_intermediate_size, True, quant_config, f"{prefix}.mlp",
                                      shared_intermediate_size=cfg.shared_expert_intermediate_size)
        else:
            self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, quant_config, f"{prefix}.mlp")
        self.input_layernorm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, positions, hidden, residual):
        h, residual = (self.input_layernorm(hidden), hidden) if residual is None \
            else self.input_layernorm(hidden, residual)
        h = self.linear_attn(h) if self.kind == LINEAR else self.self_attn(positions, h)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


_VISION = r"^(model\.)?visual\."
_MTP = r"^mtp\."


class Qwen3_5ForCausalLM(nn.Module):
    """Decoder + LM head. Besides the usual `forward` / `compute_logits` / `load_weights` it tells the runner its
    layer kinds: `attention_layers` (those with a paged KV cache), `recurrent_state_shapes()` (per Gated DeltaNet
    layer, this rank's conv and delta-rule state shapes per request) and `state_specs()` for the memory
    profiler."""

    weight_mapping = WeightMapping(
        stacked={**LLAMA_STACKED, "in_proj_b": ("in_proj_ba", 0), "in_proj_a": ("in_proj_ba", 1)},
        renamed=(("model.language_model.", "model."),),
        skipped=(r"rotary_emb\.inv_freq$", _VISION, _MTP), resolver=expert_param_target)

    def __init__(self, hf_config, max_model_len: int, backend_cls: type,
                 quant_config: QuantizationConfig | None = None) -> None:
        super().__init__()
        cfg = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
        self.config = cfg
        if get_parallel_state().pp_size > 1:
            raise ValueError("Qwen3.5 (hybrid Gated DeltaNet) with pipeline_parallel_size > 1 is not supported yet.")
        self.kinds = layer_kinds(cfg)
        rotary = make_rotary(cfg, max_model_len)
        self.rope_long_switch = rope_long_switch(rotary)  # LongRoPE / dynamic NTK past the pretraining length
        self.model = nn.Module()
        self.model.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size)
        self.model.layers = nn.ModuleList(
            Qwen3_5DecoderLayer(cfg, i, kind, rotary, backend_cls, quant_config, f"model.layers.{i}")
            for i, kind in enumerate(self.kinds))
        self.model.norm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", False)
                                        or getattr(cfg, "tie_word_embeddings", False))
        self.lm_head = self.model.embed_tokens if self.tie_word_embeddings \
            else ParallelLMHead(cfg.vocab_size, cfg.hidden_size)
        self.attention_layers = [i for i, k in enumerate(self.kinds) if k == FULL]

    def recurrent_state_shapes(self) -> dict[int, tuple[tuple[int, ...], tuple[int, ...]]]:
        return {i: layer.linear_attn.state_shapes() for i, layer in enumerate(self.model.layers)
                if layer.kind == LINEAR}

    def state_specs(self) -> list[RecurrentStateSpec]:
        shapes = self.recurrent_state_shapes()
        dtype = self.model.embed_tokens.weight.dtype
        return [RecurrentStateSpec("gated_deltanet", recurrent_state_bytes(shapes, dtype), len(shapes))]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, intermediate=None) -> torch.Tensor:
        hidden, residual = self.model.embed_tokens(input_ids), None
        for layer in self.model.layers:
            hidden, residual = layer(positions, hidden, residual)
        hidden, _ = self.model.norm(hidden, residual)
        return hidden

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        return self.lm_head.compute_logits(hidden, out=out)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        vision, mtp = re.compile(_VISION), re.compile(_MTP)
        counts = {"vision": 0, "mtp": 0}

        def counted():
            for name, tensor in weights:
                key = "vision" if vision.search(name) else "mtp" if mtp.search(name) else None
                if key is not None:
                    counts[key] += 1
                    continue
                yield name, tensor

        loaded = load_weights(self, counted(), self.weight_mapping, self.tie_word_embeddings)
        missing = [n for m in self.modules() if isinstance(m, FusedMoE) for n in m.missing_experts()]
        if missing:
            raise ValueError(f"The checkpoint lacks {len(missing)} expert tensors, e.g. {missing[:3]}.")
        if counts["vision"]:
            logger.info("Qwen3.5: skipped %d vision-tower tensors (text input only: multimodal input is not "
                        "supported yet).", counts["vision"])
        if counts["mtp"]:
            logger.info("Qwen3.5: skipped %d multi-token-prediction (MTP) tensors (not used: speculative decoding "
                        "with the MTP head is not supported yet).", counts["mtp"])
        return loaded


class Qwen3_5ForConditionalGeneration(Qwen3_5ForCausalLM):
    """The text path of the multimodal checkpoint (text requests only)."""


class Qwen3_5MoeForCausalLM(Qwen3_5ForCausalLM):
    """Qwen3.5-MoE text (e.g. Qwen3.5-35B-A3B): the same hybrid with a SparseMoeBlock as every layer's MLP."""


class Qwen3_5MoeForConditionalGeneration(Qwen3_5ForCausalLM):
    """The text path of the multimodal MoE checkpoint (text requests only)."""
