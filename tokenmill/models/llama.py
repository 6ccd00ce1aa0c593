"""Llama-family decoders: Llama / Mistral, Qwen2 (q/k/v bias), Qwen3 (per-head q/k RMSNorm) and Phi-3 (fused
checkpoint tensors).

One implementation with a few switches keeps the architectures from drifting apart.
"""
from __future__ import annotations

from typing import Callable, Iterable

import torch
from torch import nn

from tokenmill.attention.layer import Attention
from tokenmill.core.kv_cache_spec import layer_sliding_windows
from tokenmill.distributed import get_parallel_state
from tokenmill.distributed.pp import IntermediateTensors, PPMissingLayer, pp_layer_range
from tokenmill.layers import opaque_attention
from tokenmill.layers.activation import gated_activation
from tokenmill.layers.layernorm import RMSNorm
from tokenmill.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from tokenmill.layers.quantization.base import QuantizationConfig
from tokenmill.layers.rotary import RotaryEmbedding, compute_inv_freq, long_inv_freq
from tokenmill.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from tokenmill.models.weight_mapping import LLAMA_STACKED, WeightMapping, load_weights
from tokenmill.transformers_utils.config import longrope_switch


def make_rotary(cfg, max_model_len: int, partial_rotary: bool = True) -> RotaryEmbedding:
    """The model's one RoPE table, shared by every layer (a table per layer cost, e.g., ~0.5 GB at 32k positions for
    32 layers). With LongRoPE or dynamic NTK past the pretraining length it also holds the long table (see
    longrope_switch). partial_rotary: whether the architecture honours partial_rotary_factor (compute_inv_freq)."""
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    inv_freq, scaling, rotary_dim = compute_inv_freq(cfg, head_dim, max_model_len, partial_rotary)
    max_pos = max(max_model_len, getattr(cfg, "max_position_embeddings", max_model_len))
    switch = longrope_switch(cfg, max_model_len)
    long = long_inv_freq(cfg, max_model_len) if switch is not None else None
    return RotaryEmbedding(inv_freq, head_dim, rotary_dim, max_pos, scaling, long_inv_freq=long,
                           long_prompt_len=switch)


def rope_long_switch(rope: RotaryEmbedding) -> tuple[int, int] | None:
    """What a model exposes as `rope_long_switch` for the model runner: with LongRoPE or dynamic NTK's two tables,
    (prompt length past which a request reads the second one, its position offset); else None."""
    return None if rope.long_prompt_len is None else (rope.long_prompt_len, rope.long_offset)


class LlamaAttention(nn.Module):
    def __init__(self, cfg, layer_idx: int, rotary_emb: RotaryEmbedding, backend_cls: type,
                 biases: tuple[bool, bool], qk_norm: bool, quant_config: QuantizationConfig | None,
                 prefix: str) -> None:
        super().__init__()
        hidden = cfg.hidden_size
        qkv_bias, o_bias = biases
        total_heads = cfg.num_attention_heads
        total_kv_heads = getattr(cfg, "num_key_value_heads", None) or total_heads
        self.head_dim = getattr(cfg, "head_dim", None) or hidden // total_heads
        self.qkv_proj = QKVParallelLinear(hidden, self.head_dim, total_heads, total_kv_heads, bias=qkv_bias,
                                          quant_config=quant_config, prefix=f"{prefix}.qkv_proj")
        # This rank's heads (all of them with one rank): the layer decides the split.
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.o_proj = RowParallelLinear(total_heads * self.head_dim, hidden, bias=o_bias,
                                        quant_config=quant_config, prefix=f"{prefix}.o_proj")
        self.rotary_emb = rotary_emb
        if qk_norm:
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None
        # Mistral / Qwen2 / Qwen3 with a sliding window: HF's per-layer choice (core/kv_cache_spec.py).
        window = layer_sliding_windows(cfg)[layer_idx]
        self.attn = Attention(layer_idx, self.num_heads, self.head_dim, self.num_kv_heads,
                              self.head_dim ** -0.5, backend_cls, sliding_window=window)
        self._opaque_id = opaque_attention.register(self.attn, self.q_size)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None,
                norm: RMSNorm) -> tuple[torch.Tensor, torch.Tensor]:
        """attention(norm(x + residual)) and the new residual (the norm is folded into qkv_proj where it pays)."""
        qkv, residual = self.qkv_proj.forward_norm(x, residual, norm)
        return self._attend(positions, qkv), residual

    def _attend(self, positions: torch.Tensor, qkv: torch.Tensor) -> torch.Tensor:
        if not torch.compiler.is_compiling():
            out = self.attn.forward_qkv(qkv, positions, self.rotary_emb, self.q_norm, self.k_norm)
            if out is not None:
                return self.o_proj(out)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.q_norm is not None:
            t = q.shape[0]
            q = self.q_norm(q.reshape(t, self.num_heads, self.head_dim)).reshape(t, self.q_size)
            k = self.k_norm(k.reshape(t, self.num_kv_heads, self.head_dim)).reshape(t, self.kv_size)
        q, k = self.rotary_emb(positions, q, k)
        if torch.compiler.is_compiling():
            return self.o_proj(opaque_attention.attention(q, k, v, self._opaque_id))
        return self.o_proj(self.attn(q, k, v.contiguous()))


