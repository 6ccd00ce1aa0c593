"""The torch profiler behind LLM.start_profile() / stop_profile(): each worker traces its own process (host ops and,
on CUDA, kernels) and writes one gzipped Chrome/Perfetto trace to VLLM_TORCH_PROFILER_DIR when stopped, as vLLM does.

`profiler_dir()` is the check the engine core makes before asking the workers (a worker that raises inside a
collective call would take a multi-process engine down with it)."""
from __future__ import annotations

import os

import torch

from tokenmill import envs
from tokenmill.logger import init_logger

logger = init_logger(__name__)


def profiler_dir() -> str:
    """The trace directory; raises RuntimeError naming VLLM_TORCH_PROFILER_DIR when it is not set."""
    trace_dir = envs.VLLM_TORCH_PROFILER_DIR
    if not trace_dir:
        raise RuntimeError("Profiling is off: set VLLM_TORCH_PROFILER_DIR to the directory for the torch profiler's "
                           "traces before the engine starts (e.g. VLLM_TORCH_PROFILER_DIR=./traces), then call "
                           "start_profile() / stop_profile() around the work to trace.")
    return trace_dir


class WorkerProfiler:
    """One worker's torch profiler: `start()` begins a trace, `stop()` ends it and writes
    `<dir>/rank<rank>.<time>.pt.trace.json.gz`. start while tracing and stop while not are errors."""

    def __init__(self, rank: int, device: torch.device) -> None:
        self.rank, self.device = rank, device
        self._prof: torch.profiler.profile | None = None

    @property
    def running(self) -> bool:
        return self._prof is not None

    def start(self) -> None:
        if self._prof is not None:
            raise RuntimeError("The profiler is already running; call stop_profile() first.")
        trace_dir = os.path.abspath(profiler_dir())
        os.makedirs(trace_dir, exist_ok=True)
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        prof = torch.profiler.profile(
            activities=activities, record_shapes=envs.VLLM_TORCH_PROFILER_RECORD_SHAPES,
            profile_memory=envs.VLLM_TORCH_PROFILER_WITH_PROFILE_MEMORY,
            with_stack=envs.VLLM_TORCH_PROFILER_WITH_STACK, with_flops=envs.VLLM_TORCH_PROFILER_WITH_FLOPS,
            on_trace_ready=torch.profiler.tensorboard_trace_handler(trace_dir, worker_name=f"rank{self.rank}",
                                                                   use_gzip=True))
        prof.start()
        self._prof = prof
        logger.info("Torch profiler started on rank %d; traces go to %s", self.rank, trace_dir)

    def stop(self) -> None:
        if self._prof is None:
            raise RuntimeError("The profiler is not running; call start_profile() first.")
        prof, self._prof = self._prof, None
        prof.stop()  # writes the trace (on_trace_ready)
        logger.info("Torch profiler stopped on rank %d", self.rank)
