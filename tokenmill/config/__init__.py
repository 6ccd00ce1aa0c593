"""Configuration: one dataclass per concern; `EngineArgs` builds them from flat keyword arguments or the CLI."""
from __future__ import annotations

from dataclasses import dataclass

from tokenmill.config.cache import CacheConfig
from tokenmill.config.compilation import CompilationConfig
from tokenmill.config.device import DeviceConfig
from tokenmill.config.load import LoadConfig
from tokenmill.config.lora import LoRAConfig
from tokenmill.config.model import ModelConfig
from tokenmill.config.parallel import ParallelConfig
from tokenmill.config.scheduler import SchedulerConfig
from tokenmill.config.speculative import SpeculativeArgs, SpeculativeConfig

CONFIG_CLASSES = (ModelConfig, CacheConfig, SchedulerConfig, LoadConfig, ParallelConfig, DeviceConfig,
                  CompilationConfig, SpeculativeArgs, LoRAConfig)


@dataclass
class TokenmillConfig:
    """Everything one engine needs, after validation and model-dependent defaults."""
    model_config: ModelConfig
    cache_config: CacheConfig
    scheduler_config: SchedulerConfig
    load_config: LoadConfig
    parallel_config: ParallelConfig
    device_config: DeviceConfig
    compilation_config: CompilationConfig
    speculative_config: SpeculativeConfig | None = None
    lora_config: LoRAConfig | None = None  # set when enable_lora

    def __post_init__(self) -> None:
        self.scheduler_config.finalize(self.model_config.max_model_len)
        pp = self.parallel_config.pipeline_parallel_size
        if pp > 1 and self.scheduler_config.async_scheduling:
            raise ValueError(f"async_scheduling=True cannot be combined with pipeline_parallel_size={pp}: the "
                             "pipeline overlaps micro-batches instead (a request waits for its sampled token "
                             "before it is scheduled again). Leave async_scheduling unset or pass False.")
        if self.speculative_config is not None:
            # A speculative step runs synchronously (step N+1's drafts come from step N's accepted tokens);
            # async_scheduling then applies to the steps the engine decodes without drafts
            # (spec_decode/step_aside.py).
            if pp > 1:
                raise ValueError(f"speculative_config cannot be combined with pipeline_parallel_size={pp} yet.")
            spec = self.speculative_config
            if spec.uses_draft_model and self.model_config.sliding_window:
                raise ValueError("speculative_config with a draft model cannot be combined with the sliding-window "
                                 f"attention of {self.model_config.architecture} yet (the draft runs in the "
                                 "target's block tables, whose blocks below the window are freed).")
            spec.finalize(self.model_config, self.parallel_config.tensor_parallel_size)
        if self.scheduler_config.async_scheduling is None:
            # Overlap pays where the device runs asynchronously to the host; on the CPU the forward is the host.
            # Pipeline parallelism keeps several micro-batches in flight instead.
            self.scheduler_config.async_scheduling = self.device_config.torch_device.type == "cuda" and pp == 1
        self.cache_config.verify_swap_space(self.parallel_config.tensor_parallel_size)
        self.parallel_config.verify_model(self.model_config.get_text_config())
        self.parallel_config.verify_devices(self.device_config.device)
        if self.lora_config is not None:
            self.lora_config.verify_parallel(self.parallel_config.tensor_parallel_size)
        _verify_hybrid(self)


def has_recurrent_layers(config) -> bool:
    """Whether the model has recurrent (Gated DeltaNet, `linear_attention`) layers beside attention."""
    mc = getattr(config, "model_config", None)
    if getattr(mc, "hf_config", None) is None:
        return False
    return "linear_attention" in (getattr(mc.get_text_config(), "layer_types", None) or [])


def _verify_hybrid(config: TokenmillConfig) -> None:
    """A model with recurrent (Gated DeltaNet, `linear_attention`) layers: refuse what those layers cannot honour
    yet, naming the flag; say how prefix caching works for them (state checkpoints, core/state_checkpoints.py)."""
    if not has_recurrent_layers(config):
        return
    mc = config.model_config
    kind = f"linear_attention (Gated DeltaNet) layers of {mc.architecture}"
    refused = []
    if config.cache_config.kv_cache_dtype not in ("auto", "bfloat16", "float16"):
        refused.append(f"kv_cache_dtype={config.cache_config.kv_cache_dtype} (the {kind} keep their recurrent "
                       "state in the model dtype / float32, and fp8 for the attention layers beside them is not "
                       "built yet)")
    if config.speculative_config is not None:
        refused.append(f"speculative_config (rejected drafts would need the recurrent state of the {kind} "
                       "rolled back)")
    if config.parallel_config.pipeline_parallel_size > 1:
        refused.append(f"pipeline_parallel_size={config.parallel_config.pipeline_parallel_size} (for the {kind})")
    if refused:
        raise ValueError("Not supported yet: " + "; ".join(refused) + ".")
    if config.cache_config.enable_prefix_caching:
        from tokenmill.logger import init_logger
        init_logger(__name__).info(
            "Prefix caching on %s: the %s save their recurrent state at block boundaries (every 32nd block of a "
            "prompt and its last full block) in up to max_num_seqs checkpoints; a prefix hit ends at a saved "
            "one.", mc.architecture, kind.split(" of ")[0])


__all__ = ["CacheConfig", "CompilationConfig", "DeviceConfig", "LoadConfig", "LoRAConfig", "ModelConfig", "ParallelConfig",
           "SchedulerConfig", "SpeculativeArgs", "SpeculativeConfig", "TokenmillConfig", "CONFIG_CLASSES"]
