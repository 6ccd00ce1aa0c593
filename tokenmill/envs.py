"""Every environment variable tokenmill reads, typed, in one place, each read once per process.

`envs.NAME` parses os.environ["NAME"] (or takes the default) on its first access and keeps that value for the life
of the process: a later change of os.environ is not seen here. Processes started later (spawned engine cores, worker
and API-server processes) read their own environment again, so code that sets a variable for its children writes
os.environ before starting them; it does not read the value back through this module.

A malformed value (a non-integer for an integer variable, an unknown choice, a boolean that is neither of 1/0,
true/false, yes/no, on/off) raises ValueError naming the variable on that first access.

Tests change values with `envs.override(NAME=value, ...)`: a context manager taking typed values (checked against the
variable's type and choices) that restores the previous state on exit. `envs.reset(*names)` forgets cached values
(every one without names), so the next access reads os.environ again.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
from typing import Any, Iterator

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off", "")


@dataclasses.dataclass(frozen=True)
class _Var:
    """One variable: its type (bool, int or str; str variables may default to None), default and allowed values."""

    kind: type
    default: Any
    choices: tuple[str, ...] | None = None
    # Triton's own reading of a boolean (true only for 1 / true / on, anything else false), for its variables.
    lenient: bool = False

    def parse(self, name: str, raw: str | None) -> Any:
        if raw is None:
            return self.default
        if self.kind is bool:
            low = raw.strip().lower()
            if self.lenient:
                return low in ("1", "true", "on")
            if low in _TRUE:
                return True
            if low in _FALSE:
                return False
            raise ValueError(f"{name}={raw!r}: expected a boolean (1/0, true/false, yes/no, on/off)")
        if self.kind is int:
            try:
                return int(raw)
            except ValueError:
                raise ValueError(f"{name}={raw!r}: expected an integer") from None
        return self.check(name, raw)

    def check(self, name: str, value: Any) -> Any:
        """`value` as an override of `name`: of the variable's type (None only where that is the default)."""
        ok = (value is None and self.default is None) or (
            isinstance(value, self.kind) and (self.kind is bool or not isinstance(value, bool)))
        if not ok:
            article = "an" if self.kind is int else "a"
            raise TypeError(f"envs.override: {name} takes {article} {self.kind.__name__}, got {value!r}")
        if self.choices is not None and value not in self.choices:
            raise ValueError(f"{name}={value!r}: choose one of {', '.join(self.choices)}")
        return value


def _str(default: str | None = None, choices: tuple[str, ...] | None = None) -> _Var:
    return _Var(str, default, choices)


