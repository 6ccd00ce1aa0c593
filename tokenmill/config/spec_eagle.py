"""The EAGLE head of `--speculative-config '{"method": "eagle" | "eagle3", "model": ...}'`: read from its checkpoint
and checked against the target, so a head that cannot serve is refused at start-up, naming the key.

Layouts read (as published for Llama-3.x and Qwen3 targets, and as vLLM loads them):
- EAGLE-1: a LlamaForCausalLM config with one layer; `fc.weight` [H, 2H] over concat(embedding(token), the
  target's final hidden state), `layers.0.*` a Llama decoder layer without its input norm, optionally
  `embed_tokens.weight`; no LM head (the target's is used, and its embedding when the head has none).
- EAGLE-3 (architecture LlamaForCausalLMEagle3): `fc.weight` [H, n * H] over the concat of the target's residual
  stream entering n layers (`eagle_aux_hidden_state_layer_ids`, default (2, L // 2, L - 3)), `midlayer.*` one
  decoder layer whose q/k/v read concat(input_layernorm(embedding), hidden_norm(hidden)) (2H), `norm.weight`,
  `lm_head.weight` [draft_vocab_size, H] and `d2t` [draft_vocab_size] (target id = draft id + d2t[draft id]).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tokenmill.config.model import ModelConfig
from tokenmill.config.utils import not_supported_yet

FLAG = "--speculative-config"
# Targets whose forward can hand an EAGLE head its hidden states (models/llama.py: capture_hidden_states).
EAGLE_TARGETS = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")


@dataclass
class EagleHeadConfig:
    """A checked EAGLE head. method: eagle or eagle3; path: its checkpoint directory; hf_config: its config (one
    Llama decoder layer of the target's hidden size); aux_layer_ids: EAGLE-3's target layers whose input residual
    stream feeds `fc` (in fc's column order), () for EAGLE-1 (the target's final hidden states);
    draft_vocab_size: rows of EAGLE-3's LM head (the target's vocab for EAGLE-1); has_d2t / has_embedding /
    has_fc_bias: what the checkpoint holds."""
    method: str
    path: str
    hf_config: Any
    aux_layer_ids: tuple[int, ...]
    draft_vocab_size: int
    has_d2t: bool
    has_embedding: bool
    has_fc_bias: bool


def eagle_head_config(spec, target: ModelConfig, tensor_parallel_size: int) -> EagleHeadConfig:
    method = spec.method
    if tensor_parallel_size != 1 or spec.draft_tensor_parallel_size not in (None, 1):
        raise not_supported_yet("tensor_parallel_size", tensor_parallel_size,
                                f"An {method} head runs with tensor_parallel_size 1 only so far.")
    if target.architecture not in EAGLE_TARGETS:
        raise not_supported_yet("speculative_config", {"method": method},
                                f"The target {target.architecture} cannot feed an EAGLE head its hidden states; "
                                f"EAGLE drafts for {', '.join(EAGLE_TARGETS)}.")
    try:
        probe = ModelConfig(model=spec.model, dtype=target.dtype, seed=target.seed,
                            trust_remote_code=target.trust_remote_code, revision=spec.revision,
                            code_revision=spec.code_revision, skip_tokenizer_init=True)
    except (OSError, ValueError) as e:
        raise ValueError(f"{FLAG}: the {method} head `model` {spec.model!r} cannot be used: {e}") from None
    if probe.is_gguf:
        raise ValueError(f"{FLAG}: the {method} head `model` {spec.model!r} is a GGUF file; EAGLE heads load from "
                         "safetensors.")
    head, tgt = probe.hf_config, target.get_text_config()
    where = f"the {method} head {spec.model!r}"
    layers = getattr(head, "num_hidden_layers", 1)
    if layers != 1:
        raise not_supported_yet("speculative_config", {"num_hidden_layers": layers},
                                f"{where} has {layers} decoder layers; EAGLE heads of one layer are supported.")
    H = tgt.hidden_size
    for key in ("hidden_size", "target_hidden_size"):
        v = getattr(head, key, None)
        if v is not None and v != H:
            raise ValueError(f"{FLAG}: {where} has `{key}` {v}, the target {target.model!r} hidden_size {H}; an "
                             "EAGLE head reads the target's hidden states and must have their size.")
    if head.vocab_size != target.vocab_size:
        raise ValueError(f"{FLAG}: {where} has `vocab_size` {head.vocab_size}, the target {target.vocab_size}; a "
                         "head must share the target's vocabulary.")
    eagle_cfg = getattr(head, "eagle_config", None) or {}
    if method == "eagle":
        if getattr(head, "add_para_norm", False):
            raise not_supported_yet("speculative_config", {"add_para_norm": True},
                                    f"{where} is a HASS variant (embedding / hidden-state norms before fc).")
        aux, draft_vocab = (), target.vocab_size
    else:
        if eagle_cfg.get("use_aux_hidden_state", True) is False:
            raise not_supported_yet("speculative_config", {"use_aux_hidden_state": False},
                                    f"{where} reads one hidden state; EAGLE-3 heads over the target's "
                                    "auxiliary layers are supported.")
        aux = _aux_layer_ids(head, eagle_cfg, tgt.num_hidden_layers, where)
        draft_vocab = getattr(head, "draft_vocab_size", None) or head.vocab_size
        if not isinstance(draft_vocab, int) or not 1 <= draft_vocab <= target.vocab_size:
            raise ValueError(f"{FLAG}: {where} has `draft_vocab_size` {draft_vocab!r}, larger than the target's "
                             f"vocabulary ({target.vocab_size}) or not a positive integer.")
    tensors = _checkpoint_tensors(probe.resolved.path)
    has_d2t = "d2t" in tensors
    if tensors:
        _check_tensors(tensors, method, H, len(aux) if aux else 2, draft_vocab, target.vocab_size, where)
    return EagleHeadConfig(method, probe.resolved.path, head, aux, draft_vocab, has_d2t,
                           "embed_tokens.weight" in tensors, "fc.bias" in tensors)


def _aux_layer_ids(head, eagle_cfg: dict, num_layers: int, where: str) -> tuple[int, ...]:
    """EAGLE-3's target layers, as vLLM reads them: the head config's `eagle_aux_hidden_state_layer_ids` (or its
    eagle_config's), else (2, L // 2, L - 3). Layer i's entry is the residual stream entering layer i (HF's
    hidden_states[i])."""
    ids = getattr(head, "eagle_aux_hidden_state_layer_ids", None) or eagle_cfg.get("eagle_aux_hidden_state_layer_ids")
    if ids is None:
        ids = (2, num_layers // 2, num_layers - 3)
    ok = isinstance(ids, (list, tuple)) and len(ids) > 0 and all(
        isinstance(i, int) and not isinstance(i, bool) and 0 <= i < num_layers for i in ids)
    if not ok:
        raise ValueError(f"{FLAG}: {where} has `eagle_aux_hidden_state_layer_ids` {ids!r} (default (2, L // 2, "
                         f"L - 3)); each must be a target layer index in 0..{num_layers - 1}.")
    return tuple(ids)


def normalized_name(name: str) -> str:
    """A head checkpoint's tensor name as tokenmill's head modules call it (`model.` prefix dropped, EAGLE-3's
    `midlayer.` is layer 0)."""
    name = name.removeprefix("model.")
    return "layers.0." + name[len("midlayer."):] if name.startswith("midlayer.") else name


def _checkpoint_tensors(path: str) -> dict[str, tuple[str, list[int]]]:
    """{normalized tensor name: (file, shape)} of the head's safetensors; {} when it has none (dummy weights)."""
    import glob
    import os

    from safetensors import safe_open
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))  # (models/weight_utils reads them at load)
    out = {}
    for f in files:
        with safe_open(f, framework="pt") as st:
            for name in st.keys():
                out[normalized_name(name)] = (f, list(st.get_slice(name).get_shape()))
    return out


