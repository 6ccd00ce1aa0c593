"""torch.compile of the CPU model step, vLLM's -O3 trade: start-up time for per-step speed.

A CPU step of a small model is bound by per-op overhead: the default model runs ~35 small ops a layer
around its products. Inductor fuses them into a few C++ loops per layer; attention stays the backend's own eager
code behind one opaque op (layers/opaque_attention.py), so the graph holds no per-step metadata and needs no
guard on it. Measured on the default model, 2 cores (AMX host): a decode step at 1 / 16 / 32 rows 13.3 / 42.7 /
61.4 ms eager, 10.7 / 36.6 / 51.8 ms compiled. The cost is start-up: a graph takes ~25 s to compile the first time
and ~5 s once inductor's on-disk cache holds it, and the step has three (one row; 2 to 11 rows; 12 or more, where
the GGUF products switch to their dense copy), all built before the engine reports ready. Hence opt-in (-O3, or a
compilation_config mode of 1-3), never the default.

Every step runs through these graphs (decode batches, speculative verify steps, prefill chunks: each graph is
generic in the token count within its range); a step outside them (a GGUF step of more than 160 tokens, where the
products switch form again) runs eagerly rather than compiling mid-serving. Only models that declare
`supports_torch_compile` (their layers reach attention through the opaque op) compile, and not with LoRA, a draft
model or EAGLE head, tensor or pipeline parallelism, or pooling: those change Python-side state between steps, which
the compiled graph does not guard (its guards on the model's modules are dropped: they cost 0.3-0.45 ms a call and
the modules never change after loading). CUDA never compiles: its steps run tokenmill's Triton kernels inside CUDA
graphs at every level.
"""
from __future__ import annotations

import itertools
import time

import numpy as np
import torch

from tokenmill.attention.backend import AttentionMetadata
from tokenmill.forward_context import set_forward_context
from tokenmill.logger import init_logger

logger = init_logger(__name__)

# Decode batch sizes run once at start-up so that their graphs exist before the first request: one row, a few
# rows, and a batch large enough for the GGUF products' dense copies (layers/quantization/gguf_cpu.py).
WARM_SIZES = (1, 2, 16)
_IDS = itertools.count()


def compile_steps(runner, num_blocks: int) -> CompiledSteps | None:
    """`runner`'s model compiled for its steps, its graphs built; None (logged) where that does not apply."""
    if runner.device.type != "cpu":
        return None
    why = not_compiled_because(runner)
    if why is not None:
        logger.info("Compilation requested (-O3 or a compilation_config mode): steps run eagerly, %s.", why)
        return None
    t = time.perf_counter()
    compiled = CompiledSteps(runner.model)
    compiled.warm_up(runner.kv_caches, runner.block_size, min(runner.max_num_reqs, num_blocks))
    logger.info("The model's steps compiled with torch.compile in %.1f s (sizes %s).", time.perf_counter() - t,
                ", ".join(map(str, WARM_SIZES)))
    return compiled


def not_compiled_because(runner) -> str | None:
    """Why `runner`'s steps cannot run compiled, or None when they can."""
    cfg = runner.config
    if cfg.model_config.enforce_eager:
        return "as enforce_eager asks"
    if not getattr(runner.model, "supports_torch_compile", False):
        return f"{type(runner.model).__name__} does not support it"
    spec = runner.spec
    for what, off in (("LoRA", runner.lora is not None),
                      ("a draft model or EAGLE head", spec is not None and spec.uses_draft_model),
                      ("pipeline parallelism", runner.link is not None),
                      ("tensor parallelism", cfg.parallel_config.tensor_parallel_size > 1),
                      ("pooling", runner.pooler is not None),
                      ("several KV cache groups", runner.group_tables is not None),
                      ("recurrent layers", runner.state_cache is not None)):
        if off:
            return f"not with {what}"
    return None


def _forward_of(model: torch.nn.Module):
    """model(input_ids, positions) as a function with a code object of its own. dynamo keeps compiled graphs on the
    code object they start from, and the guards that would tell one model from another (its type, the constants
    traced into the graph such as the layers' opaque attention ids) are dropped below: one code object per model
    keeps one model's graphs from ever serving another."""
    def forward(input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return model(input_ids, positions)
    forward.__code__ = forward.__code__.replace(co_name=f"compiled_decode_{next(_IDS)}")
    return forward


class CompiledSteps:
    """A model's forward compiled for its steps. Call it as the model (inside a forward context); `warm_up` builds
    the graphs before serving."""

    def __init__(self, model: torch.nn.Module) -> None:
        # Guards on the model's modules are dropped: hundreds of checks that hooks are empty, attributes absent and
        # constants unchanged cost ~0.3-0.45 ms a call (a step is ~10 ms), and a loaded model never changes.
        self._fn = torch.compile(_forward_of(model), dynamic=None,
                                 options={"guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe})
        self.steps = 0  # steps run compiled (tests check that the graphs serve)

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, intermediate: None = None) -> torch.Tensor:
        """One step, as the model's forward (never a pipeline stage's: `intermediate` is always None); a token count
        no warm-up graph covers runs eagerly rather than compiling mid-serving."""
        self.steps += 1
        with torch.compiler.set_stance("eager_on_recompile"):
            return self._fn(input_ids, positions)

    @torch.inference_mode()
    def warm_up(self, kv_caches: list[torch.Tensor], block_size: int, max_rows: int) -> None:
        """Run one dummy decode step per size of WARM_SIZES (up to max_rows): row r at position 0 of block r (the
        engine serves nothing yet, so those cache slots hold nothing)."""
        for b in sorted({min(s, max_rows) for s in WARM_SIZES}):
            rows = np.arange(b)
            md = AttentionMetadata(
                num_actual_tokens=b, slot_mapping=torch.as_tensor(rows * block_size),
                query_start_loc=torch.arange(b + 1, dtype=torch.int32), seq_lens=torch.ones(b, dtype=torch.int32),
                block_table=torch.as_tensor(rows[:, None], dtype=torch.int32), max_query_len=1, max_seq_len=1,
                query_start_loc_cpu=np.arange(b + 1, dtype=np.int32), seq_lens_cpu=np.ones(b, dtype=np.int32))
            ids = torch.zeros(b, dtype=torch.long)
            with set_forward_context(md, kv_caches):
                self._fn(ids, torch.zeros(b, dtype=torch.long))
