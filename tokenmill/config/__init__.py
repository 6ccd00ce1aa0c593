"""Configuration: one dataclass per concern; `EngineArgs` builds them from flat keyword arguments or the CLI."""
from __future__ import annotations

from dataclasses import dataclass

from tokenmill.config.cache import CacheConfig
from tokenmill.config.compilation import CompilationConfig
from tokenmill.config.device import DeviceConfig
from tokenmill.config.load import LoadConfig
from tokenmill.config.model import ModelConfig
from tokenmill.config.parallel import ParallelConfig
from tokenmill.config.scheduler import SchedulerConfig

CONFIG_CLASSES = (ModelConfig, CacheConfig, SchedulerConfig, LoadConfig, ParallelConfig, DeviceConfig,
                  CompilationConfig)


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

    def __post_init__(self) -> None:
        self.scheduler_config.finalize(self.model_config.max_model_len)
        pp = self.parallel_config.pipeline_parallel_size
        if pp > 1 and self.scheduler_config.async_scheduling:
            raise ValueError(f"async_scheduling=True cannot be combined with pipeline_parallel_size={pp}: the "
                             "pipeline overlaps micro-batches instead (a request waits for its sampled token "
                             "before it is scheduled again). Leave async_scheduling unset or pass False.")
        if self.scheduler_config.async_scheduling is None:
            # Overlap pays where the device runs asynchronously to the host; on the CPU the forward is the host.
            # Pipeline parallelism keeps several micro-batches in flight instead.
            self.scheduler_config.async_scheduling = self.device_config.torch_device.type == "cuda" and pp == 1
        self.cache_config.verify_swap_space(self.parallel_config.tensor_parallel_size)
        self.parallel_config.verify_model(self.model_config.get_text_config())
        self.parallel_config.verify_devices(self.device_config.device)


__all__ = ["CacheConfig", "CompilationConfig", "DeviceConfig", "LoadConfig", "ModelConfig", "ParallelConfig", "SchedulerConfig",
           "TokenmillConfig", "CONFIG_CLASSES"]
