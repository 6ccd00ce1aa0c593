"""The HF config of a resolved model, and the few facts the engine derives from it (RoPE, max length, EOS ids).

Written for transformers 5 (tested on 5.17 and 5.24), which keeps every RoPE setting in one dict,
`config.rope_parameters` (`rope_theta`, `rope_type`, scaling keys; the old `config.rope_scaling` is a deprecated alias
of it and `config.rope_theta` no longer exists). `get_rope_params` also reads old-style objects (`rope_theta` +
`rope_scaling` with `type` or `rope_type`), so configs built by hand or by remote code work too.
"""
from __future__ import annotations

import copy
import json
import os
from typing import Any

from tokenmill.logger import init_logger
from tokenmill.transformers_utils.resolve import ResolvedModel, cached_from_gguf, resolve_model

logger = init_logger(__name__)

# Max-length keys, as vLLM reads them; the smallest one present wins.
_MAX_LEN_KEYS = (
    "max_position_embeddings",
    "n_positions",
    "max_seq_len",
    "seq_length",
    "model_max_length",
    "max_sequence_length",
    "max_seq_length",
    "seq_len",
    "max_target_positions",
)
_DEFAULT_MAX_MODEL_LEN = 2048  # vLLM's fallback when a config names no length

# The generation_config.json keys the engine uses as default sampling parameters (plus eos_token_id for stopping).
_GENERATION_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "max_new_tokens", "eos_token_id")

# Every key of the normalized RoPE dict; absent ones are None unless the rope type has a documented default.
_ROPE_KEYS = (
    "rope_theta",
    "rope_type",
    "factor",
    "original_max_position_embeddings",
    "low_freq_factor",
    "high_freq_factor",
    "beta_fast",
    "beta_slow",
    "mscale",
    "mscale_all_dim",
    "attention_factor",
    "truncate",
    "short_factor",
    "long_factor",
    "partial_rotary_factor",
)
_ROPE_TYPE_ALIASES = {"su": "longrope", "mrope": "default"}  # legacy names (Phi-3 'su', Qwen2-VL 'mrope')


# ------------------------------------------------------------------------------------------------------------- config
def _load_config(resolved: ResolvedModel, trust_remote_code: bool, revision: str | None,
                 code_revision: str | None = None):
    from transformers import AutoConfig

    if resolved.gguf_file is None:
        return AutoConfig.from_pretrained(
            resolved.path, trust_remote_code=trust_remote_code, revision=revision, local_files_only=True,
            code_revision=code_revision,
        )

    def build(directory: str) -> None:
        config = AutoConfig.from_pretrained(resolved.path, gguf_file=resolved.gguf_file, local_files_only=True)
        _fix_gguf_config(config, resolved.gguf_path)
        config.save_pretrained(directory)

    config = cached_from_gguf(
        resolved.gguf_path, "config", build, lambda d: AutoConfig.from_pretrained(d, local_files_only=True)
    )
    config._name_or_path = resolved.path  # not the cache directory it was reloaded from
    return config


def _fix_gguf_config(config, gguf_path: str) -> None:
    """Correct what transformers' GGUF metadata mapping misses. llama.cpp writes `{arch}.attention.key_length` when
    the HF config had an explicit head_dim, but transformers (5.17-5.24) maps it for few architectures (not qwen2/
    qwen3), leaving the config class's default head_dim (128 for Qwen3) in place."""
    from tokenmill.transformers_utils.gguf import read_gguf_metadata

    metadata = read_gguf_metadata(gguf_path)
    arch = metadata.get("general.architecture")
    key_length = metadata.get(f"{arch}.attention.key_length")
    if isinstance(key_length, int) and key_length > 0 and getattr(config, "head_dim", None) != key_length:
        logger.info("GGUF config: head_dim %s -> %s (from %s.attention.key_length)", config.head_dim, key_length, arch)
        config.head_dim = key_length


