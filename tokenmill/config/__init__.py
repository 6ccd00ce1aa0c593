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
            # The drafts of step N+1 come from step N's accepted tokens, so N+1 is scheduled once they are known.
            if self.scheduler_config.async_scheduling:
                raise ValueError("async_scheduling=True cannot be combined with speculative_config yet: the next "
                                 "step's drafts need this step's accepted tokens. Leave async_scheduling unset.")
            if pp > 1:
                raise ValueError(f"speculative_config cannot be combined with pipeline_parallel_size={pp} yet.")
            self.scheduler_config.async_scheduling = False
        if self.scheduler_config.async_scheduling is None:
            # Overlap pays where the device runs asynchronously to the host; on the CPU the forward is the host.
            # Pipeline parallelism keeps several micro-batches in flight instead.
            self.scheduler_config.async_scheduling = self.device_config.torch_device.type == "cuda" and pp == 1
        self.cache_config.verify_swap_space(self.parallel_config.tensor_parallel_size)
        self.parallel_config.verify_model(self.model_config.get_text_config())
        self.parallel_config.verify_devices(self.device_config.device)
        if self.lora_config is not None:
            self.lora_config.verify_parallel(self.parallel_config.tensor_parallel_size)


__all__ = ["CacheConfig", "CompilationConfig", "DeviceConfig", "LoadConfig", "LoRAConfig", "ModelConfig", "ParallelConfig",
           "SchedulerConfig", "SpeculativeArgs", "SpeculativeConfig", "TokenmillConfig", "CONFIG_CLASSES"]
