"""Tensor/pipeline-parallel process groups and the collectives parallel layers use."""
from tokenmill.distributed.communication_op import (tensor_model_parallel_all_gather,
                                                    tensor_model_parallel_all_reduce, world_min)
from tokenmill.distributed.parallel_state import (ParallelState, abort_distributed, destroy_distributed,
                                                  get_parallel_state, get_pp_rank, get_pp_size, get_tp_group,
                                                  get_tp_rank, get_tp_size, get_world_cpu_group, init_distributed,
                                                  use_parallel_state)
from tokenmill.distributed.utils import divide, get_open_port, kv_heads_per_rank

__all__ = ["ParallelState", "abort_distributed", "destroy_distributed", "divide", "get_open_port",
           "get_parallel_state", "get_pp_rank", "get_pp_size", "get_tp_group", "get_tp_rank", "get_tp_size",
           "get_world_cpu_group", "init_distributed", "kv_heads_per_rank", "tensor_model_parallel_all_gather",
           "tensor_model_parallel_all_reduce", "use_parallel_state", "world_min"]