def get_hf_config(
    resolved: ResolvedModel,
    trust_remote_code: bool = False,
    revision: str | None = None,
    hf_overrides: dict[str, Any] | None = None,
    hf_config_path: str | None = None,
    code_revision: str | None = None,
):
    """The HF config of `resolved`, read from local files only with `hf_overrides` applied, as a `ConfigSnapshot`
    (config_snapshot.py: its values, sub-configs and transformers' methods through the config itself).

    The snapshot is cached on disk under TOKENMILL_CACHE_DIR, keyed by the files it was read from, the overrides and
    the transformers and tokenmill versions, so that a later start reads it without importing transformers (not for
    remote config code, whose source the key would not cover). GGUF models get their config from the GGUF metadata
    (AutoConfig with `gguf_file=`; that parse is cached too). `hf_config_path` (vLLM's --hf-config-path) loads the
    config from another local directory, .gguf file or cached repo id instead. `code_revision` is the revision of
    remote config code kept in another repo (transformers reads it only with trust_remote_code). `hf_overrides` sets
    attributes; a dict value merges into an existing dict attribute or sub-config (e.g. {"text_config":
    {"num_hidden_layers": 2}}). RoPE keys are routed to where the config keeps them: {"rope_theta": x} and
    {"rope_scaling": {...}} update `config.rope_parameters` on transformers 5. A callable `hf_overrides` (vLLM's
    offline form) gets the loaded transformers config and returns the one to use.
    """
    from tokenmill.transformers_utils.config_snapshot import cached_snapshot, file_identity, snapshot
    source = resolve_model(hf_config_path, revision) if hf_config_path is not None else resolved
    if callable(hf_overrides):  # vLLM's offline form: a function of the loaded config that returns the config
        from transformers import PretrainedConfig
        updated = hf_overrides(_load_config(source, trust_remote_code, revision, code_revision))
        if not isinstance(updated, PretrainedConfig):
            raise TypeError(f"hf_overrides: the function {getattr(hf_overrides, '__name__', hf_overrides)!s} must "
                            f"return the (updated) HF config, got {type(updated).__name__}")
        return snapshot(updated)
    if hf_overrides and not isinstance(hf_overrides, dict):
        raise TypeError(f"hf_overrides must be a dict (JSON object) or a function of the HF config, got "
                        f"{type(hf_overrides).__name__}")

    def build():
        config = _load_config(source, trust_remote_code, revision, code_revision)
        if hf_overrides:
            apply_hf_overrides(config, hf_overrides)
        return snapshot(config)

    key = None
    read_from = source.gguf_path or os.path.join(source.path, "config.json")
    if not trust_remote_code and os.path.isfile(read_from):
        key = [file_identity(read_from), source.path, revision, json.dumps(hf_overrides or {}, sort_keys=True,
                                                                           default=repr)]
    return cached_snapshot(key, build)


def _merge_dicts(base: dict, update: dict) -> dict:
    merged = dict(base)
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _merge_dicts(merged[key], value)
        else:
            merged[key] = copy.deepcopy(value)
    return merged


def _override_rope(config, key: str, value: Any) -> None:
    """Apply a RoPE override to a transformers-5 config, whose RoPE settings all live in `rope_parameters`."""
    current = dict(config.rope_parameters)
    if key == "rope_theta":
        current["rope_theta"] = float(value)
    else:  # rope_scaling / rope_parameters
        if value is None:
            current = {k: current[k] for k in ("rope_theta", "partial_rotary_factor") if k in current}
            current["rope_type"] = "default"
        else:
            value = dict(value)
            if "type" in value:
                value.setdefault("rope_type", value.pop("type"))
            if "rope_type" in value and value["rope_type"] != current.get("rope_type"):
                # A new rope type: keep only the base settings, drop the old type's scaling keys.
                current = {k: current[k] for k in ("rope_theta", "partial_rotary_factor") if k in current}
            current = _merge_dicts(current, value)
    config.rope_parameters = current
    if hasattr(config, "standardize_rope_params"):
        config.standardize_rope_params()


def apply_hf_overrides(config, overrides: dict[str, Any]) -> None:
    """Set each key of `overrides` on `config` in place; nested dicts merge into dict attributes and sub-configs."""
    from transformers import PretrainedConfig

    for key, value in overrides.items():
        if key in ("rope_theta", "rope_scaling", "rope_parameters") and isinstance(
            getattr(config, "rope_parameters", None), dict
        ):
            _override_rope(config, key, value)
            continue
        current = getattr(config, key, None)
        if isinstance(value, dict) and isinstance(current, PretrainedConfig):
            apply_hf_overrides(current, value)
        elif isinstance(value, dict) and isinstance(current, dict):
            setattr(config, key, _merge_dicts(current, value))
        else:
            setattr(config, key, copy.deepcopy(value))


# --------------------------------------------------------------------------------------------------------------- rope
def _text_config(config):
    get = getattr(config, "get_text_config", None)
    return get() if callable(get) else config


