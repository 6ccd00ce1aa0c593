"""CUDA-graph configuration (vLLM keeps these in its CompilationConfig)."""
from __future__ import annotations

from dataclasses import dataclass

from tokenmill.config.utils import config_field


CUDAGRAPH_MODES = ("NONE", "PIECEWISE", "FULL", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE")


@dataclass
class CompilationConfig:
    """Which batches are captured as CUDA graphs: decode batch sizes, and the mixed-batch token capacities (ignored
    on CPU; off with enforce_eager)."""
    cudagraph_capture_sizes: list[int] | None = config_field(
        None, help="Decode batch sizes to capture (default: 1, 2, 4, 8, then steps of 8/16 up to the maximum).")
    max_cudagraph_capture_size: int | None = config_field(
        None, help="Largest captured decode batch (default: min(max_num_seqs, 512)); also caps the token "
                   "capacity of the mixed-batch graphs.")
    cudagraph_mode: str | None = config_field(
        None, help="Which batches replay CUDA graphs. FULL_DECODE_ONLY: decode batches only. FULL, PIECEWISE, "
                   "FULL_AND_PIECEWISE (the default, as in vLLM): decode batches, and batches with prefill chunks "
                   "up to 512 tokens (tokenmill captures the whole forward, attention included, for those too). "
                   "NONE: no graphs (like enforce_eager).")

    def __post_init__(self) -> None:
        if self.cudagraph_capture_sizes is not None:
            sizes = self.cudagraph_capture_sizes
            if not sizes or any(not isinstance(s, int) or s < 1 for s in sizes):
                raise ValueError(f"Invalid value {sizes!r} for `cudagraph_capture_sizes`: positive integers.")
        if self.max_cudagraph_capture_size is not None and self.max_cudagraph_capture_size < 1:
            raise ValueError(f"Invalid value {self.max_cudagraph_capture_size} for `max_cudagraph_capture_size`.")
        if self.cudagraph_mode is not None:
            mode = str(self.cudagraph_mode).upper()
            if mode not in CUDAGRAPH_MODES:
                raise ValueError(f"Invalid value {self.cudagraph_mode!r} for `cudagraph_mode`: one of "
                                 f"{', '.join(CUDAGRAPH_MODES)}.")
            self.cudagraph_mode = mode

    @property
    def graphs_enabled(self) -> bool:
        return self.cudagraph_mode != "NONE"

    def graph_output_rows(self, max_num_seqs: int, max_num_batched_tokens: int) -> int:
        """Rows of logits the captured graphs keep, one [rows, vocab] output per graph (the worker leaves them out
        of the KV budget)."""
        if not self.graphs_enabled:
            return 0
        return (sum(self.capture_sizes(max_num_seqs))
                + sum(r for _, r in self.mixed_capture_sizes(max_num_batched_tokens, max_num_seqs)))

    def mixed_capture_sizes(self, max_num_batched_tokens: int, max_num_seqs: int) -> list[tuple[int, int]]:
        """(tokens, requests) capacities of the mixed-batch graphs; none in FULL_DECODE_ONLY mode."""
        from tokenmill.worker.cuda_graph import mixed_capture_sizes
        if self.cudagraph_mode in ("NONE", "FULL_DECODE_ONLY"):
            return []
        limit = min(self.max_cudagraph_capture_size or 512, max_num_batched_tokens)
        return mixed_capture_sizes(limit, min(max_num_seqs, self.max_cudagraph_capture_size or 512))

    def capture_sizes(self, max_num_seqs: int) -> list[int]:
        from tokenmill.worker.cuda_graph import default_capture_sizes
        limit = min(self.max_cudagraph_capture_size or 512, max_num_seqs)
        if self.cudagraph_capture_sizes is not None:
            return sorted({s for s in self.cudagraph_capture_sizes if s <= limit}) or [1]
        return default_capture_sizes(limit)