class LlamaMLP(nn.Module):
    """down(act(gate) * up). bias: the projections' (None: the config's `mlp_bias`, which HF's Llama reads and its
    Mistral / Qwen / Phi-3 ignore)."""

    def __init__(self, cfg, quant_config: QuantizationConfig | None, prefix: str, bias: bool | None = None) -> None:
        super().__init__()
        bias = bool(getattr(cfg, "mlp_bias", False)) if bias is None else bias
        self.gate_up_proj = MergedColumnParallelLinear(cfg.hidden_size, [cfg.intermediate_size] * 2, bias=bias,
                                                       quant_config=quant_config, prefix=f"{prefix}.gate_up_proj")
        self.down_proj = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size, bias=bias,
                                           quant_config=quant_config, prefix=f"{prefix}.down_proj")
        act = getattr(cfg, "hidden_act", None) or "silu"
        # SiLU rides in the products' fused epilogues; any other activation runs between them, as HF computes it.
        self.act_fn = None if act in ("silu", "swish") else gated_activation(act)

    def forward(self, x: torch.Tensor, residual: torch.Tensor,
                norm: RMSNorm) -> tuple[torch.Tensor, torch.Tensor]:
        """mlp(norm(x + residual)) and the new residual; SiLU-and-mul is folded into gate_up_proj's epilogue or
        down_proj's prologue where it pays."""
        if self.act_fn is not None:
            gate_up, residual = self.gate_up_proj.forward_norm(x, residual, norm)
            gate, up = gate_up.chunk(2, dim=-1)
            return self.down_proj(self.act_fn(gate) * up), residual
        fused = self.gate_up_proj.forward_norm_silu(x, residual, norm, self.down_proj)
        if fused is not None:
            act, residual = fused
            return self.down_proj(act), residual
        gate_up, residual = self.gate_up_proj.forward_norm(x, residual, norm)
        return self.down_proj(gate_up, act="silu_mul"), residual


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg, layer_idx: int, rotary_emb: RotaryEmbedding, backend_cls: type,
                 biases: tuple[bool, bool], qk_norm: bool, quant_config: QuantizationConfig | None,
                 prefix: str, mlp_bias: bool | None = None, make_mlp: Callable | None = None) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(cfg, layer_idx, rotary_emb, backend_cls, biases, qk_norm, quant_config,
                                        f"{prefix}.self_attn")
        self.mlp = LlamaMLP(cfg, quant_config, f"{prefix}.mlp", mlp_bias) if make_mlp is None \
            else make_mlp(cfg, layer_idx, quant_config, f"{prefix}.mlp")
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, positions, hidden, residual):
        hidden, residual = self.self_attn(positions, hidden, residual, self.input_layernorm)
        return self.mlp(hidden, residual, self.post_attention_layernorm)


class LlamaModel(nn.Module):
    """The decoder stack. Under pipeline parallelism it holds only this stage's layers (others are
    PPMissingLayer placeholders without parameters), the embedding only on the first stage and the final norm only
    on the last; a stage other than the first continues from the previous stage's IntermediateTensors, and one
    other than the last returns its own."""

    def __init__(self, cfg, max_model_len: int, backend_cls: type, biases: tuple[bool, bool],
                 qk_norm: bool, quant_config: QuantizationConfig | None = None, prefix: str = "model",
                 partial_rotary: bool = False, mlp_bias: bool | None = None,
                 make_mlp: Callable | None = None) -> None:
        super().__init__()
        pp = get_parallel_state()
        self.is_first, self.is_last = pp.pp_rank == 0, pp.pp_rank == pp.pp_size - 1
        self.start, self.end = pp_layer_range(cfg.num_hidden_layers, pp.pp_rank, pp.pp_size)
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size) if self.is_first \
            else PPMissingLayer()
        self.rotary = rotary = make_rotary(cfg, max_model_len, partial_rotary)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(cfg, i, rotary, backend_cls, biases, qk_norm, quant_config, f"{prefix}.layers.{i}",
                              mlp_bias, make_mlp)
            if self.start <= i < self.end
            else PPMissingLayer() for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps) if self.is_last else PPMissingLayer()
        self._own_layers = tuple(self.layers[self.start:self.end])  # a plain tuple: no per-step slicing
        self.hidden_capture = None  # a spec_decode.hidden_capture.HiddenCapture when an EAGLE head drafts

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                intermediate: IntermediateTensors | None = None) -> torch.Tensor | IntermediateTensors:
        if self.is_first:
            hidden, residual = self.embed_tokens(input_ids), None
        else:
            hidden, residual = intermediate.hidden, intermediate.residual
        cap = self.hidden_capture
        if cap is None:
            for layer in self._own_layers:
                hidden, residual = layer(positions, hidden, residual)
        else:  # an EAGLE head reads the residual stream entering some layers, or the final hidden states
            for i, layer in enumerate(self._own_layers, start=self.start):
                if cap.wants(i):
                    cap.layer_input(i, hidden, residual)
                hidden, residual = layer(positions, hidden, residual)
        if not self.is_last:
            return IntermediateTensors(hidden, residual)
        hidden, _ = self.norm(hidden, residual)
        if cap is not None:
            cap.final_hidden(hidden)
        return hidden


