"""Gemma 2: alternating sliding-window and global attention layers, tanh soft-capping of attention scores and final
logits, the (1 + w) RMSNorm, norms after attention and after the MLP as well as before, GELU(tanh) MLP, embeddings
scaled by sqrt(hidden_size), queries scaled by query_pre_attn_scalar ** -0.5, tied embeddings.

The pieces here (norm, MLP, attention, decoder layer and stack) are Gemma 3's too (models/gemma3.py adds per-head
q/k norms and a RoPE base per layer kind). Each layer's window comes from core/kv_cache_spec.layer_sliding_windows,
the function the KV cache manager groups layers by.
"""
from __future__ import annotations

from typing import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.attention.layer import Attention
from tokenmill.core.kv_cache_spec import layer_sliding_windows
from tokenmill.distributed import get_parallel_state
from tokenmill.distributed.pp import IntermediateTensors, PPMissingLayer, pp_layer_range
from tokenmill.layers.activation import gated_activation
from tokenmill.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from tokenmill.layers.quantization.base import QuantizationConfig
from tokenmill.layers.rotary import RotaryEmbedding
from tokenmill.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from tokenmill.models.llama import make_rotary, rope_long_switch
from tokenmill.models.weight_mapping import LLAMA_STACKED, WeightMapping, load_weights