def get_rope_params(config, layer_type: str | None = None) -> dict[str, Any]:
    """A normalized RoPE description: every key of `_ROPE_KEYS` (None when absent) plus any extra keys the config has
    (mrope_section, ...). `rope_theta` is a float, `rope_type` one of default/linear/dynamic/yarn/longrope/llama3/...

    Reads transformers-5 `config.rope_parameters` and old-style `config.rope_theta` + `config.rope_scaling`
    (`type` or `rope_type`). Per-layer-type RoPE (a dict of dicts keyed by layer type, e.g. Gemma 3) picks
    `layer_type`, else "full_attention", else the first entry. Defaults filled in, as transformers applies them:
    original_max_position_embeddings = max_position_embeddings (yarn, llama3, longrope, dynamic), beta_fast = 32,
    beta_slow = 1, truncate = True (yarn). `attention_factor` stays None when not given (the rotary layer derives it).
    """
    config = _text_config(config)
    params: dict[str, Any] = {}
    legacy = getattr(config, "rope_scaling", None)  # transformers 5: an alias of rope_parameters
    if isinstance(legacy, dict):
        params.update(legacy)
    new = getattr(config, "rope_parameters", None)
    if isinstance(new, dict):
        params.update(new)
    nested = {k: v for k, v in params.items() if isinstance(v, dict) and k not in _ROPE_KEYS}
    if nested and all(isinstance(v, dict) or v is None for v in params.values()):
        pick = layer_type if layer_type in nested else "full_attention" if "full_attention" in nested else None
        params = dict(nested[pick] if pick is not None else next(iter(nested.values())))

    rope_type = params.pop("rope_type", None) or params.pop("type", None) or "default"
    params.pop("type", None)
    rope_type = _ROPE_TYPE_ALIASES.get(rope_type, rope_type)
    theta = params.get("rope_theta")
    if theta is None:
        theta = getattr(config, "rope_theta", None)
    if theta is None:
        theta = getattr(config, "rotary_emb_base", None)  # GPT-NeoX style
    if theta is None:
        theta = getattr(config, "default_theta", 10000.0)

    out: dict[str, Any] = {key: None for key in _ROPE_KEYS}
    out.update(params)
    out["rope_theta"] = float(theta)
    out["rope_type"] = rope_type
    if out["partial_rotary_factor"] is None:
        out["partial_rotary_factor"] = getattr(config, "partial_rotary_factor", None)
    if out["factor"] is not None:
        out["factor"] = float(out["factor"])

    max_pos = getattr(config, "max_position_embeddings", None)
    if rope_type in ("yarn", "llama3", "longrope", "dynamic") and out["original_max_position_embeddings"] is None:
        # Phi-3 keeps it on the config itself; otherwise the pretrained length is max_position_embeddings.
        out["original_max_position_embeddings"] = getattr(config, "original_max_position_embeddings", None) or max_pos
    if rope_type == "yarn":
        out["beta_fast"] = 32.0 if out["beta_fast"] is None else float(out["beta_fast"])
        out["beta_slow"] = 1.0 if out["beta_slow"] is None else float(out["beta_slow"])
        out["truncate"] = True if out["truncate"] is None else bool(out["truncate"])
    if rope_type in ("linear", "dynamic", "yarn", "llama3") and out["factor"] is None:
        raise ValueError(f"RoPE type {rope_type!r} needs a 'factor' in rope_parameters/rope_scaling; got {params}")
    if rope_type == "llama3" and (out["low_freq_factor"] is None or out["high_freq_factor"] is None):
        raise ValueError(f"RoPE type 'llama3' needs 'low_freq_factor' and 'high_freq_factor'; got {params}")
    return out


def longrope_switch(hf_config, max_model_len: int) -> int | None:
    """For LongRoPE and dynamic NTK scaling, the pretraining length past which HF switches to other inverse
    frequencies, when max_model_len exceeds it; None otherwise (one table is then exact).

    HF picks the frequencies per forward from the sequence's length: LongRoPE the short factors while it is no longer
    than `original_max_position_embeddings`, the long ones beyond; dynamic NTK the plain RoPE up to
    `max_position_embeddings` and a base stretched for the current length beyond (recomputing every step). tokenmill
    keeps two tables, stacked; a request whose prompt is longer than the switch length reads the second half
    (`RotaryEmbedding.long_offset` added to its positions, see the model runner), every other request the first.
    That is exactly HF for every sequence that stays within the pretraining length, and for LongRoPE prompts longer
    than it; a sequence that crosses the length while it generates keeps its first table (HF recomputes), and
    dynamic NTK's second table is stretched once for max_model_len (vLLM's choice) where HF stretches for the current
    length. The scheduler reads it too: the two kinds of prompts cannot share cached blocks."""
    params = get_rope_params(hf_config)
    rope_type = params.get("rope_type")
    if rope_type == "longrope":
        original = int(params.get("original_max_position_embeddings")
                       or getattr(hf_config, "original_max_position_embeddings", None)
                       or hf_config.max_position_embeddings)
    elif rope_type == "dynamic":  # HF's dynamic NTK measures against max_position_embeddings only
        original = int(_text_config(hf_config).max_position_embeddings)
    else:
        return None
    return original if max_model_len > original else None