class LlamaForCausalLM(nn.Module):
    """Decoder + LM head. `forward` returns final hidden states; `compute_logits` projects selected rows."""

    qk_norm = False
    # Its layers reach attention through layers/opaque_attention.py under torch.compile (worker/cpu_compile.py).
    supports_torch_compile = True
    partial_rotary = False  # HF's Llama / Mistral / Qwen2 / Qwen3 rotate whole heads (layers/rotary.py)
    weight_mapping = WeightMapping(stacked=LLAMA_STACKED, skipped=(r"rotary_emb\.inv_freq$",))

    def __init__(self, hf_config, max_model_len: int, backend_cls: type,
                 quant_config: QuantizationConfig | None = None) -> None:
        super().__init__()
        self.config = hf_config
        self.model = LlamaModel(hf_config, max_model_len, backend_cls, self.attention_biases(hf_config),
                                self.qk_norm, quant_config, partial_rotary=self.partial_rotary,
                                mlp_bias=self.mlp_bias(hf_config), make_mlp=self.make_mlp)
        self.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", False))
        self.rope_long_switch = rope_long_switch(self.model.rotary)
        if not self.model.is_last:
            self.lm_head = PPMissingLayer()
        elif self.tie_word_embeddings and self.model.is_first:
            self.lm_head = self.model.embed_tokens
        else:
            # A tied head on a last stage that lacks the embedding gets its own copy of the table (loaded from
            # the embedding's checkpoint tensor).
            self.lm_head = ParallelLMHead(hf_config.vocab_size, hf_config.hidden_size)

    @staticmethod
    def attention_biases(cfg) -> tuple[bool, bool]:
        """(bias on q/k/v, bias on o_proj), as HF's modeling code of the architecture decides: Llama and Qwen3
        read `attention_bias` for all four; Mistral and Phi-3 have none whatever the config says."""
        b = bool(getattr(cfg, "attention_bias", False))
        return b, b

    @staticmethod
    def mlp_bias(cfg) -> bool:
        """Whether the MLP's projections have biases: Llama reads `mlp_bias`; Mistral, Qwen2, Qwen3 and Phi-3
        never have them (HF ignores the key there, so must we: the checkpoint holds no such tensors)."""
        return bool(getattr(cfg, "mlp_bias", False))

    # The MLP seam: None builds LlamaMLP; a mixture-of-experts family (models/llama_moe.py) returns a callable
    # (cfg, layer_idx, quant_config, prefix) -> module with LlamaMLP's forward(x, residual, norm).
    make_mlp: Callable | None = None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                intermediate: IntermediateTensors | None = None) -> torch.Tensor | IntermediateTensors:
        """Final hidden states on the last pipeline stage; IntermediateTensors for the next stage elsewhere."""
        return self.model(input_ids, positions, intermediate)

    def capture_hidden_states(self, capture) -> None:
        """The EAGLE seam (spec_decode/hidden_capture.py): every later forward records the hidden states
        `capture` asks for (None: stop)."""
        self.model.hidden_capture = capture

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """out: a preallocated [T, vocab] tensor to write into (the CUDA graphs' shared logits buffer)."""
        return self.lm_head.compute_logits(hidden, out=out)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy checkpoint tensors into parameters (see models/weight_mapping.py); the names loaded."""
        return load_weights(self, weights, self.weight_mapping, self.tie_word_embeddings)


class _UnbiasedForCausalLM(LlamaForCausalLM):
    """An architecture whose HF code builds no biases at all, whatever `attention_bias` / `mlp_bias` say."""

    @staticmethod
    def attention_biases(cfg) -> tuple[bool, bool]:
        return False, False

    @staticmethod
    def mlp_bias(cfg) -> bool:
        return False


class MistralForCausalLM(_UnbiasedForCausalLM):
    pass


class Qwen2ForCausalLM(LlamaForCausalLM):
    @staticmethod
    def attention_biases(cfg) -> tuple[bool, bool]:
        return True, False  # Qwen2 always has q/k/v biases and never an o_proj bias

    @staticmethod
    def mlp_bias(cfg) -> bool:
        return False


class Qwen3ForCausalLM(LlamaForCausalLM):
    qk_norm = True

    @staticmethod
    def mlp_bias(cfg) -> bool:
        return False


class Phi3ForCausalLM(_UnbiasedForCausalLM):
    """Phi-3 / Phi-3.5 / Phi-4 (and their mini variants): the Llama layer with q/k/v and gate/up already fused in
    the checkpoint (`qkv_proj`, `gate_up_proj`, split by the layers' loaders), partial rotary and LongRoPE scaling
    from the config, no biases."""

    partial_rotary = True
    weight_mapping = WeightMapping(skipped=(r"rotary_emb\.inv_freq$",))
