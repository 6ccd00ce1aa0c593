"""Parallelism configuration (one device for now; the fields exist so vLLM command lines parse)."""
from __future__ import annotations

from dataclasses import dataclass

from tokenmill.config.utils import check_choices, check_range, config_field, not_supported_yet


@dataclass
class ParallelConfig:
    """How the model is spread over devices."""
    tensor_parallel_size: int = config_field(1, help="Number of tensor-parallel ranks.")
    pipeline_parallel_size: int = config_field(1, help="Number of pipeline stages.")
    data_parallel_size: int = config_field(1, help="Number of data-parallel engine replicas.")
    distributed_executor_backend: str | None = config_field(
        None, help="uni, mp, ray or external_launcher.", choices=("uni", "mp", "ray", "external_launcher"))
    disable_custom_all_reduce: bool = config_field(False, help="Use torch's NCCL all-reduce only.")
    enable_expert_parallel: bool = config_field(False, help="Expert parallelism for MoE layers.")

    def __post_init__(self) -> None:
        check_choices(self)
        for name in ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size"):
            check_range(name, getattr(self, name), 1)
            if getattr(self, name) != 1:
                raise not_supported_yet(name, getattr(self, name), "Only a single device runs today.")
        if self.distributed_executor_backend in ("ray", "external_launcher"):
            raise not_supported_yet("distributed_executor_backend", self.distributed_executor_backend,
                                    "One process runs the model (uni/mp).")
        if self.enable_expert_parallel:
            raise not_supported_yet("enable_expert_parallel", True)

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size