class GemmaRMSNorm(nn.Module):
    """RMSNorm scaling by (1 + weight), computed in fp32 and cast back after the scale (HF's Gemma order).
    `forward(x, residual)` returns (norm(x + residual), x + residual) like layers/layernorm.RMSNorm."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(hidden_size))
        self.eps = eps

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * (1.0 + self.weight.float())).to(x.dtype)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if x.is_cuda:  # one fused kernel instead of ~10 elementwise launches
            from tokenmill.kernels.triton_norm_rope_act import rms_norm
            return rms_norm(x, self.weight, self.eps, residual, gemma=True)
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x


class GemmaMLP(nn.Module):
    def __init__(self, cfg, quant_config: QuantizationConfig | None, prefix: str) -> None:
        super().__init__()
        act = getattr(cfg, "hidden_activation", None) or getattr(cfg, "hidden_act", "gelu_pytorch_tanh")
        # HF's Gemma applies ACT2FN[hidden_activation]; the released checkpoints' tanh GELU stays inline.
        self.act_fn = None if act in ("gelu_pytorch_tanh", "gelu_tanh") else gated_activation(act)
        self.gate_up_proj = MergedColumnParallelLinear(cfg.hidden_size, [cfg.intermediate_size] * 2, bias=False,
                                                       quant_config=quant_config, prefix=f"{prefix}.gate_up_proj")
        self.down_proj = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size, bias=False,
                                           quant_config=quant_config, prefix=f"{prefix}.down_proj")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        act = F.gelu(gate, approximate="tanh") if self.act_fn is None else self.act_fn(gate)
        return self.down_proj(act * up)


class GemmaAttention(nn.Module):
    """q/k/v -> (optional per-head (1 + w) norms of q and k) -> RoPE -> paged attention (windowed on sliding
    layers, scores soft-capped when the config says so) -> o_proj."""

    def __init__(self, cfg, layer_idx: int, rotary_emb: RotaryEmbedding, backend_cls: type, qk_norm: bool,
                 quant_config: QuantizationConfig | None, prefix: str, attn_soft_cap: float | None) -> None:
        super().__init__()
        total_heads = cfg.num_attention_heads
        total_kv_heads = getattr(cfg, "num_key_value_heads", None) or total_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // total_heads
        bias = bool(getattr(cfg, "attention_bias", False))
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, self.head_dim, total_heads, total_kv_heads, bias=bias,
                                          quant_config=quant_config, prefix=f"{prefix}.qkv_proj")
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.o_proj = RowParallelLinear(total_heads * self.head_dim, cfg.hidden_size, bias=bias,
                                        quant_config=quant_config, prefix=f"{prefix}.o_proj")
        self.rotary_emb = rotary_emb
        if qk_norm:
            self.q_norm = GemmaRMSNorm(self.head_dim, cfg.rms_norm_eps)
            self.k_norm = GemmaRMSNorm(self.head_dim, cfg.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None
        self.attn = Attention(layer_idx, self.num_heads, self.head_dim, self.num_kv_heads,
                              float(cfg.query_pre_attn_scalar) ** -0.5, backend_cls,
                              sliding_window=layer_sliding_windows(cfg)[layer_idx],
                              logits_soft_cap=attn_soft_cap)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.q_norm is not None:
            t = q.shape[0]
            q = self.q_norm(q.reshape(t, self.num_heads, self.head_dim)).reshape(t, self.q_size)
            k = self.k_norm(k.reshape(t, self.num_kv_heads, self.head_dim)).reshape(t, self.kv_size)
        q, k = self.rotary_emb(positions, q.contiguous(), k.contiguous())
        return self.o_proj(self.attn(q, k, v.contiguous()))


class GemmaDecoderLayer(nn.Module):
    """h + post_ff(mlp(pre_ff(h + post_attn(attn(in(h)))))), carried as (output, residual) pairs so each residual
    add rides in the next norm."""

    def __init__(self, cfg, layer_idx: int, rotary_emb: RotaryEmbedding, backend_cls: type, qk_norm: bool,
                 quant_config: QuantizationConfig | None, prefix: str, attn_soft_cap: float | None) -> None:
        super().__init__()
        self.self_attn = GemmaAttention(cfg, layer_idx, rotary_emb, backend_cls, qk_norm, quant_config,
                                        f"{prefix}.self_attn", attn_soft_cap)
        self.mlp = GemmaMLP(cfg, quant_config, f"{prefix}.mlp")
        eps = cfg.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(cfg.hidden_size, eps)
        self.post_attention_layernorm = GemmaRMSNorm(cfg.hidden_size, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(cfg.hidden_size, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(cfg.hidden_size, eps)

    def forward(self, positions, hidden, residual):
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.post_attention_layernorm(self.self_attn(positions, hidden))
        hidden, residual = self.pre_feedforward_layernorm(hidden, residual)
        return self.post_feedforward_layernorm(self.mlp(hidden)), residual


class GemmaModel(nn.Module):
    """The decoder stack (pipeline stages as models/llama.LlamaModel). `rotary_for(i)` gives layer i's RoPE table;
    attention scores are soft-capped at `attn_soft_cap` when it is set."""

    def __init__(self, cfg, rotary_for, backend_cls: type, qk_norm: bool,
                 quant_config: QuantizationConfig | None = None, prefix: str = "model",
                 attn_soft_cap: float | None = None) -> None:
        super().__init__()
        pp = get_parallel_state()
        self.is_first, self.is_last = pp.pp_rank == 0, pp.pp_rank == pp.pp_size - 1
        self.start, self.end = pp_layer_range(cfg.num_hidden_layers, pp.pp_rank, pp.pp_size)
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size) if self.is_first \
            else PPMissingLayer()
        self.embed_scale = float(cfg.hidden_size) ** 0.5
        self.layers = nn.ModuleList(
            GemmaDecoderLayer(cfg, i, rotary_for(i), backend_cls, qk_norm, quant_config, f"{prefix}.layers.{i}",
                              attn_soft_cap)
            if self.start <= i < self.end else PPMissingLayer() for i in range(cfg.num_hidden_layers))
        self.norm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps) if self.is_last else PPMissingLayer()
        self._own_layers = tuple(self.layers[self.start:self.end])

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                intermediate: IntermediateTensors | None = None) -> torch.Tensor | IntermediateTensors:
        if self.is_first:
            hidden = self.embed_tokens(input_ids)
            # HF multiplies by the scale rounded to the activation dtype.
            hidden, residual = hidden * torch.tensor(self.embed_scale, dtype=hidden.dtype), None
        else:
            hidden, residual = intermediate.hidden, intermediate.residual
        for layer in self._own_layers:
            hidden, residual = layer(positions, hidden, residual)
        if not self.is_last:
            return IntermediateTensors(hidden, residual)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class GemmaCausalLMBase(nn.Module):
    """Decoder + tied LM head, final logits soft-capped when the config says so."""

    qk_norm = False
    # HF's Gemma 2 caps attention scores at attn_logit_softcapping; HF's Gemma 3 reads the key but never applies it.
    attn_softcapping = True
    weight_mapping = WeightMapping(stacked=LLAMA_STACKED, skipped=(r"rotary_emb\.inv_freq$",))

    def __init__(self, hf_config, max_model_len: int, backend_cls: type,
                 quant_config: QuantizationConfig | None = None) -> None:
        super().__init__()
        cfg = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
        self.config = cfg
        cap = (getattr(cfg, "attn_logit_softcapping", None) or None) if self.attn_softcapping else None
        rotary_for = self.make_rotary_for(cfg, max_model_len)
        # LongRoPE / dynamic NTK past the pretraining length: Gemma 2's one table holds both halves (Gemma 3's
        # per-kind tables never do).
        self.rope_long_switch = rope_long_switch(rotary_for(0))
        self.model = GemmaModel(cfg, rotary_for, backend_cls, self.qk_norm, quant_config, attn_soft_cap=cap)
        self.final_logit_softcapping = getattr(cfg, "final_logit_softcapping", None) or None
        self.tie_word_embeddings = bool(getattr(cfg, "tie_word_embeddings", True))
        if not self.model.is_last:
            self.lm_head = PPMissingLayer()
        elif self.tie_word_embeddings and self.model.is_first:
            self.lm_head = self.model.embed_tokens
        else:
            self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size)

    @staticmethod
    def make_rotary_for(cfg, max_model_len: int):
        rotary = make_rotary(cfg, max_model_len, partial_rotary=False)  # HF's Gemma 2 rotates whole heads
        return lambda i: rotary

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                intermediate: IntermediateTensors | None = None) -> torch.Tensor | IntermediateTensors:
        return self.model(input_ids, positions, intermediate)

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        logits = self.lm_head.compute_logits(hidden, out=out)
        cap = self.final_logit_softcapping
        if cap is not None:  # in place: `out` may be the CUDA graphs' shared logits buffer
            logits.div_(cap).tanh_().mul_(cap)
        return logits

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return load_weights(self, weights, self.weight_mapping, self.tie_word_embeddings)


class Gemma2ForCausalLM(GemmaCausalLMBase):
    pass
