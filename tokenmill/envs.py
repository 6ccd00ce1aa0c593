"""Every TOKENMILL_* environment variable, typed, in one place. Read lazily so tests can monkeypatch os.environ."""
from __future__ import annotations

import os
from typing import Any, Callable


def _bool(name: str, default: bool) -> Callable[[], bool]:
    return lambda: os.environ.get(name, str(int(default))).strip().lower() in ("1", "true", "yes", "on")


def _str(name: str, default: str | None) -> Callable[[], str | None]:
    return lambda: os.environ.get(name, default)


def _int(name: str, default: int) -> Callable[[], int]:
    return lambda: int(os.environ.get(name, str(default)))


_VARIABLES: dict[str, Callable[[], Any]] = {
    # Where converted tokenizers and other derived artefacts are cached.
    "TOKENMILL_CACHE_DIR": _str("TOKENMILL_CACHE_DIR", os.path.expanduser("~/.cache/tokenmill")),
    # Log level of the `tokenmill` logger.
    "TOKENMILL_LOGGING_LEVEL": _str("TOKENMILL_LOGGING_LEVEL", "INFO"),
    # Default attention backend name (see tokenmill/attention/registry.py); empty = pick by device.
    "TOKENMILL_ATTENTION_BACKEND": _str("TOKENMILL_ATTENTION_BACKEND", ""),
    # Small-batch decode GEMV (tokenmill/layers/linear_ops.py): "auto" = only where measured faster than cuBLAS,
    # "always" = every eligible product (tests use it to cover the fused path on tiny shapes), "never" = cuBLAS.
    "TOKENMILL_GEMV": _str("TOKENMILL_GEMV", "auto"),
    # Small-batch decode: the SiLU-and-mul after gate_up_proj in the gemv's epilogue, where the gemv takes both
    # gate_up_proj and a plain down_proj (tokenmill/layers/linear_ops.py). 0 = the SiLU in down_proj's prologue or
    # a separate kernel (an A/B switch).
    "TOKENMILL_GEMV_SILU_EPILOGUE": _bool("TOKENMILL_GEMV_SILU_EPILOGUE", True),
    # Programmatic dependent launch between the Triton kernels of a step (Hopper and newer): each kernel starts
    # while the previous one finishes and waits on the GPU for its inputs; weights are read before that wait.
    # 0 = plain stream order (an A/B switch; tokenmill/kernels/pdl.py).
    "TOKENMILL_PDL": _bool("TOKENMILL_PDL", True),
    # Kinds of PDL kernel that let their successor launch before their own wait instead of after it (comma list of
    # gemv, attention, norm, rope, act, sampling, or "all"; empty = none). Results never change: a successor still
    # waits for this kernel to complete; only how early its programs may load weights does. The default was
    # measured on an H200 (tokenmill/kernels/pdl.py).
    "TOKENMILL_PDL_EARLY": _str("TOKENMILL_PDL_EARLY", "gemv"),
    # Pure decode steps on the Triton backend fold the q/k norm + RoPE + K/V store kernel into decode attention's
    # first stage (tokenmill/kernels/triton_decode_rope_attention.py). 0 = the separate kernel (an A/B switch).
    "TOKENMILL_DECODE_ROPE_FUSED": _bool("TOKENMILL_DECODE_ROPE_FUSED", True),
    # Decode CUDA graphs of up to 16 rows read their inputs from, and write their drawn ids to, pinned host memory
    # themselves, so no copy op runs between two replays (tokenmill/kernels/triton_step_inputs.py). 0 = copies
    # queued around the graph (an A/B switch).
    "TOKENMILL_GRAPH_HOST_IO": _bool("TOKENMILL_GRAPH_HOST_IO", True),
    # KV cache size on CPU when neither kv_cache_memory_bytes nor num_gpu_blocks_override is given.
    "TOKENMILL_CPU_KVCACHE_SPACE_GIB": _int("TOKENMILL_CPU_KVCACHE_SPACE_GIB", 1),
    # Number of torch intra-op threads on CPU (0 = torch's default).
    "TOKENMILL_CPU_NUM_THREADS": _int("TOKENMILL_CPU_NUM_THREADS", 0),
    # Accumulate per-phase step times (schedule / execute / update / graph vs eager) for benchmarks.
    "TOKENMILL_STEP_TIMING": _bool("TOKENMILL_STEP_TIMING", False),
    # Log engine steps slower than this many milliseconds, with their phases and batch (0 = off; sets
    # TOKENMILL_STEP_TIMING's phase accounting on in the engine core).
    "TOKENMILL_SLOW_STEP_MS": _int("TOKENMILL_SLOW_STEP_MS", 0),
    # Log API-server event-loop stalls longer than this many milliseconds (0 = off).
    "TOKENMILL_LOOP_LAG_MS": _int("TOKENMILL_LOOP_LAG_MS", 0),
    # Log garbage collections slower than TOKENMILL_GC_DEBUG_MS milliseconds (see tokenmill/gc_utils.py).
    "TOKENMILL_GC_DEBUG": _bool("TOKENMILL_GC_DEBUG", False),
    "TOKENMILL_GC_DEBUG_MS": _int("TOKENMILL_GC_DEBUG_MS", 5),
    # API key for the server when --api-key is not given.
    "TOKENMILL_API_KEY": _str("TOKENMILL_API_KEY", None),
    # Set by torchrun for --distributed-executor-backend external_launcher (read only; None when absent).
    "RANK": _str("RANK", None),
    "LOCAL_RANK": _str("LOCAL_RANK", None),
    "WORLD_SIZE": _str("WORLD_SIZE", None),
    "MASTER_ADDR": _str("MASTER_ADDR", None),
    "MASTER_PORT": _str("MASTER_PORT", None),
    # Which GPUs torch may see (named in the error when a run asks for more ranks than devices).
    "CUDA_VISIBLE_DEVICES": _str("CUDA_VISIBLE_DEVICES", None),
    # NCCL's NVLink multicast switch; tokenmill sets it to 0 for its ranks unless the user set it.
    "NCCL_NVLS_ENABLE": _str("NCCL_NVLS_ENABLE", None),
    # torch symmetric memory's NVLink multicast switch; tokenmill sets it to 1 (off) unless the user set it.
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": _str("TORCH_SYMM_MEM_DISABLE_MULTICAST", None),
    # prometheus_client's multiprocess directory; set by tokenmill when several API server processes share the
    # metrics (--api-server-count > 1).
    "PROMETHEUS_MULTIPROC_DIR": _str("PROMETHEUS_MULTIPROC_DIR", None),
}

NCCL_NVLS_ENABLE_NAME = "NCCL_NVLS_ENABLE"
TORCH_SYMM_MEM_DISABLE_MULTICAST_NAME = "TORCH_SYMM_MEM_DISABLE_MULTICAST"


def __getattr__(name: str) -> Any:
    if name in _VARIABLES:
        return _VARIABLES[name]()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return list(_VARIABLES)
