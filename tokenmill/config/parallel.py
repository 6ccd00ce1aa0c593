"""Parallelism configuration (one device for now; the fields exist so vLLM command lines parse)."""
from __future__ import annotations

from dataclasses import dataclass

from tokenmill.config.utils import check_choices, check_range, config_field, not_supported_yet


@dataclass
class ParallelConfig:
    """How the model is spread over devices."""
    tensor_parallel_size: int = config_field(1, help="Number of tensor-parallel ranks.")
    pipeline_parallel_size: int = config_field(1, help="Number of pipeline stages.")
    data_parallel_size: int = config_field(1, help="Number of data-parallel engine replicas (engine cores), each "
                                                   "with its own devices and KV cache, behind one API server.")
    data_parallel_size_local: int | None = config_field(
        None, help="Data-parallel replicas on this node; unset = all ranks from data_parallel_start_rank on. 0 on "
                   "the head node runs only the API server.")
    data_parallel_start_rank: int | None = config_field(
        None, help="First data-parallel rank on this node (for --headless secondary nodes); unset = 0.")
    data_parallel_address: str | None = config_field(
        None, help="Address of the data-parallel head node, where engine cores of other nodes connect; unset = "
                   "127.0.0.1.")
    data_parallel_rpc_port: int | None = config_field(
        None, help="TCP port of the head node's engine start-up handshake; unset = 29550.")
    distributed_executor_backend: str | None = config_field(
        None, help="uni, mp, ray or external_launcher.", choices=("uni", "mp", "ray", "external_launcher"))
    disable_custom_all_reduce: bool = config_field(False, help="Use torch's NCCL all-reduce only.")
    enable_expert_parallel: bool = config_field(False, help="Expert parallelism for MoE layers.")

    def __post_init__(self) -> None:
        check_choices(self)
        self._check_data_parallel()
        for name in ("tensor_parallel_size", "pipeline_parallel_size"):
            check_range(name, getattr(self, name), 1)
            if getattr(self, name) != 1:
                raise not_supported_yet(name, getattr(self, name), "Only a single device runs today.")
        if self.distributed_executor_backend in ("ray", "external_launcher"):
            raise not_supported_yet("distributed_executor_backend", self.distributed_executor_backend,
                                    "One process runs the model (uni/mp).")
        if self.enable_expert_parallel:
            raise not_supported_yet("enable_expert_parallel", True)

    def _check_data_parallel(self) -> None:
        """Resolves the unset data-parallel fields (vLLM's meanings) and checks that the ranks add up."""
        check_range("data_parallel_size", self.data_parallel_size, 1)
        if self.data_parallel_start_rank is None:
            self.data_parallel_start_rank = 0
        check_range("data_parallel_start_rank", self.data_parallel_start_rank, 0, self.data_parallel_size - 1)
        if self.data_parallel_size_local is None:
            self.data_parallel_size_local = self.data_parallel_size - self.data_parallel_start_rank
        check_range("data_parallel_size_local", self.data_parallel_size_local, 0,
                    self.data_parallel_size - self.data_parallel_start_rank)
        self.data_parallel_address = self.data_parallel_address or "127.0.0.1"
        if self.data_parallel_rpc_port is None:
            self.data_parallel_rpc_port = 29550
        check_range("data_parallel_rpc_port", self.data_parallel_rpc_port, 1, 65535)

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size
