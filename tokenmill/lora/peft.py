"""Adapters as PEFT saves them: adapter_config.json plus adapter_model.safetensors (or adapter_model.bin).

A PEFT LoRA save holds, per targeted module, `base_model.model.<module>.lora_A.weight` ([r, in]) and
`...lora_B.weight` ([out, r]); the module's output gains scaling * x A^T B^T with scaling = lora_alpha / r
(lora_alpha / sqrt(r) with use_rslora). `read_adapter` checks an adapter against the model before any weight moves
to a device: rank at most max_lora_rank, every targeted module one the model has with the shapes it has (on a hybrid
model, attention modules on attention layers and Gated DeltaNet ones on linear-attention layers), the base model the
one served. Every refusal is a `LoRAAdapterError` naming the adapter and what is wrong. With the model's weight
mapping, module names are renamed as the checkpoint's are (a multimodal checkpoint's `model.language_model.`), and
modules of parts tokenmill skips when loading the model (a vision tower, an MTP head) are skipped with a log line:
they never touch a text request.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field

import torch

from tokenmill.logger import init_logger

logger = init_logger(__name__)

CONFIG_FILE = "adapter_config.json"
WEIGHT_FILES = ("adapter_model.safetensors", "adapter_model.bin")
_PREFIX = "base_model.model."
# HF module name -> what its (in, out) features are in terms of the model config.
_ATTN = ("q_proj", "k_proj", "v_proj", "o_proj", "qkv_proj")
_MLP = ("gate_proj", "up_proj", "down_proj", "gate_up_proj")
_GDN = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj")  # Qwen3.5's linear attention
_PARENTS = {"self_attn": _ATTN, "mlp": _MLP, "linear_attn": _GDN}
# Text configs whose q_proj gives a query and an output gate per head (models/qwen3_5.py).
_GATED_QUERY = ("qwen3_5_text", "qwen3_5_moe_text")


class LoRAAdapterError(ValueError):
    """An adapter that cannot be served: a broken directory, or one that does not fit the model or the limits."""


@dataclass
class LoRAAdapter:
    """One adapter's weights on the host, float32: HF module name ("model.layers.0.self_attn.q_proj") ->
    (A [r, in], B [out, r] with the adapter's scaling folded in)."""
    name: str
    lora_int_id: int
    rank: int
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)


def _config(name: str, path: str) -> dict:
    if not os.path.isdir(path):
        raise LoRAAdapterError(f"LoRA adapter {name!r}: {path!r} is not a directory.")
    cfg_path = os.path.join(path, CONFIG_FILE)
    try:
        with open(cfg_path) as f:
            cfg = json.load(f)
    except FileNotFoundError:
        raise LoRAAdapterError(f"LoRA adapter {name!r}: {path!r} has no {CONFIG_FILE}.") from None
    except ValueError as e:
        raise LoRAAdapterError(f"LoRA adapter {name!r}: {cfg_path} is not valid JSON ({e}).") from None
    if not isinstance(cfg, dict):
        raise LoRAAdapterError(f"LoRA adapter {name!r}: {cfg_path} is not a JSON object.")
    kind = cfg.get("peft_type", "LORA")
    if str(kind).upper() != "LORA":
        raise LoRAAdapterError(f"LoRA adapter {name!r}: peft_type {kind!r} is not a LoRA adapter.")
    for key, why in (("use_dora", "DoRA adapters"), ("modules_to_save", "modules_to_save (full module copies)"),
                     ("rank_pattern", "per-module ranks (rank_pattern)"),
                     ("alpha_pattern", "per-module alphas (alpha_pattern)")):
        if cfg.get(key):
            raise LoRAAdapterError(f"LoRA adapter {name!r}: {why} are not supported yet.")
    if cfg.get("bias", "none") not in ("none", None):
        raise LoRAAdapterError(f"LoRA adapter {name!r}: bias={cfg['bias']!r} is not supported yet (only 'none').")
    return cfg


def _tensors(name: str, path: str) -> dict[str, torch.Tensor]:
    for fname in WEIGHT_FILES:
        fpath = os.path.join(path, fname)
        if not os.path.exists(fpath):
            continue
        try:
            if fname.endswith(".safetensors"):
                from safetensors.torch import load_file
                return load_file(fpath)
            return torch.load(fpath, map_location="cpu", weights_only=True)
        except Exception as e:  # a truncated or foreign file: name it instead of a loader traceback
            raise LoRAAdapterError(f"LoRA adapter {name!r}: cannot read {fpath} ({type(e).__name__}: {e}).") \
                from None
    raise LoRAAdapterError(f"LoRA adapter {name!r}: {path!r} has neither {' nor '.join(WEIGHT_FILES)}.")


def _module_shapes(text_config) -> dict[str, tuple[int, int]]:
    """(in, out) features of each projection an adapter may target, by HF module name."""
    c = text_config
    h, heads = c.hidden_size, c.num_attention_heads
    kv = getattr(c, "num_key_value_heads", None) or heads
    hd = getattr(c, "head_dim", None) or h // heads
    q = heads * hd * (2 if getattr(c, "model_type", None) in _GATED_QUERY else 1)
    inter = c.intermediate_size
    shapes = {"q_proj": (h, q), "k_proj": (h, kv * hd), "v_proj": (h, kv * hd), "o_proj": (heads * hd, h),
              "qkv_proj": (h, q + 2 * kv * hd), "gate_proj": (h, inter), "up_proj": (h, inter),
              "down_proj": (inter, h), "gate_up_proj": (h, 2 * inter)}
    if "linear_attention" in (getattr(c, "layer_types", None) or ()):
        key = c.linear_num_key_heads * c.linear_key_head_dim
        value = c.linear_num_value_heads * c.linear_value_head_dim
        hv = c.linear_num_value_heads
        shapes.update({"in_proj_qkv": (h, 2 * key + value), "in_proj_z": (h, value), "in_proj_b": (h, hv),
                       "in_proj_a": (h, hv), "out_proj": (value, h)})
    return shapes


