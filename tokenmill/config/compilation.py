"""CUDA-graph configuration (vLLM keeps these in its CompilationConfig)."""
from __future__ import annotations

from dataclasses import dataclass

from tokenmill.config.utils import config_field


@dataclass
class CompilationConfig:
    """Which decode batch sizes are captured as CUDA graphs (ignored on CPU; off with enforce_eager)."""
    cudagraph_capture_sizes: list[int] | None = config_field(
        None, help="Decode batch sizes to capture (default: 1, 2, 4, 8, then steps of 8/16 up to the maximum).")
    max_cudagraph_capture_size: int | None = config_field(
        None, help="Largest captured decode batch (default: min(max_num_seqs, 512)).")

    def __post_init__(self) -> None:
        if self.cudagraph_capture_sizes is not None:
            sizes = self.cudagraph_capture_sizes
            if not sizes or any(not isinstance(s, int) or s < 1 for s in sizes):
                raise ValueError(f"Invalid value {sizes!r} for `cudagraph_capture_sizes`: positive integers.")
        if self.max_cudagraph_capture_size is not None and self.max_cudagraph_capture_size < 1:
            raise ValueError(f"Invalid value {self.max_cudagraph_capture_size} for `max_cudagraph_capture_size`.")

    def capture_sizes(self, max_num_seqs: int) -> list[int]:
        from tokenmill.worker.cuda_graph import default_capture_sizes
        limit = min(self.max_cudagraph_capture_size or 512, max_num_seqs)
        if self.cudagraph_capture_sizes is not None:
            return sorted({s for s in self.cudagraph_capture_sizes if s <= limit}) or [1]
        return default_capture_sizes(limit)