# ----------------------------------------------------------------------------------------------------- sliding window
# Model types whose HF attention never slides, whatever `sliding_window` their config carries (HF's Llama passes no
# window to attention; Qwen3.5's full-attention layers neither): Llama-architecture checkpoints converted from
# Mistral often keep the key.
_NEVER_SLIDING = ("llama", "qwen3_5_text", "qwen3_5", "qwen3_5_moe_text", "qwen3_5_moe")


def config_sliding_window(config) -> int | None:
    """The attention window the model's HF code applies (to every layer for Mistral and Phi-3, to the layers that
    `layer_types` marks for Qwen2 / Qwen3 / Gemma), None where it attends in full: Qwen2 / Qwen3 name a window they
    use only with `use_sliding_window`."""
    cfg = _text_config(config)
    model_type = getattr(cfg, "model_type", "") or ""
    if model_type in _NEVER_SLIDING:
        return None
    if model_type in ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe") and not getattr(cfg, "use_sliding_window", False):
        return None
    return int(getattr(cfg, "sliding_window", None) or 0) or None


# --------------------------------------------------------------------------------------------------------- max length
def get_max_model_len(config) -> int:
    """The longest sequence the model supports, as vLLM derives it.

    The smallest of the length keys present (`_MAX_LEN_KEYS`) on the text config; 2048 when none is. RoPE scaling
    extends it the way vLLM does: for linear and dynamic, length * factor; for yarn,
    original_max_position_embeddings * factor (the pretrained length times the extension). llama3 and longrope
    configs already state the extended length in max_position_embeddings, so they are left alone.
    """
    text = _text_config(config)
    lengths = []
    for key in _MAX_LEN_KEYS:
        value = getattr(text, key, None)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
            lengths.append(int(value))
    if not lengths:
        logger.warning("The model config names no maximum length; assuming %d.", _DEFAULT_MAX_MODEL_LEN)
        return _DEFAULT_MAX_MODEL_LEN
    derived = min(lengths)
    rope = get_rope_params(text)
    if rope["rope_type"] in ("linear", "dynamic", "yarn") and rope["factor"]:
        if rope["rope_type"] == "yarn" and rope["original_max_position_embeddings"]:
            derived = int(rope["original_max_position_embeddings"])
        derived = int(derived * rope["factor"])
    return derived


# -------------------------------------------------------------------------------------------- generation config / eos
def get_generation_config(resolved: ResolvedModel, trust_remote_code: bool = False) -> dict[str, Any]:
    """The sampling defaults from the model directory's generation_config.json ({} when there is none; GGUF files
    carry none). Only `_GENERATION_KEYS` with non-null values are returned. Never touches the network."""
    del trust_remote_code  # a plain JSON file: no code to trust
    path = os.path.join(resolved.path, "generation_config.json")
    if not os.path.isfile(path):
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            raw = json.load(f)
    except (OSError, ValueError) as e:
        logger.warning("Ignoring unreadable %s: %s", path, e)
        return {}
    if not isinstance(raw, dict):
        return {}
    return {key: raw[key] for key in _GENERATION_KEYS if raw.get(key) is not None}


def load_generation_config(model_config) -> dict[str, Any]:
    """The generation config a config.ModelConfig selects: its model's (generation_config="auto"), another local
    model's, or none ("vllm"); override_generation_config applied on top."""
    mc = model_config
    if mc.generation_config == "vllm":
        gen: dict[str, Any] = {}
    else:
        resolved = mc.resolved if mc.generation_config == "auto" else resolve_model(mc.generation_config)
        gen = dict(get_generation_config(resolved, mc.trust_remote_code) or {})
    gen.update(mc.override_generation_config or {})
    return gen


def _as_id_list(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int) and not isinstance(value, bool):
        return [value]
    if isinstance(value, (list, tuple)):
        return [int(v) for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []


def get_eos_token_ids(config, generation_config: dict[str, Any] | None, tokenizer) -> list[int]:
    """Every token id that ends generation, de-duplicated, the tokenizer's EOS first (vLLM's primary EOS), then
    generation_config.json's eos_token_id(s), then the model config's."""
    ids: list[int] = []
    if tokenizer is not None:
        ids += _as_id_list(getattr(tokenizer, "eos_token_id", None))
    if generation_config:
        ids += _as_id_list(generation_config.get("eos_token_id"))
    if config is not None:
        ids += _as_id_list(getattr(_text_config(config), "eos_token_id", None))
        ids += _as_id_list(getattr(config, "eos_token_id", None))
    seen: set[int] = set()
    return [i for i in ids if not (i in seen or seen.add(i))]