def _fits(parts: list[str], shapes: dict, layer_types, num_layers: int) -> bool:
    """Whether module `model.layers.<i>.<parent>.<leaf>` (split on dots) is one the model has."""
    if len(parts) != 5 or parts[:2] != ["model", "layers"] or not parts[2].isdigit():
        return False
    layer, parent, leaf = int(parts[2]), parts[3], parts[4]
    if layer >= num_layers or leaf not in shapes or leaf not in _PARENTS.get(parent, ()):
        return False
    if layer_types and "linear_attention" in layer_types:  # a hybrid: each layer has one kind of token mixer
        return (parent == "linear_attn") == (layer_types[layer] == "linear_attention") or parent == "mlp"
    return parent != "linear_attn"


def _same_base(given: str, served: list[str]) -> bool:
    """Whether a base model name (a hub id or a local path) names the served model: equal, or equal last path
    component (an adapter trained on "org/Model" serves a local copy ".../Model")."""
    tail = lambda s: os.path.basename(os.path.normpath(s)).lower()  # noqa: E731
    return any(given == s or tail(given) == tail(s) for s in served if s)


def read_adapter(name: str, lora_int_id: int, path: str, *, max_rank: int, text_config,
                 served_names: list[str], base_model_name: str | None = None, mapping=None) -> LoRAAdapter:
    """Load and check the PEFT adapter at `path` (see the module docstring); LoRAAdapterError on any refusal.
    `mapping`: the model class's WeightMapping (renames and skipped parts), None for a plain decoder."""
    cfg = _config(name, path)
    for given in (base_model_name, cfg.get("base_model_name_or_path")):
        if given and not _same_base(str(given), served_names):
            raise LoRAAdapterError(f"LoRA adapter {name!r} was made for base model {given!r}, not the served model "
                                   f"{served_names[0]!r}.")
    rank = cfg.get("r")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise LoRAAdapterError(f"LoRA adapter {name!r}: {CONFIG_FILE} has no valid rank `r` ({rank!r}).")
    if rank > max_rank:
        raise LoRAAdapterError(f"LoRA adapter {name!r} has rank {rank}, more than max_lora_rank={max_rank} "
                               "(raise --max-lora-rank).")
    alpha = cfg.get("lora_alpha", rank)
    scaling = alpha / (math.sqrt(rank) if cfg.get("use_rslora") else rank)
    shapes = _module_shapes(text_config)
    num_layers = text_config.num_hidden_layers
    layer_types = getattr(text_config, "layer_types", None)
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in _tensors(name, path).items():
        mod = key[len(_PREFIX):] if key.startswith(_PREFIX) else key
        for part in ("lora_A", "lora_B"):
            marker = f".{part}."
            if marker in mod:
                module = mod.split(marker)[0]
                pairs.setdefault(module, {})[part] = t
                break
        else:
            raise LoRAAdapterError(f"LoRA adapter {name!r}: tensor {key!r} is not a lora_A/lora_B weight "
                                   "(embedding and lm_head adapters are not supported yet).")
    if not pairs:
        raise LoRAAdapterError(f"LoRA adapter {name!r}: the weight file holds no LoRA tensors.")
    out = LoRAAdapter(name, lora_int_id, rank)
    skipped = []
    for module, ab in sorted(pairs.items()):
        if mapping is not None:
            if mapping.is_skipped(module + ".weight"):
                skipped.append(module)
                continue
            module = mapping.rename(module)
        leaf = module.rsplit(".", 1)[-1]
        if not _fits(module.split("."), shapes, layer_types, num_layers):
            raise LoRAAdapterError(f"LoRA adapter {name!r} targets module {module!r}, which the model does not have "
                                   f"(LoRA applies to {', '.join(shapes)} of model.layers.0..{num_layers - 1}).")
        if set(ab) != {"lora_A", "lora_B"}:
            raise LoRAAdapterError(f"LoRA adapter {name!r}: module {module!r} lacks its "
                                   f"{({'lora_A', 'lora_B'} - set(ab)).pop()} weight.")
        a, b = ab["lora_A"].float(), ab["lora_B"].float()
        fin, fout = shapes[leaf]
        if a.shape != (rank, fin) or b.shape != (fout, rank):
            raise LoRAAdapterError(f"LoRA adapter {name!r}: module {module!r} has lora_A {tuple(a.shape)} and lora_B "
                                   f"{tuple(b.shape)}; the model needs ({rank}, {fin}) and ({fout}, {rank}).")
        out.weights[module] = (a.contiguous(), (b * scaling).contiguous())
    if skipped:
        logger.info("LoRA adapter %r: skipped %d module(s) of parts tokenmill does not run for text (%s%s).", name,
                    len(skipped), ", ".join(skipped[:2]), ", ..." if len(skipped) > 2 else "")
    if not out.weights:
        raise LoRAAdapterError(f"LoRA adapter {name!r} has no module the served text model runs (skipped: "
                               f"{', '.join(skipped[:3])}{', ...' if len(skipped) > 3 else ''}).")
    return out
