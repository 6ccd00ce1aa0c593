"""The synchronous engine: processor -> engine core (in-process) -> output processor."""
from __future__ import annotations

from typing import Any

from tokenmill.config import TokenmillConfig
from tokenmill.config.engine_args import create_engine_config
from tokenmill.engine.engine_core import EngineCore
from tokenmill.engine.output_processor import OutputProcessor
from tokenmill.engine.processor import Processor, PromptType
from tokenmill.metrics.reader import Counter, Gauge
from tokenmill.metrics.spec_decode import SpecDecodingTotals
from tokenmill.metrics.step_timing import TIMER
from tokenmill.outputs import RequestOutput
from tokenmill.sampling_params import SamplingParams
from tokenmill.transformers_utils.config import load_generation_config
from tokenmill.transformers_utils.tokenizer import load_tokenizer

# Generation-config keys that become default sampling parameters (HF name -> SamplingParams name).
_GEN_DEFAULTS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                 "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


def default_sampling_kwargs(generation_config: dict[str, Any]) -> dict[str, Any]:
    """vLLM semantics: the model's generation_config.json supplies sampling defaults (unless
    generation_config='vllm'), as SamplingParams keyword arguments."""
    return {ours: generation_config[hf] for hf, ours in _GEN_DEFAULTS.items()
            if generation_config.get(hf) is not None}


class FrontEnd:
    """What both engines build on the client side: tokenizer, generation defaults, input and output processing."""

    def __init__(self, config: TokenmillConfig, log_stats: bool) -> None:
        from tokenmill.transformers_utils.config import get_eos_token_ids
        self.tokenizer = load_tokenizer(config.model_config)
        self.generation_config = load_generation_config(config.model_config)
        eos = get_eos_token_ids(config.model_config.hf_config, self.generation_config, self.tokenizer)
        self.processor = Processor(config, self.tokenizer, eos)
        self.output_processor = OutputProcessor(self.tokenizer, log_stats=log_stats,
                                                max_model_len=config.model_config.max_model_len)


