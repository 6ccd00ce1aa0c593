"""Scheduler configuration: the per-step token budget and batching policy."""
from __future__ import annotations

from dataclasses import dataclass

from tokenmill.config.utils import check_choices, check_range, config_field, not_supported_yet

DEFAULT_MAX_NUM_BATCHED_TOKENS = 8192
DEFAULT_MAX_NUM_SEQS = 256
# vLLM's default for its offline `LLM` class on GPUs of 70+ GiB other than the A100 (H100, H200, MI300): larger
# prefill chunks, so fewer eager mixed steps while a batch of prompts is admitted. Its server keeps 8192 there, as
# ours does. On the H200, Qwen3-0.6B's nano-vllm workload: 25,451 against 24,685 output tok/s, +3.1% (means of 11
# runs on four hosts).
OFFLINE_LARGE_GPU_MAX_NUM_BATCHED_TOKENS = 16384
_LARGE_GPU_BYTES = 70 * 2**30
# The API server's default: vLLM's server value on all but the largest GPUs, and ours on those too. A step's
# prefill chunk is what decodes beside it wait for, so the budget is the serving ITL's tail. On the H200, 8B shape,
# 1,024 in / 128 out, streaming chat at concurrency 64: 2048 against 8192 gave 3,318 against 3,189 out tok/s,
# median TTFT 373 against 847 ms and P99 ITL 54 against 188 ms (at concurrency 256: 3,796 out tok/s, P99 ITL
# 106 ms); 1024 lost 11% of the throughput (the mixed steps' host work no longer hides behind the device).
SERVER_MAX_NUM_BATCHED_TOKENS = 2048


def offline_max_num_batched_tokens(total_bytes: int, device_name: str) -> int | None:
    """The offline LLM's default per-step token budget on a GPU of this size and name; None: the common default."""
    if total_bytes >= _LARGE_GPU_BYTES and "a100" not in device_name.lower():
        return OFFLINE_LARGE_GPU_MAX_NUM_BATCHED_TOKENS
    return None


def server_defaults(engine_kwargs: dict) -> dict:
    """Engine arguments with the API server's default token budget filled in where none is given (chunked
    prefill on; off, the budget must cover max_model_len and finalize sets it)."""
    if engine_kwargs.get("max_num_batched_tokens") is not None or engine_kwargs.get("enable_chunked_prefill") is False:
        return engine_kwargs
    return {**engine_kwargs, "max_num_batched_tokens": SERVER_MAX_NUM_BATCHED_TOKENS}


@dataclass
class SchedulerConfig:
    """One token budget per step shared by prefill chunks and decodes."""
    max_num_batched_tokens: int | None = config_field(
        None, help=f"Most tokens processed in one step (default: {SERVER_MAX_NUM_BATCHED_TOKENS} for the API "
                   "server, whose decodes wait for each step's prefill chunk; "
                   f"{OFFLINE_LARGE_GPU_MAX_NUM_BATCHED_TOKENS} for the offline LLM class on one GPU of 70 GiB or "
                   f"more other than an A100, as in vLLM; {DEFAULT_MAX_NUM_BATCHED_TOKENS} otherwise; at least "
                   "max_model_len when chunked prefill is off).")
    max_num_seqs: int | None = config_field(None, help=f"Most requests in one step (default {DEFAULT_MAX_NUM_SEQS}).")
    max_num_partial_prefills: int = config_field(
        1, help="Most requests partially prefilled at once. Only 1 is supported yet: tokenmill does not cap "
                "concurrent partial prefills (long_prefill_token_threshold caps each prompt's chunk instead).")
    max_long_partial_prefills: int = config_field(
        1, help="Most prompts longer than long_prefill_token_threshold partially prefilled at once. Only 1 is "
                "supported yet, as for max_num_partial_prefills.")
    long_prefill_token_threshold: int = config_field(
        0, help="A prompt longer than this is 'long'; its chunks are capped at this many tokens (0 = off).")
    scheduling_policy: str = config_field("fcfs", help="fcfs: first come first served; priority: lower "
                                                       "`priority` value first, then arrival time.",
                                          choices=("fcfs", "priority"))
    enable_chunked_prefill: bool | None = config_field(
        None, help="Split long prompts into chunks that share steps with decodes (default on).")
    async_scheduling: bool | None = config_field(
        None, help="Schedule and prepare step N+1 while the device runs step N (default: on for CUDA, off on "
                   "the CPU, where it cannot overlap anything; off, and not allowed, with pipeline parallelism, "
                   "which overlaps micro-batches instead).")
    stream_interval: int = config_field(1, help="Send streamed output every N tokens.")
    scheduler_cls: str | None = config_field(None, help="A custom scheduler class (not supported yet).")
    disable_chunked_mm_input: bool = config_field(
        False, help="Never split a multimodal item across prefill chunks. No effect on the text-only models "
                    "tokenmill runs (their prompts hold no multimodal items), as in vLLM for a text-only model.")

    def finalize(self, max_model_len: int) -> None:
        """Fill defaults that depend on the model, then check the combination."""
        if self.enable_chunked_prefill is None:
            self.enable_chunked_prefill = True
        if self.max_num_seqs is None:
            self.max_num_seqs = DEFAULT_MAX_NUM_SEQS
        if self.max_num_batched_tokens is None:
            self.max_num_batched_tokens = DEFAULT_MAX_NUM_BATCHED_TOKENS
            if not self.enable_chunked_prefill:
                self.max_num_batched_tokens = max(self.max_num_batched_tokens, max_model_len)
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < max_model_len:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) is smaller than max_model_len "
                f"({max_model_len}) with chunked prefill disabled, so long prompts could never run. Raise "
                "max_num_batched_tokens, lower max_model_len, or enable chunked prefill.")

    def __post_init__(self) -> None:
        check_choices(self)
        check_range("max_num_batched_tokens", self.max_num_batched_tokens, 1)
        check_range("max_num_seqs", self.max_num_seqs, 1)
        check_range("long_prefill_token_threshold", self.long_prefill_token_threshold, 0)
        check_range("stream_interval", self.stream_interval, 1)
        check_range("max_num_partial_prefills", self.max_num_partial_prefills, 1)
        check_range("max_long_partial_prefills", self.max_long_partial_prefills, 1)
        # vLLM admits several partially prefilled prompts per step only up to these caps; tokenmill's budget loop
        # has no such cap, so a value above 1 would be accepted and not honoured.
        for name in ("max_num_partial_prefills", "max_long_partial_prefills"):
            if getattr(self, name) != 1:
                raise not_supported_yet(name, getattr(self, name), "tokenmill does not cap concurrent partial "
                                        "prefills; long_prefill_token_threshold caps each prompt's chunk instead.")
        if self.scheduler_cls is not None:
            raise not_supported_yet("scheduler_cls", self.scheduler_cls)
        if self.stream_interval != 1:
            raise not_supported_yet("stream_interval", self.stream_interval, "Every token is streamed.")
