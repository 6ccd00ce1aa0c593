"""LoRA serving configuration: vLLM 0.20's LoRAConfig group (`--enable-lora`, `--max-loras`, ...).

Every field is an engine argument of the same name. `TokenmillConfig.lora_config` is this object when
`enable_lora` is set and None otherwise; a LoRA option given with another value than its default while
`enable_lora` is off is refused (it would change nothing).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from tokenmill.config.utils import check_choices, config_field, not_supported_yet

MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
LORA_DTYPES = ("auto", "float16", "bfloat16", "float32")
# The projections an adapter may target, by the module names of HF checkpoints and the stacked names tokenmill
# holds them under (a --lora-target-modules entry may use either).
TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "qkv_proj",
                  "gate_up_proj", "in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "in_proj_ba", "out_proj")
# An HF module name -> the stacked projection tokenmill holds it in.
_STACKED = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj", "gate_proj": "gate_up_proj",
            "up_proj": "gate_up_proj", "in_proj_b": "in_proj_ba", "in_proj_a": "in_proj_ba"}


@dataclass
class LoRAConfig:
    """The LoRA engine arguments.

    max_loras adapters share one batch (each has a device slot); max_cpu_loras adapters (default max_loras) stay
    loaded in host memory, least recently used evicted first. An adapter's rank must be at most max_lora_rank.
    lora_dtype is the dtype adapter weights are kept and applied in (auto: the model's). lora_target_modules
    restricts which projections adapters apply to (None: every one an adapter has).
    """
    enable_lora: bool = config_field(False, help="Serve LoRA adapters (LLM.generate(lora_request=...), "
                                                 "--lora-modules, \"model\": \"<adapter>\" in the OpenAI API).")
    max_loras: int = config_field(1, help="Most distinct LoRA adapters in one batch (device slots).")
    max_lora_rank: int = config_field(16, help="Largest LoRA rank an adapter may have.", choices=MAX_LORA_RANKS)
    lora_dtype: str = config_field("auto", help="Dtype of the adapter weights; auto: the model's dtype.",
                                   choices=LORA_DTYPES)
    max_cpu_loras: int | None = config_field(
        None, help="Most LoRA adapters kept loaded in host memory (least recently used evicted); must be >= "
                   "max_loras; default: max_loras.")
    fully_sharded_loras: bool = config_field(
        False, help="Shard the adapter products fully over the tensor-parallel ranks (only with one rank yet, "
                    "where it changes nothing).")
    lora_target_modules: list[str] | None = config_field(
        None, help="Apply adapters only to these projections (module suffixes, e.g. o_proj qkv_proj); default: "
                   "every projection an adapter has.")

    def __post_init__(self) -> None:
        if isinstance(self.lora_target_modules, str):
            self.lora_target_modules = [self.lora_target_modules]
        if not self.enable_lora:
            for f in dataclasses.fields(self):
                if f.name != "enable_lora" and getattr(self, f.name) not in (f.default, None, []):
                    raise ValueError(f"`{f.name}={getattr(self, f.name)!r}` (--{f.name.replace('_', '-')}) needs "
                                     "enable_lora=True (--enable-lora).")
            return
        check_choices(self)
        for name in ("max_loras", "max_cpu_loras"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise ValueError(f"Invalid value {v!r} for `{name}`: must be an integer >= 1.")
        if self.max_cpu_loras is None:
            self.max_cpu_loras = self.max_loras
        if self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras}).")
        bad = [m for m in self.lora_target_modules or () if m not in TARGET_MODULES]
        if bad:
            raise ValueError(f"lora_target_modules: unknown module(s) {', '.join(map(repr, bad))}; allowed: "
                             f"{', '.join(TARGET_MODULES)}.")

    def verify_parallel(self, tensor_parallel_size: int) -> None:
        if self.fully_sharded_loras and tensor_parallel_size > 1:
            raise not_supported_yet("fully_sharded_loras", True, "Adapters are sharded like their layers (the "
                                    "shrink of column-parallel layers runs on every rank); leave it off.")

    def targets(self, module: str) -> bool:
        """Whether adapters apply to the model's projection `module` (an HF or stacked module name)."""
        if not self.lora_target_modules:
            return True
        return module in self.lora_target_modules or _STACKED.get(module) in self.lora_target_modules


@dataclass(frozen=True)
class LoRAModulePath:
    """One `--lora-modules` entry: the adapter's served name, its PEFT directory and (optionally) the base model
    name /v1/models lists as its parent."""
    name: str
    path: str
    base_model_name: str | None = None


def parse_lora_modules(entries: list[str] | None) -> list[LoRAModulePath]:
    """`--lora-modules` values (name=path, or a JSON object with name, path and optionally base_model_name);
    ValueError naming a malformed or repeated entry."""
    import json
    out: list[LoRAModulePath] = []
    for entry in entries or ():
        text = entry.strip() if isinstance(entry, str) else entry
        if isinstance(text, dict) or (isinstance(text, str) and text.startswith("{")):
            try:
                d = text if isinstance(text, dict) else json.loads(text)
            except ValueError as e:
                raise ValueError(f"--lora-modules: {entry!r} is not valid JSON ({e}).") from None
            unknown = sorted(set(d) - {"name", "path", "base_model_name"})
            if unknown or not d.get("name") or not d.get("path"):
                raise ValueError(f"--lora-modules: {entry!r} needs `name` and `path` (and optionally "
                                 f"`base_model_name`){'; unknown key(s) ' + ', '.join(unknown) if unknown else ''}.")
            m = LoRAModulePath(str(d["name"]), str(d["path"]), d.get("base_model_name"))
        elif isinstance(text, str) and "=" in text and text.split("=", 1)[0] and text.split("=", 1)[1]:
            name, path = text.split("=", 1)
            m = LoRAModulePath(name, path)
        else:
            raise ValueError(f"--lora-modules: {entry!r} is neither name=path nor a JSON object.")
        if any(o.name == m.name for o in out):
            raise ValueError(f"--lora-modules: the adapter name {m.name!r} is given twice.")
        out.append(m)
    return out