class LLMEngine:
    """Adds requests, steps the engine core, and turns its token-level outputs into RequestOutputs."""

    def __init__(self, config: TokenmillConfig, log_stats: bool = False) -> None:
        self.config = config
        # vLLM's attribute names, which scripts read (llm.llm_engine.model_config.max_model_len, ...).
        self.vllm_config = config
        self.model_config, self.cache_config = config.model_config, config.cache_config
        self.scheduler_config, self.parallel_config = config.scheduler_config, config.parallel_config
        front = FrontEnd(config, log_stats)
        self.tokenizer, self.generation_config = front.tokenizer, front.generation_config
        self.processor, self.output_processor = front.processor, front.output_processor
        if config.parallel_config.data_parallel_size > 1:
            from tokenmill.engine.dp_engine_core import DPEngineCore
            self.engine_core = DPEngineCore(config)
        else:
            self.engine_core = EngineCore(config)
        self.processor.num_blocks = self.engine_core.num_blocks
        self.log_stats = log_stats
        self.last_stats = None
        spec = config.speculative_config
        self.spec_totals = SpecDecodingTotals(spec.num_speculative_tokens) if spec is not None else None
        from tokenmill.gc_utils import freeze_gc_heap
        freeze_gc_heap("offline engine")  # in-process: the KV block objects would otherwise slow every full GC

    @classmethod
    def from_engine_args(cls, engine_args: Any = None, log_stats: bool = False, **kwargs: Any) -> "LLMEngine":
        """From an EngineArgs (vLLM's form) and/or engine arguments as keywords."""
        from tokenmill.config.engine_args import engine_kwargs
        return cls(create_engine_config(**engine_kwargs(engine_args, kwargs)), log_stats=log_stats)

    def get_tokenizer(self):
        return self.tokenizer

    def collective_rpc(self, method: str | Any, timeout: float | None = None, args: tuple = (),
                       kwargs: dict[str, Any] | None = None) -> list:
        """vLLM's collective_rpc: call `method` (a Worker method's name, or a function taking the worker as its
        first argument) on every worker; one result per worker. Supported where the worker runs in this process
        (one rank, the default offline engine)."""
        from tokenmill.executor.uniproc import UniProcExecutor
        executor = getattr(self.engine_core, "executor", None)
        if type(executor) is not UniProcExecutor:  # (subclasses: one rank of several)
            raise ValueError("collective_rpc is supported only for an engine whose one worker runs in this process "
                             "(no tensor, pipeline or data parallelism, no external launcher) by tokenmill yet.")
        worker = executor.worker
        fn = getattr(worker, method) if isinstance(method, str) else (lambda *a, **k: method(worker, *a, **k))
        return [fn(*args, **(kwargs or {}))]

    def get_default_sampling_params(self) -> SamplingParams:
        return SamplingParams(**default_sampling_kwargs(self.generation_config))

    def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams,
                    arrival_time: float | None = None, priority: int = 0, lora_request: Any = None,
                    tokenization_kwargs: dict[str, Any] | None = None) -> None:
        text, reqs = self.processor.process(request_id, prompt, params, arrival_time, priority, lora_request,
                                            tokenization_kwargs)
        self.engine_core.add_requests(reqs)
        for i, req in enumerate(reqs):
            self.output_processor.add_request(req, text, parent_id=request_id, index=i, n=len(reqs))

    def abort_request(self, request_ids: str | list[str]) -> None:
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        self.engine_core.abort_requests(self.output_processor.abort_requests(ids))

    def step(self) -> list[RequestOutput]:
        outputs = self.engine_core.step()
        self.last_stats = outputs.scheduler_stats
        if self.spec_totals is not None and outputs.scheduler_stats is not None:
            self.spec_totals.observe(outputs.scheduler_stats.spec_decoding_stats)
        with TIMER.phase("output_processor"):
            result = self.output_processor.process_outputs(outputs.outputs, outputs.timestamp)
        if result.reqs_to_abort:
            self.engine_core.abort_requests(result.reqs_to_abort)
        return result.request_outputs

    def has_unfinished_requests(self) -> bool:
        return self.output_processor.has_unfinished_requests() or self.engine_core.has_unfinished_requests()

    def get_num_unfinished_requests(self) -> int:
        return self.output_processor.get_num_unfinished_requests()

    def reset_prefix_cache(self) -> bool:
        return self.engine_core.reset_prefix_cache()

    def _core_method(self, name: str):
        method = getattr(self.engine_core, name, None)
        if method is None:
            raise ValueError(f"{name}() is not supported with data parallelism (data_parallel_size > 1) by tokenmill "
                             "yet.")
        return method

    def sleep(self, level: int = 1) -> None:
        self._core_method("sleep")(level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        self._core_method("wake_up")(tags)

    def is_sleeping(self) -> bool:
        return self._core_method("is_sleeping")()

    def start_profile(self) -> None:
        self._core_method("start_profile")()

    def stop_profile(self) -> None:
        self._core_method("stop_profile")()

    def get_metrics(self) -> list:
        """vLLM's offline metric records since the engine started: preemptions, the latest step's running /
        waiting requests and KV cache usage, and with speculation the vllm:spec_decode_* counters (the API server's
        Prometheus endpoint serves the full set)."""
        labels = {"model_name": self.config.model_config.served_model_name[0], "engine": "0"}
        stats = self.last_stats
        records: list = []
        if stats is not None:
            records += [Counter("vllm:num_preemptions", dict(labels), stats.num_preemptions),
                        Gauge("vllm:num_requests_running", dict(labels), stats.num_running_reqs),
                        Gauge("vllm:num_requests_waiting", dict(labels), stats.num_waiting_reqs),
                        Gauge("vllm:kv_cache_usage_perc", dict(labels), stats.kv_cache_usage)]
        if self.spec_totals is not None:
            records += self.spec_totals.metrics(labels)
        return records