"""Gemma 3 text: Gemma 2's layer (models/gemma2.py) with per-head (1 + w) q/k norms, a RoPE table per layer kind
(the local base, typically 10k, on sliding-window layers; the global base and its scaling on full-attention ones),
`layer_types` / `sliding_window_pattern` choosing the kind of each layer (five local to one global in the released
checkpoints), and final-logit soft-capping only where the config sets it (attn_logit_softcapping is ignored, as HF
transformers' Gemma 3 ignores it).

`Gemma3ForConditionalGeneration` checkpoints run their text path: the language model's weights load under the
text model's names, the vision tower and projector are skipped with one log line (no image input yet).
"""
from __future__ import annotations

from typing import Iterable

import torch

from tokenmill.layers.rotary import RotaryEmbedding
from tokenmill.logger import init_logger
from tokenmill.models.gemma2 import GemmaCausalLMBase
from tokenmill.models.weight_mapping import LLAMA_STACKED, WeightMapping
from tokenmill.transformers_utils.config_snapshot import hf_config_object

logger = init_logger(__name__)


def _rotary_of_kind(cfg, layer_type: str, head_dim: int, max_model_len: int) -> RotaryEmbedding:
    from tokenmill.transformers_utils.config import get_rope_params
    params = get_rope_params(cfg, layer_type)
    rope_type = params["rope_type"]
    if rope_type == "default":
        exps = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
        inv_freq, scaling = 1.0 / (float(params["rope_theta"]) ** exps), 1.0
    else:
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
        if rope_type not in ROPE_INIT_FUNCTIONS:
            raise ValueError(f"Unsupported rope type {rope_type!r} for Gemma 3 {layer_type} layers.")
        original = params.get("original_max_position_embeddings") or cfg.max_position_embeddings
        if rope_type == "longrope" and max_model_len > original:
            # HF switches to the long factors past the pretraining length; these per-kind tables hold one set.
            raise ValueError(f"Gemma 3 with LongRoPE on its {layer_type} layers (rope_parameters) is supported only "
                             f"up to its pretraining length: set max_model_len <= {original} (got {max_model_len}).")
        # Dynamic NTK: the plain frequencies, HF's within max_position_embeddings.
        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf_config_object(cfg), torch.device("cpu"),
                                                           layer_type=layer_type)
    max_pos = max(max_model_len, getattr(cfg, "max_position_embeddings", max_model_len))
    return RotaryEmbedding(inv_freq.float(), head_dim, head_dim, max_pos, float(scaling))


class Gemma3ForCausalLM(GemmaCausalLMBase):
    qk_norm = True
    attn_softcapping = False  # as HF's Gemma 3 (the released configs set attn_logit_softcapping null anyway)

    @staticmethod
    def make_rotary_for(cfg, max_model_len: int):
        if getattr(cfg, "use_bidirectional_attention", False):
            raise ValueError("Gemma 3 with use_bidirectional_attention (an embedding model) is not supported yet.")
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        types = list(getattr(cfg, "layer_types", None) or ["full_attention"] * cfg.num_hidden_layers)
        tables = {t: _rotary_of_kind(cfg, t, head_dim, max_model_len) for t in dict.fromkeys(types)}
        return lambda i: tables[types[i]]


_VISION = r"^(model\.)?(vision_tower|multi_modal_projector)\."


class Gemma3ForConditionalGeneration(Gemma3ForCausalLM):
    """The text path of the multimodal checkpoint (text requests only)."""

    weight_mapping = WeightMapping(
        stacked=LLAMA_STACKED,
        renamed=(("model.language_model.", "model."), ("language_model.model.", "model."),
                 ("language_model.lm_head.", "lm_head.")),
        skipped=(r"rotary_emb\.inv_freq$", _VISION))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        import re
        vision = re.compile(_VISION)
        skipped = 0

        def counted():
            nonlocal skipped
            for name, tensor in weights:
                if vision.search(name):
                    skipped += 1
                    continue
                yield name, tensor

        loaded = super().load_weights(counted())
        if skipped:
            logger.info("Gemma3ForConditionalGeneration: skipped %d vision-tower / projector tensors (text "
                        "input only: multimodal input is not supported yet).", skipped)
        return loaded
