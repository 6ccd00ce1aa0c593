"""Parallelism configuration: tensor and pipeline parallelism (over local processes, torchrun or a Ray cluster)
and data parallelism."""
from __future__ import annotations

from dataclasses import dataclass

from tokenmill.config.utils import check_choices, check_range, config_field, not_supported_yet

DEFAULT_MASTER_ADDR, DEFAULT_MASTER_PORT = "127.0.0.1", 29501


@dataclass
class ParallelConfig:
    """How the model is spread over devices. `distributed_executor_backend` is resolved here (None -> uni for one
    rank, mp for more), so the executor registry only reads it."""
    tensor_parallel_size: int = config_field(1, help="Number of tensor-parallel ranks.")
    pipeline_parallel_size: int = config_field(
        1, help="Number of pipeline stages: each holds a contiguous slice of the decoder layers (combinable with "
                "tensor parallelism: tensor_parallel_size x pipeline_parallel_size ranks).")
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
        None, help="uni (one process), mp (local worker processes; the default for more than one rank), ray "
                   "(worker ranks as actors of a Ray cluster, possibly on several nodes; needs "
                   "pip install 'tokenmill[ray]'), external_launcher (one engine per torchrun process).",
        choices=("uni", "mp", "ray", "external_launcher"))
    disable_custom_all_reduce: bool = config_field(
        False, help="Use NCCL for every tensor-parallel all-reduce. By default small ones (decode batches) on CUDA "
                    "use a one-shot all-reduce over torch symmetric memory (peer-to-peer, NVLink multicast off).")
    enable_expert_parallel: bool = config_field(False, help="Expert parallelism for MoE layers.")
    nnodes: int = config_field(1, help="Number of nodes of a multi-node mp run (only 1 is supported yet).")
    node_rank: int = config_field(0, help="Rank of this node in a multi-node mp run.")
    master_addr: str = config_field(
        DEFAULT_MASTER_ADDR, help="Rendezvous address of the mp and ray executors' ranks. With the defaults of this "
                                  "and --master-port, the ranks meet on a free port (loopback on one host, the "
                                  "driver node's IP across Ray nodes).")
    master_port: int = config_field(DEFAULT_MASTER_PORT, help="Rendezvous port of the mp and ray executors' ranks.")
    distributed_timeout_seconds: int | None = config_field(
        None, help="Timeout of process-group set-up and collectives, in seconds (None: torch's default).")

    def __post_init__(self) -> None:
        check_choices(self)
        self._check_data_parallel()
        for name in ("tensor_parallel_size", "pipeline_parallel_size", "nnodes"):
            check_range(name, getattr(self, name), 1)
        check_range("master_port", self.master_port, 1, 65535)
        check_range("distributed_timeout_seconds", self.distributed_timeout_seconds, 1)
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"Invalid value {self.node_rank!r} for `node_rank`: must be in [0, nnodes={self.nnodes}).")
        if self.distributed_executor_backend is None:
            self.distributed_executor_backend = "uni" if self.world_size == 1 else "mp"
        if self.distributed_executor_backend == "uni" and self.world_size > 1:
            raise ValueError(f"distributed_executor_backend='uni' runs one process, but tensor_parallel_size x "
                             f"pipeline_parallel_size = {self.world_size} ranks; use 'mp' or 'external_launcher'.")
        if self.distributed_executor_backend == "ray" and self.world_size > 1 and self.data_parallel_size > 1:
            # Each engine core's ranks would ask Ray for GPUs while the data-parallel launcher already split the
            # node's GPUs between engine cores (CUDA_VISIBLE_DEVICES): the two placements would disagree.
            raise ValueError(f"distributed_executor_backend='ray' with data_parallel_size={self.data_parallel_size} "
                             f"is not supported yet by tokenmill: data-parallel engine cores run their "
                             f"tensor-parallel ranks with mp (--distributed-executor-backend mp).")
        if self.distributed_executor_backend == "ray" and self.pipeline_parallel_size > 1:
            # The last stage's outputs reach the driver over a local socket (mp) or a torchrun-wide broadcast.
            raise not_supported_yet("pipeline_parallel_size", self.pipeline_parallel_size,
                                    "Pipeline parallelism runs on distributed_executor_backend mp (one host) or "
                                    "external_launcher (torchrun, also multi-node), not on ray.")
        if self.nnodes > 1 and self.distributed_executor_backend == "ray":
            raise ValueError(f"nnodes={self.nnodes} does not apply to distributed_executor_backend='ray': Ray "
                             f"places the ranks on the nodes of its cluster itself (join nodes with `ray start "
                             f"--address=...`). Drop --nnodes/--node-rank.")
        if self.nnodes > 1:
            # Each node would need its own engine-core feed; torchrun already gives that (external_launcher).
            raise not_supported_yet("nnodes", self.nnodes, "Multi-node runs are not built for the mp executor; "
                                    "start every node with torchrun --nnodes N and "
                                    "--distributed-executor-backend external_launcher, or use "
                                    "--distributed-executor-backend ray on a Ray cluster.")
        if self.distributed_executor_backend == "external_launcher" and (
                self.master_addr, self.master_port) != (DEFAULT_MASTER_ADDR, DEFAULT_MASTER_PORT):
            raise ValueError("master_addr/master_port do not apply to external_launcher: torchrun's MASTER_ADDR "
                             "and MASTER_PORT say where the ranks meet (pass --master-addr/--master-port to "
                             "torchrun).")
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

    def verify_model(self, text_config) -> None:
        """Fail before any process starts when the model's layers cannot be split over the pipeline stages or its
        heads or MLP over the TP ranks (the parallel layers check the same when they are built)."""
        pp = self.pipeline_parallel_size
        if text_config.num_hidden_layers < pp:
            raise ValueError(f"pipeline_parallel_size ({pp}) is larger than the model's num_hidden_layers "
                             f"({text_config.num_hidden_layers}); every stage needs at least one layer.")
        tp = self.tensor_parallel_size
        if tp == 1:
            return
        from tokenmill.distributed.utils import divide, kv_heads_per_rank
        heads = text_config.num_attention_heads
        divide(heads, tp, "num_attention_heads")
        kv_heads_per_rank(getattr(text_config, "num_key_value_heads", None) or heads, tp)
        if getattr(text_config, "intermediate_size", None):
            divide(text_config.intermediate_size, tp, "intermediate_size")

    def verify_devices(self, device_type: str) -> None:
        """Fail early, naming what was found, when a one-host run asks for more CUDA ranks than devices. CPU ranks
        are processes and always fit; torchrun ranks check their own LOCAL_RANK when they join, and the ray
        executor checks the GPUs of the whole Ray cluster."""
        if device_type != "cuda" or self.world_size == 1 or self.distributed_executor_backend in (
                "external_launcher", "ray"):
            return
        import torch

        from tokenmill import envs
        found = torch.cuda.device_count()
        if self.world_size > found:
            visible = envs.CUDA_VISIBLE_DEVICES
            where = f" (CUDA_VISIBLE_DEVICES={visible!r})" if visible is not None else ""
            raise ValueError(
                f"tensor_parallel_size {self.tensor_parallel_size} x pipeline_parallel_size "
                f"{self.pipeline_parallel_size} needs {self.world_size} CUDA devices, but torch sees {found} on "
                f"this host{where}. Lower --tensor-parallel-size to at most {found}, or run on a host with "
                f"{self.world_size} GPUs.")
