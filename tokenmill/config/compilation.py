"""CUDA-graph configuration (vLLM keeps these in its CompilationConfig)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tokenmill.config.utils import config_field, not_supported_yet


CUDAGRAPH_MODES = ("NONE", "PIECEWISE", "FULL", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE")
# vLLM's torch.compile levels (its CompilationConfig.mode / level). On CUDA tokenmill's fused Triton kernels run at
# every level; on the CPU any level but 0 / NONE compiles the model's step (worker/cpu_compile.py).
COMPILE_MODES = (0, 1, 2, 3, "NONE", "STOCK_TORCH_COMPILE", "DYNAMO_TRACE_ONCE", "VLLM_COMPILE")
# Keys of vLLM's --compilation-config that map onto these fields.
_GRAPH_KEYS = ("cudagraph_capture_sizes", "max_cudagraph_capture_size", "cudagraph_mode")
# -O levels -> cudagraph_mode when it is not set explicitly (vLLM's levels trade start-up time for speed).
_LEVEL_MODES = {0: "NONE", 1: "FULL_DECODE_ONLY", 2: None, 3: None}
# Token capacities of the mixed-batch graphs (batches that also hold prefill chunks).
MIXED_TOKEN_SIZES = (16, 32, 64, 128, 256, 512)


def default_capture_sizes(max_size: int) -> list[int]:
    """Decode graph batch sizes: 1, 2, 4, 8, then steps of 8 up to 256 and of 16 beyond, capped at max_size."""
    sizes = [s for s in (1, 2, 4) if s <= max_size]
    sizes += list(range(8, min(max_size, 256) + 1, 8))
    sizes += list(range(272, max_size + 1, 16))
    if max_size not in sizes:
        sizes.append(max_size)
    return sorted(set(sizes))


def mixed_capture_sizes(max_tokens: int, max_reqs: int) -> list[tuple[int, int]]:
    """(token capacity, request capacity) of each mixed graph: powers of two from 16 up to max_tokens."""
    return [(t, min(t, max_reqs)) for t in MIXED_TOKEN_SIZES if t <= max_tokens]


def logits_rows(capture_sizes: list[int], mixed_sizes: list[tuple[int, int]]) -> int:
    """Rows of the one logits buffer the graphs share: a uniform graph of b requests with q tokens each returns
    every token's logits (b * q rows), a mixed graph each request's last token's."""
    return max(list(capture_sizes) + [r for _, r in mixed_sizes] + [0])


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
    compilation_config: dict[str, Any] | int | None = config_field(
        None, help="vLLM's compilation config as JSON (-cc, or -cc.KEY VALUE): its cudagraph_capture_sizes, "
                   "max_cudagraph_capture_size and cudagraph_mode set the flags of the same names; its mode / level "
                   "(torch.compile levels 0-3): on the CPU a level other than 0 / NONE runs the model's steps "
                   "through torch.compile (as -O3 does: slower start-up, faster steps) and 0 / NONE keeps them "
                   "eager; on CUDA they change nothing (tokenmill runs its own fused Triton kernels and CUDA "
                   "graphs there). Any other key is an error.")
    optimization_level: int = config_field(
        2, help="-O0: no CUDA graphs (the fastest start-up); -O1: decode-batch graphs only; -O2 (the default) and "
                "-O3: decode and mixed-batch graphs. An explicit --cudagraph-mode wins. On the CPU, -O3 also "
                "runs the model's steps through torch.compile (default model: 14-19% faster steps for ~15 s more "
                "start-up, ~80 s the first time).", choices=(0, 1, 2, 3))

    def __post_init__(self) -> None:
        if self.optimization_level not in _LEVEL_MODES:
            raise ValueError(f"Invalid value {self.optimization_level!r} for `optimization_level`: 0, 1, 2 or 3.")
        self._apply_compilation_config()
        if self.cudagraph_mode is None and self.optimization_level in _LEVEL_MODES:
            self.cudagraph_mode = _LEVEL_MODES[self.optimization_level]
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

    def _apply_compilation_config(self) -> None:
        cc = self.compilation_config
        if cc is None:
            return
        if isinstance(cc, int) and not isinstance(cc, bool):  # vLLM's LLM(compilation_config=3): a compile level
            cc = {"mode": cc}
        if not isinstance(cc, dict):
            raise ValueError(f"Invalid value {cc!r} for `compilation_config`: a JSON object (or a compile level).")
        unknown = sorted(k for k in cc if k not in (*_GRAPH_KEYS, "mode", "level"))
        if unknown:
            raise not_supported_yet("compilation_config", {k: cc[k] for k in unknown},
                                    "Its keys cudagraph_capture_sizes, max_cudagraph_capture_size, cudagraph_mode "
                                    "and mode / level are.")
        for key in ("mode", "level"):
            if key in cc and cc[key] is not None and cc[key] not in COMPILE_MODES:
                raise ValueError(f"Invalid value {cc[key]!r} for `compilation_config.{key}`: one of "
                                 f"{', '.join(map(str, COMPILE_MODES))}.")
        for key in _GRAPH_KEYS:
            if key not in cc or cc[key] is None:
                continue
            mine = getattr(self, key)
            if mine is not None and mine != cc[key]:
                raise ValueError(f"`{key}` is given twice with different values: {mine!r} and "
                                 f"compilation_config.{key}={cc[key]!r}.")
            setattr(self, key, cc[key])

    @property
    def torch_compile(self) -> bool:
        """Whether the CPU model step runs through torch.compile (worker/cpu_compile.py): with -O3, or with a
        compilation_config mode / level other than 0 / NONE."""
        cc = self.compilation_config
        if isinstance(cc, int) and not isinstance(cc, bool):
            cc = {"mode": cc}
        modes = [cc.get(k) for k in ("mode", "level") if cc.get(k) is not None] if isinstance(cc, dict) else []
        if modes:
            return any(m not in (0, "NONE") for m in modes)
        return self.optimization_level == 3

    @property
    def graphs_enabled(self) -> bool:
        return self.cudagraph_mode != "NONE"

    def graph_output_rows(self, max_num_seqs: int, max_num_batched_tokens: int, verify_q: int = 1) -> int:
        """Rows of the one [rows, vocab] logits buffer every captured graph writes into (they replay one at a time):
        the largest graph's logits (the worker leaves it out of the KV budget). verify_q: tokens per request of the
        speculative verify graphs (1: none)."""
        if not self.graphs_enabled:
            return 0
        rows = logits_rows(self.capture_sizes(max_num_seqs),
                           self.mixed_capture_sizes(max_num_batched_tokens, max_num_seqs))
        return max([rows] + [s * verify_q for s in self.verify_capture_sizes(max_num_seqs, verify_q)])

    def mixed_capture_sizes(self, max_num_batched_tokens: int, max_num_seqs: int) -> list[tuple[int, int]]:
        """(tokens, requests) capacities of the mixed-batch graphs; none in FULL_DECODE_ONLY mode."""
        if self.cudagraph_mode in ("NONE", "FULL_DECODE_ONLY"):
            return []
        limit = min(self.max_cudagraph_capture_size or 512, max_num_batched_tokens)
        return mixed_capture_sizes(limit, min(max_num_seqs, self.max_cudagraph_capture_size or 512))

    def verify_capture_sizes(self, max_num_seqs: int, q: int) -> list[int]:
        """Batch sizes of the uniform graphs that verify q - 1 drafts per request: the decode sizes whose s * q
        tokens fit max_cudagraph_capture_size (in tokens, as vLLM counts it; 512 when unset)."""
        if q <= 1 or not self.graphs_enabled:
            return []
        limit = self.max_cudagraph_capture_size or 512
        return [s for s in self.capture_sizes(max_num_seqs) if s * q <= limit]

    def capture_sizes(self, max_num_seqs: int) -> list[int]:
        limit = min(self.max_cudagraph_capture_size or 512, max_num_seqs)
        if self.cudagraph_capture_sizes is not None:
            return sorted({s for s in self.cudagraph_capture_sizes if s <= limit}) or [1]
        return default_capture_sizes(limit)