_VARIABLES: dict[str, _Var] = {
    # Where converted tokenizers, parsed GGUF configs, snapshots of HF configs (read without importing transformers
    # on a later start) and other derived artefacts are cached ("" = no cache).
    "TOKENMILL_CACHE_DIR": _str(os.path.expanduser("~/.cache/tokenmill")),
    # Log level of the `tokenmill` logger (DEBUG, INFO, WARNING, ERROR, CRITICAL; any case); VLLM_LOGGING_LEVEL is
    # vLLM's name for it, read second; INFO when neither is set.
    "TOKENMILL_LOGGING_LEVEL": _str(),
    "VLLM_LOGGING_LEVEL": _str(),
    # Default attention backend name (see tokenmill/attention/registry.py); empty = pick by device.
    "TOKENMILL_ATTENTION_BACKEND": _str(""),
    # Small-batch decode GEMV (tokenmill/kernels/gemv_config.py): "auto" = the products the device's measured
    # table (tokenmill/kernels/configs/) gives to the gemv, "never" = cuBLAS for every product (the baseline to
    # compare a table against), "always" = every eligible product (at most 16 rows) on the gemv, with the table's
    # config or the default one (tests use it to cover the fused paths on tiny shapes).
    "TOKENMILL_GEMV": _str("auto", ("auto", "always", "never")),
    # KV cache size on CPU when neither kv_cache_memory_bytes nor num_gpu_blocks_override is given.
    "TOKENMILL_CPU_KVCACHE_SPACE_GIB": _Var(int, 1),
    # Number of torch intra-op threads on CPU (0 = what VLLM_CPU_OMP_THREADS_BIND picks).
    "TOKENMILL_CPU_NUM_THREADS": _Var(int, 0),
    # vLLM's CPU knobs. KV cache size on CPU in GiB (0 = TOKENMILL_CPU_KVCACHE_SPACE_GIB's value).
    "VLLM_CPU_KVCACHE_SPACE": _Var(int, 0),
    # CPU threads and pinning of each CPU rank: auto, nobind, or CPU lists per rank ("0-1", "0-1|2-3");
    # tokenmill/worker/cpu_threads.py says what each does.
    "VLLM_CPU_OMP_THREADS_BIND": _str("auto"),
    # Accumulate per-phase step times (schedule / execute / update / graph vs eager) for benchmarks.
    "TOKENMILL_STEP_TIMING": _Var(bool, False),
    # Log engine steps slower than this many milliseconds, with their phases and batch (0 = off; sets
    # TOKENMILL_STEP_TIMING's phase accounting on in the engine core).
    "TOKENMILL_SLOW_STEP_MS": _Var(int, 0),
    # Log API-server event-loop stalls longer than this many milliseconds (0 = off).
    "TOKENMILL_LOOP_LAG_MS": _Var(int, 0),
    # Log garbage collections slower than TOKENMILL_GC_DEBUG_MS milliseconds (see tokenmill/gc_utils.py).
    "TOKENMILL_GC_DEBUG": _Var(bool, False),
    "TOKENMILL_GC_DEBUG_MS": _Var(int, 5),
    # API key for the server when --api-key is not given; VLLM_API_KEY is vLLM's name for it, read second.
    "TOKENMILL_API_KEY": _str(),
    "VLLM_API_KEY": _str(),
    # The key `tokenmill bench serve` sends when --api-key is not given (as the OpenAI clients read it).
    "OPENAI_API_KEY": _str(),
    # Set by torchrun for --distributed-executor-backend external_launcher (read only; None when absent).
    "RANK": _str(),
    "LOCAL_RANK": _str(),
    "WORLD_SIZE": _str(),
    "MASTER_ADDR": _str(),
    "MASTER_PORT": _str(),
    # Which GPUs torch may see (named in the error when a run asks for more ranks than devices).
    "CUDA_VISIBLE_DEVICES": _str(),
    # NCCL's NVLink multicast switch as the user set it (None: unset); tokenmill sets it to 0 for its ranks then.
    "NCCL_NVLS_ENABLE": _str(),
    # torch symmetric memory's NVLink multicast switch as the user set it; tokenmill sets it to 1 (off) if unset.
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": _str(),
    # prometheus_client's multiprocess directory; set by tokenmill when several API server processes share the
    # metrics (--api-server-count > 1).
    "PROMETHEUS_MULTIPROC_DIR": _str(),
    # The most sequences one request may ask for (n, and best_of's candidates), as vLLM's variable of that name: a
    # larger n is refused up front instead of tying up the server building that many sequences.
    "VLLM_MAX_N_SEQUENCES": _Var(int, 16384),
    # vLLM's switch for POST /v1/load_lora_adapter and /v1/unload_lora_adapter (off: the routes answer 404).
    "VLLM_ALLOW_RUNTIME_LORA_UPDATING": _Var(bool, False),
    # vLLM's switch for the server's development routes (entrypoints/openai/dev_routes.py): POST /sleep, /wake_up,
    # /reset_prefix_cache and GET /is_sleeping, which RL frameworks call between rollouts (off: 404).
    "VLLM_SERVER_DEV_MODE": _Var(bool, False),
    # vLLM's torch-profiler variables: LLM.start_profile() / stop_profile() write one trace per worker to
    # VLLM_TORCH_PROFILER_DIR (unset: profiling is off and start_profile() says so); the others choose what the
    # traces record (tokenmill/worker/profiler.py).
    "VLLM_TORCH_PROFILER_DIR": _str(),
    "VLLM_TORCH_PROFILER_RECORD_SHAPES": _Var(bool, False),
    "VLLM_TORCH_PROFILER_WITH_PROFILE_MEMORY": _Var(bool, False),
    "VLLM_TORCH_PROFILER_WITH_STACK": _Var(bool, True),
    "VLLM_TORCH_PROFILER_WITH_FLOPS": _Var(bool, False),
    # MoE layers on CUDA: the router's softmax + top-k and the expert layout of decode-sized batches as one Triton
    # launch each (kernels/triton_moe_routing.py) instead of ~20 torch ops a layer. Off until measured on a device.
    "TOKENMILL_MOE_ROUTING_KERNELS": _Var(bool, False),
    # Triton's CPU interpreter, as Triton reads it: the kernels take their interpreter-only branches.
    "TRITON_INTERPRET": _Var(bool, False, lenient=True),
    # Where Triton keeps compiled kernels (None: its default, ~/.triton/cache); `tokenmill bench profile` counts the
    # kernels compiled during a run there.
    "TRITON_CACHE_DIR": _str(),
    # The locale variables, in the order that picks the language of `--help` (tokenmill/config/help_zh.py).
    "LANGUAGE": _str(),
    "LC_ALL": _str(),
    "LC_MESSAGES": _str(),
    "LANG": _str(),
}

NCCL_NVLS_ENABLE_NAME = "NCCL_NVLS_ENABLE"
TORCH_SYMM_MEM_DISABLE_MULTICAST_NAME = "TORCH_SYMM_MEM_DISABLE_MULTICAST"
_UNSET = object()


def __getattr__(name: str) -> Any:
    var = _VARIABLES.get(name)
    if var is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = var.parse(name, os.environ.get(name))
    globals()[name] = value     # later reads are plain module attribute lookups
    return value


def __dir__() -> list[str]:
    return sorted(set(_VARIABLES) | {"override", "reset", "NCCL_NVLS_ENABLE_NAME",
                                     "TORCH_SYMM_MEM_DISABLE_MULTICAST_NAME"})


def _known(names) -> None:
    unknown = sorted(set(names) - set(_VARIABLES))
    if unknown:
        raise AttributeError(f"tokenmill.envs has no variable(s) {unknown}")


@contextlib.contextmanager
def override(**values: Any) -> Iterator[None]:
    """Within the block, `envs.NAME` is the given (typed) value; on exit each name is as before (cached or not)."""
    _known(values)
    checked = {name: _VARIABLES[name].check(name, v) for name, v in values.items()}
    g = globals()
    saved = {name: g.get(name, _UNSET) for name in checked}
    g.update(checked)
    try:
        yield
    finally:
        for name, v in saved.items():
            if v is _UNSET:
                g.pop(name, None)
            else:
                g[name] = v


def reset(*names: str) -> None:
    """Forget the cached values of `names` (all variables when none are given): the next access re-reads them."""
    _known(names)
    g = globals()
    for name in names or _VARIABLES:
        g.pop(name, None)