def _check_tensors(tensors: dict, method: str, H: int, n_in: int, draft_vocab: int, vocab: int, where: str) -> None:
    fc = tensors.get("fc.weight")
    if fc is None or fc[1] != [H, n_in * H]:
        got = "none" if fc is None else f"shape {fc[1]}"
        what = "concat(embedding, hidden state)" if method == "eagle" else f"the {n_in} auxiliary hidden states"
        raise ValueError(f"{FLAG}: {where} has `fc.weight` {got}; expected [{H}, {n_in * H}] over {what} "
                         "(`eagle_aux_hidden_state_layer_ids` gives EAGLE-3's count).")
    if method == "eagle":
        return
    head = tensors.get("lm_head.weight")
    if head is None or head[1] != [draft_vocab, H]:
        raise ValueError(f"{FLAG}: {where} has `lm_head.weight` {head[1] if head else 'none'}; expected "
                         f"[{draft_vocab}, {H}] (draft_vocab_size x hidden_size).")
    if "d2t" not in tensors:
        if draft_vocab != vocab:
            raise ValueError(f"{FLAG}: {where} has a draft vocabulary of {draft_vocab} tokens but no `d2t` "
                             "tensor mapping them to the target's.")
        return
    import torch
    from safetensors import safe_open
    f, shape = tensors["d2t"]
    if shape != [draft_vocab]:
        raise ValueError(f"{FLAG}: {where} has `d2t` of shape {shape}; expected [{draft_vocab}] "
                         "(draft_vocab_size).")
    with safe_open(f, framework="pt") as st:
        name = next(n for n in st.keys() if normalized_name(n) == "d2t")
        d2t = st.get_tensor(name).long()
    target_ids = torch.arange(draft_vocab) + d2t
    bad = torch.nonzero((target_ids < 0) | (target_ids >= vocab)).flatten()
    if len(bad):
        i = int(bad[0])
        raise ValueError(f"{FLAG}: {where} has a `d2t` that maps outside the target's vocabulary ({vocab} tokens): "
                         f"draft id {i} -> {int(target_ids[i])} ({len(bad)} such ids).")
