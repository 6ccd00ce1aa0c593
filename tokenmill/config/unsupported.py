"""vLLM options tokenmill cannot honour yet: one table for the `serve` command line and the Python API.

Each entry is a vLLM engine argument or `vllm serve` flag that no config dataclass has. It is accepted with its
default value (or one of `accepted`: values that describe what tokenmill does anyway), so existing command lines and
`LLM(...)` / `EngineArgs(...)` calls keep working; any other value is refused by `check_not_yet_supported`, with the
same message whichever way it came in. Entries marked `frontend` are API-server flags (vLLM's FrontendArgs), not
engine arguments: the Python API rejects them as unknown, as vLLM's does. A config dataclass that grows a field of
the same name takes the option over (the CLI then reads the field; remove the entry).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

from tokenmill.config.utils import not_supported_yet


@dataclasses.dataclass(frozen=True)
class NotYetSupported:
    """A vLLM option tokenmill cannot honour yet: any value other than `default`/`accepted` is an error."""
    kind: str  # bool | int | float | str | list | json
    default: Any
    help: str
    aliases: tuple[str, ...] = ()
    accepted: tuple = ()  # other values that describe what tokenmill does anyway
    frontend: bool = False  # an API-server flag, not an engine argument
    instead: str = ""  # an old vLLM flag: the current spelling to use instead (any value but the default refused)
    accepts: Callable[[Any], bool] | None = None  # further accepted values, where a list cannot name them


def _n(kind: str, default: Any, help: str, *aliases: str, ok: tuple = ()) -> NotYetSupported:
    return NotYetSupported(kind, default, help, aliases, ok)


def _f(kind: str, default: Any, help: str) -> NotYetSupported:
    return NotYetSupported(kind, default, help, frontend=True)


def _old_spec(kind: str, default: Any, help: str, example: str, *aliases: str) -> NotYetSupported:
    """A vLLM 0.7 speculative-decoding flag (seed 003), replaced by one key of --speculative-config."""
    return NotYetSupported(kind, default, help + " (vLLM 0.7)", aliases,
                           instead=f"--speculative-config '{example}'")


NOT_YET_SUPPORTED: dict[str, NotYetSupported] = {
    # general (engine arguments in vLLM too, but --grpc) and front end (vLLM's FrontendArgs)
    "grpc": _f("bool", False, "Serve gRPC instead of the HTTP OpenAI API."),
    "aggregate_engine_logging": _n("bool", False, "Log statistics aggregated over data-parallel engines."),
    "fail_on_environ_validation": _n("bool", False, "Fail on invalid environment variables."),
    "gdn_prefill_backend": _n("str", None, "Gated DeltaNet prefill backend (flashinfer or triton)."),
    "tool_server": _f("str", None, "Tool server(s) for built-in tools (host:port list or 'demo')."),
    "enable_log_deltas": _f("bool", True, "Log streamed deltas with --enable-log-outputs."),
    "log_error_stack": _f("bool", False, "Log the stack trace of request errors."),
    "tokens_only": _f("bool", False, "Token-in/token-out server without text endpoints."),
    "disable_access_log_for_endpoints": _f("str", None, "Comma-separated paths left out of the access log."),
    "ssl_ciphers": _f("str", None, "TLS cipher suites (TLS 1.2 and older)."),
    "enable_offline_docs": _f("bool", False, "Serve the API docs from bundled assets."),
    "enable_flash_late_interaction": _f("bool", True, "GPU MaxSim scoring for late-interaction models."),
    # model
    "runner": _n("str", "auto", "Model runner type (auto, generate, pooling, draft).", ok=("generate",)),
    "convert": _n("str", "auto", "Adapt the model to another task (embed, classify).", ok=("none",)),
    "task": _n("str", "auto", "vLLM 0.7 task selector (generate, embed, ...).", ok=("generate",)),
    "allowed_local_media_path": _n("str", "", "Directory requests may read local media from."),
    "allowed_media_domains": _n("list", None, "Domains multimodal URLs may come from."),
    "allow_deprecated_quantization": _n("bool", False, "Allow deprecated quantization methods."),
    "enable_return_routed_experts": _n("bool", False, "Return the MoE experts each token was routed to."),
    "config_format": _n("str", "auto", "Format of the model config (auto, hf, mistral).", ok=("hf",)),
    "hf_token": _n("str", None, "Hugging Face token for remote files (tokenmill never downloads).", ok=(False,)),
    "pooler_config": _n("json", None, "Pooling settings for embedding models."),
    "model_impl": _n("str", "auto", "Model implementation (auto, vllm, transformers, terratorch).", ok=("vllm",)),
    "override_attention_dtype": _n("str", None, "Dtype override for attention."),
    "logits_processors": _n("list", None, "Custom logits processor classes."),
    "logits_processor_pattern": _n("str", None, "Regex of logits processors requests may name."),
    "io_processor_plugin": _n("str", None, "IOProcessor plugin to load."),
    "renderer_num_workers": _n("int", 1, "Threads for tokenization and chat rendering."),
    "rope_scaling": _n("json", None, "RoPE scaling (use --hf-overrides.rope_scaling instead)."),
    "rope_theta": _n("float", None, "RoPE theta (use --hf-overrides.rope_theta instead)."),
    "mm_processor_kwargs": _n("json", None, "Options for the multimodal processor."),
    "max_seq_len_to_capture": _n("int", 8192, "Longest sequence covered by CUDA graphs (vLLM 0.7)."),
    "attention_backend": _n("str", None, "Attention backend.", ok=("auto",)),
    "mamba_backend": _n("str", None, "Mamba SSM backend.", ok=("triton",)),
    "enable_mamba_cache_stochastic_rounding": _n("bool", False, "Stochastic rounding of Mamba states."),
    "mamba_cache_philox_rounds": _n("int", 0, "Philox rounds for Mamba stochastic rounding."),
    "guided_decoding_backend": _n("str", None, "vLLM 0.7 structured-output backend; use "
                                               "--structured-outputs-config.", ok=("auto",)),
    # parallelism and distribution
    "numa_bind": _n("bool", False, "Bind workers to NUMA nodes."),
    "numa_bind_nodes": _n("list", None, "NUMA node per GPU."),
    "numa_bind_cpus": _n("list", None, "CPU list per GPU."),
    "decode_context_parallel_size": _n("int", 1, "Decode context-parallel group size.", "-dcp"),
    "dcp_comm_backend": _n("str", "ag_rs", "Communication backend of decode context parallelism."),
    "dcp_kv_cache_interleave_size": _n("int", 1, "KV interleave size under DCP."),
    "cp_kv_cache_interleave_size": _n("int", 1, "KV interleave size under context parallelism."),
    "prefill_context_parallel_size": _n("int", 1, "Prefill context-parallel group size.", "-pcp"),
    "data_parallel_rank": _n("int", None, "Data-parallel rank of this instance.", "-dpn"),
    "data_parallel_backend": _n("str", "mp", "Data-parallel backend (mp or ray).", "-dpb"),
    "data_parallel_hybrid_lb": _n("bool", False, "Hybrid data-parallel load balancing.", "-dph"),
    "data_parallel_external_lb": _n("bool", False, "External data-parallel load balancing.", "-dpe"),
    "enable_ep_weight_filter": _n("bool", False, "Load only this rank's experts."),
    "all2all_backend": _n("str", "allgather_reducescatter", "All-to-all backend for expert parallelism."),
    "enable_dbo": _n("bool", False, "Dual batch overlap."),
    "ubatch_size": _n("int", 0, "Micro-batch size."),
    "enable_elastic_ep": _n("bool", False, "Elastic expert parallelism."),
    "dbo_decode_token_threshold": _n("int", 32, "Dual-batch-overlap threshold for decode batches."),
    "dbo_prefill_token_threshold": _n("int", 512, "Dual-batch-overlap threshold for prefill batches."),
    "disable_nccl_for_dp_synchronization": _n("bool", None, "Use Gloo for data-parallel synchronization."),
    "enable_eplb": _n("bool", False, "Expert-parallel load balancing."),
    "eplb_config": _n("json", None, "Expert-parallel load balancer settings."),
    "expert_placement_strategy": _n("str", "linear", "How experts are placed on ranks."),
    "max_parallel_loading_workers": _n("int", None, "Load the model in batches with this many workers."),
    "ray_workers_use_nsight": _n("bool", False, "Profile Ray workers with nsight."),
    "worker_cls": _n("str", "auto", "Worker class."),
    "worker_extension_cls": _n("str", "", "Worker extension class."),
    # cache and offloading
    "kv_cache_dtype_skip_layers": _n("list", [], "Layers whose KV cache stays unquantized."),
    "kv_sharing_fast_prefill": _n("bool", False, "Skip prefill tokens in KV-sharing layers."),
    "mamba_cache_dtype": _n("str", "auto", "Dtype of the Mamba cache."),
    "mamba_ssm_cache_dtype": _n("str", "auto", "Dtype of the Mamba SSM state."),
    "mamba_block_size": _n("int", None, "Block size of the Mamba cache."),
    "mamba_cache_mode": _n("str", "none", "Prefix-caching mode of Mamba layers."),
    "kv_offloading_size": _n("float", None, "GiB of KV cache to offload to CPU."),
    "kv_offloading_backend": _n("str", "native", "KV offloading backend (native, lmcache)."),
    "offload_backend": _n("str", "auto", "Weight offloading backend."),
    "cpu_offload_params": _n("list", [], "Parameters to offload to CPU."),
    "offload_group_size": _n("int", 0, "Offload the last layers of every group of this many layers."),
    "offload_num_in_group": _n("int", 1, "Layers offloaded per group."),
    "offload_prefetch_step": _n("int", 1, "Layers prefetched ahead."),
    "offload_params": _n("list", [], "Parameters to prefetch-offload."),
    # multimodal and LoRA
    # tokenmill serves the text part of multimodal checkpoints: turning their other modalities off is a no-op.
    "language_model_only": _n("bool", False, "Disable all multimodal inputs.", ok=(True,)),
    "limit_mm_per_prompt": NotYetSupported("json", {}, "Most multimodal items per prompt.",
                                           accepts=lambda v: _no_mm_items(v)),
    "enable_mm_embeds": _n("bool", False, "Accept multimodal embeddings in requests."),
    "enable_tower_connector_lora": _n("bool", False, "LoRA on vision towers and connectors."),
    "default_mm_loras": _n("json", None, "LoRA per modality."),
    "specialize_active_lora": _n("bool", False, "CUDA graphs per number of active LoRAs."),
    "enable_prompt_adapter": _n("bool", False, "Prompt adapters (vLLM 0.7)."),
    # observability
    "show_hidden_metrics_for_version": _n("str", None, "Show metrics hidden since this version."),
    "otlp_traces_endpoint": _n("str", None, "OpenTelemetry traces endpoint."),
    "collect_detailed_traces": _n("str", None, "Modules to trace in detail."),
    "kv_cache_metrics": _n("bool", False, "KV cache residency metrics."),
    "kv_cache_metrics_sample": _n("float", 0.01, "Sampling rate of KV cache metrics."),
    "cudagraph_metrics": _n("bool", False, "CUDA graph metrics."),
    "enable_layerwise_nvtx_tracing": _n("bool", False, "Per-layer NVTX ranges."),
    "enable_mfu_metrics": _n("bool", False, "Model FLOPs utilization metrics."),
    "enable_logging_iteration_details": _n("bool", False, "Log per-iteration details."),
    # scheduler
    "scheduler_reserve_full_isl": _n("bool", True, "Admit a request only if its whole prompt fits in the KV cache."),
    "disable_hybrid_kv_cache_manager": _n("bool", None, "Same KV layout for every attention type."),
    "num_scheduler_steps": _n("int", 1, "Multi-step scheduling (vLLM 0.7)."),
    "scheduler_delay_factor": _n("float", 0.0, "Delay before scheduling the next prompt (vLLM 0.7)."),
    "preemption_mode": _n("str", None, "Preemption by recompute or swap (vLLM 0.7).", ok=("recompute",)),
    "num_lookahead_slots": _n("int", 0, "Lookahead slots for speculative decoding (vLLM 0.7)."),
    # compilation, kernels and whole-engine configs
    "ir_op_priority": _n("json", None, "vLLM IR op priorities."),
    "enable_flashinfer_autotune": _n("bool", None, "Autotune FlashInfer kernels."),
    "moe_backend": _n("str", "auto", "MoE kernel backend."),
    # vLLM 0.7's speculative-decoding flags: one JSON object (--speculative-config) replaced them.
    "speculative_model": _old_spec("str", None, "Draft model", '{"model": "/path/to/draft", '
                                   '"num_speculative_tokens": 4}'),
    "num_speculative_tokens": _old_spec("int", None, "Speculative tokens per step",
                                        '{"method": "ngram", "num_speculative_tokens": 4}'),
    "ngram_prompt_lookup_max": _old_spec("int", None, "Largest n-gram of prompt lookup",
                                         '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}'),
    "ngram_prompt_lookup_min": _old_spec("int", None, "Smallest n-gram of prompt lookup",
                                         '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2}'),
    "speculative_disable_by_batch_size": _old_spec(
        "int", None, "Decode without drafts above this many requests",
        '{"method": "ngram", "num_speculative_tokens": 4, "disable_by_batch_size": 8}'),
    "speculative_draft_tensor_parallel_size": _old_spec(
        "int", None, "Tensor-parallel size of the draft model",
        '{"model": "/path/to/draft", "num_speculative_tokens": 4, "draft_tensor_parallel_size": 1}', "-spec-draft-tp"),
    "speculative_max_model_len": _old_spec("int", None, "Longest sequence the draft model serves",
                                           '{"model": "/path/to/draft", "num_speculative_tokens": 4, '
                                           '"max_model_len": 4096}'),
    "speculative_model_quantization": _old_spec("str", None, "Quantization of the draft model",
                                                '{"model": "/path/to/draft", "num_speculative_tokens": 4, '
                                                '"quantization": "fp8"}'),
    "speculative_disable_mqa_scorer": _old_spec("bool", False, "Batch expansion instead of the MQA scorer",
                                                '{"method": "ngram", "num_speculative_tokens": 4}'),
    "spec_decoding_acceptance_method": _old_spec("str", "rejection_sampler", "Draft acceptance method",
                                                 '{"method": "ngram", "num_speculative_tokens": 4}'),
    "typical_acceptance_sampler_posterior_threshold": _old_spec(
        "float", None, "Typical acceptance threshold", '{"method": "ngram", "num_speculative_tokens": 4}'),
    "typical_acceptance_sampler_posterior_alpha": _old_spec(
        "float", None, "Typical acceptance alpha", '{"method": "ngram", "num_speculative_tokens": 4}'),
    "disable_logprobs_during_spec_decoding": _old_spec(
        "bool", None, "Skip logprobs of speculated tokens", '{"method": "ngram", "num_speculative_tokens": 4}'),
    "kv_transfer_config": _n("json", None, "Distributed KV cache transfer (disaggregated prefill)."),
    "kv_events_config": _n("json", None, "KV cache event publishing."),
    "ec_transfer_config": _n("json", None, "Distributed encoder cache transfer."),
    "attention_config": _n("json", None, "Attention settings.", "-ac"),
    "reasoning_config": _n("json", None, "Reasoning-model settings."),
    "kernel_config": _n("json", None, "Kernel settings."),
    "additional_config": _n("json", {}, "Platform-specific settings."),
    "profiler_config": _n("json", None, "Profiler settings."),
    "performance_mode": _n("str", "balanced", "Performance mode (balanced, interactivity, throughput)."),
    "weight_transfer_config": _n("json", None, "Weight transfer during RL training."),
}


def is_accepted(name: str, value: Any) -> bool:
    """Whether `value` for the not-yet-supported option `name` describes what tokenmill does anyway."""
    nys = NOT_YET_SUPPORTED[name]
    return (value == nys.default or value in nys.accepted or (nys.default is None and value in ({}, [], ""))
            or (nys.accepts is not None and nys.accepts(value)))


def _no_mm_items(value: Any) -> bool:
    """limit_mm_per_prompt allowing no item of any modality ({"image": 0} or vLLM's {"image": {"count": 0}})."""
    return isinstance(value, dict) and all(
        v == 0 or (isinstance(v, dict) and v.get("count") == 0) for v in value.values())


def check_not_yet_supported(name: str, value: Any) -> None:
    """Raise ValueError, naming the option in both spellings, unless `value` is accepted (see is_accepted)."""
    if is_accepted(name, value):
        return
    nys = NOT_YET_SUPPORTED[name]
    if nys.instead:
        raise ValueError(f"`{name}={value!r}` (--{name.replace('_', '-')}) is a vLLM 0.7 option that vLLM 0.20 "
                         f"replaced: use {nys.instead} instead.")
    allowed = " or ".join(repr(v) for v in (nys.default, *nys.accepted) if v is not None)
    if nys.default is None:
        why = f"Leave it unset{' or pass ' + allowed if allowed else ''}."
    else:
        why = f"Only {allowed} is accepted."
    raise not_supported_yet(name, value, why)


def engine_option_names() -> list[str]:
    """The entries that are engine arguments (accepted by LLM(...) and EngineArgs, not only by the CLI)."""
    return [name for name, nys in NOT_YET_SUPPORTED.items() if not nys.frontend]
