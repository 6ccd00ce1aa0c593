"""EAGLE-1 and EAGLE-3 draft heads: one Llama decoder layer that reads the target's hidden states.

Both take, at draft position j, the embedding of token j + 1 and a hidden state for position j (the target's, or
the head's own output at j when j is a drafted position), and return (the state the logits are computed from, the
state fed back as the next position's hidden input):
- EAGLE-1: x = fc(concat(embedding, hidden)); one Llama layer without its input norm; output x' = its residual
  stream (no final norm), both for the logits (through the target's LM head) and fed back.
- EAGLE-3: the hidden input is first `combine`d (fc over the concat of the target's auxiliary hidden states; the
  head's own fed-back output is already of width H); the layer's attention reads concat(input_layernorm(embedding),
  hidden_norm(hidden)) (q/k/v over 2H), its residual starts from the hidden input (hidden_norm(hidden) with
  `norm_before_residual`); logits from norm(output) through the head's own LM head over its draft vocabulary, ids
  mapped by d2t; the pre-norm output is fed back.
Checkpoint layouts: config/spec_eagle.py.
"""
from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from tokenmill.layers.layernorm import RMSNorm
from tokenmill.layers.linear import QKVParallelLinear
from tokenmill.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from tokenmill.models.llama import LlamaAttention, LlamaMLP, make_rotary
from tokenmill.models.weight_mapping import LLAMA_STACKED, WeightMapping, load_weights


class _HeadLayer(nn.Module):
    """The head's decoder layer: parameter names as in the checkpoints (`layers.0.self_attn.qkv_proj...`)."""

    def __init__(self, cfg, max_model_len: int, backend_cls: type, qkv_in: int, eagle3: bool) -> None:
        super().__init__()
        bias = bool(getattr(cfg, "attention_bias", False))
        self.self_attn = LlamaAttention(cfg, 0, make_rotary(cfg, max_model_len), backend_cls, (bias, bias), False,
                                        None, "layers.0.self_attn")
        if qkv_in != cfg.hidden_size:  # EAGLE-3: q/k/v read the embedding and the hidden state side by side
            a = self.self_attn
            a.qkv_proj = QKVParallelLinear(qkv_in, a.head_dim, cfg.num_attention_heads,
                                           getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads,
                                           bias=bias, prefix="layers.0.self_attn.qkv_proj")
        self.mlp = LlamaMLP(cfg, None, "layers.0.mlp")
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if eagle3:
            self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
            self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def attend_and_mlp(self, positions: torch.Tensor, attn_in: torch.Tensor,
                       residual: torch.Tensor) -> torch.Tensor:
        """The layer's residual stream out: residual + attn + mlp(post_norm(residual + attn))."""
        a = self.self_attn._attend(positions, self.self_attn.qkv_proj(attn_in))
        m, r = self.mlp(a, residual, self.post_attention_layernorm)
        return m + r


class EagleHead(nn.Module):
    """EAGLE-1. Contract: `forward(ids, positions, hidden)` -> (for_logits, fed_back), both [T, H];
    `combine(h)` is the identity (the target's final hidden states are the input); `compute_logits` is set to the
    target's LM head by the drafter (`share_target`), and `to_target_ids` is the identity."""

    eagle3 = False
    weight_mapping = WeightMapping(stacked=LLAMA_STACKED,
                                   skipped=(r"rotary_emb\.inv_freq$", r"^layers\.0\.input_layernorm\.",
                                            r"^lm_head\."))

    def __init__(self, cfg, max_model_len: int, backend_cls: type, fc_bias: bool = False) -> None:
        super().__init__()
        self.config = cfg
        H = cfg.hidden_size
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, H)
        self.fc = nn.Linear(2 * H, H, bias=fc_bias)  # replicated (the head runs with tensor_parallel_size 1)
        self.layers = nn.ModuleList([_HeadLayer(cfg, max_model_len, backend_cls, H, False)])
        self.lm_head = None

    def combine(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden

    def forward(self, ids: torch.Tensor, positions: torch.Tensor,
                hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.fc(torch.cat((self.embed_tokens(ids), hidden), dim=-1))
        out = self.layers[0].attend_and_mlp(positions, x, x)
        return out, out

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head.compute_logits(hidden)

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids

    def share_target(self, target: nn.Module, has_embedding: bool) -> None:
        """Use the target's LM head (EAGLE-1 has none) and its embedding where the checkpoint has none."""
        self.lm_head = target.lm_head
        if not has_embedding:
            self.embed_tokens = target.model.embed_tokens

    def own_weight_names(self, has_embedding: bool) -> set[str]:
        """The parameters the checkpoint must fill."""
        return {n for n, _ in self.named_parameters() if has_embedding or not n.startswith("embed_tokens.")}

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return load_weights(self, weights, self.weight_mapping)


class Eagle3Head(EagleHead):
    """EAGLE-3. Contract as EagleHead's, with `combine(aux)` = fc over the concat of the target's auxiliary hidden
    states ([T, n * H] -> [T, H]), its own norm and LM head over `draft_vocab_size` ids, and `to_target_ids`
    adding d2t (a buffer; zeros when the checkpoint has none, the draft vocabulary then being the target's)."""

    eagle3 = True
    weight_mapping = WeightMapping(stacked=LLAMA_STACKED, skipped=(r"rotary_emb\.inv_freq$", r"^t2d$"))

    def __init__(self, cfg, max_model_len: int, backend_cls: type, num_aux: int, draft_vocab_size: int,
                 fc_bias: bool = False) -> None:
        nn.Module.__init__(self)
        self.config = cfg
        H = cfg.hidden_size
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, H)
        self.fc = nn.Linear(num_aux * H, H, bias=fc_bias)
        self.layers = nn.ModuleList([_HeadLayer(cfg, max_model_len, backend_cls, 2 * H, True)])
        self.norm = RMSNorm(H, cfg.rms_norm_eps)
        self.lm_head = ParallelLMHead(draft_vocab_size, H)
        self.register_buffer("d2t", torch.zeros(draft_vocab_size, dtype=torch.long))
        self.norm_before_residual = bool(getattr(cfg, "norm_before_residual", False))

    def combine(self, aux: torch.Tensor) -> torch.Tensor:
        return self.fc(aux)

    def forward(self, ids: torch.Tensor, positions: torch.Tensor,
                hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        layer = self.layers[0]
        h = layer.hidden_norm(hidden)
        attn_in = torch.cat((layer.input_layernorm(self.embed_tokens(ids)), h), dim=-1)
        out = layer.attend_and_mlp(positions, attn_in, h if self.norm_before_residual else hidden)
        return self.norm(out), out

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]

    def share_target(self, target: nn.Module, has_embedding: bool) -> None:
        if not has_embedding:
            self.embed_tokens = target.model.embed_tokens

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        def own(stream):
            for name, tensor in stream:
                if name == "d2t":
                    self.d2t.copy_(tensor.to(torch.long))
                else:
                    yield name, tensor
        return load_weights(self, own(weights), self.weight_mapping)
