"""The offline `LLM` class: vLLM's Python API over the in-process engine."""
from __future__ import annotations

import itertools
import numbers
from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch
from tqdm.auto import tqdm

from tokenmill.config.scheduler import offline_max_num_batched_tokens
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.entrypoints.chat_utils import Conversation, render_chat
from tokenmill.logger import init_logger
from tokenmill.outputs import RequestOutput
from tokenmill.sampling_params import RequestOutputKind, SamplingParams

logger = init_logger(__name__)

if TYPE_CHECKING:
    from tokenmill.beam_search import BeamSearchOutput
    from tokenmill.sampling_params import BeamSearchParams


_PARALLEL_SIZES = (("tensor_parallel_size", "tp"), ("pipeline_parallel_size", "pp"), ("data_parallel_size", "dp"))


def offline_defaults(kwargs: dict[str, Any]) -> dict[str, Any]:
    """Engine arguments with vLLM's offline-class defaults that depend on the GPU filled in where not given: the
    per-step token budget (config/scheduler.py). Reads the device's size only where the in-process engine will use
    CUDA anyway."""
    if kwargs.get("max_num_batched_tokens") is not None or kwargs.get("enable_chunked_prefill") is False:
        return kwargs
    if kwargs.get("device", "auto") not in ("auto", "cuda") or not torch.cuda.is_available():
        return kwargs
    for name, short in _PARALLEL_SIZES:
        size = kwargs.get(name, kwargs.get(short))
        if size is not None and not (isinstance(size, int) and size <= 1):
            return kwargs  # workers in other processes (or a bad value, which the config check reports)
    props = torch.cuda.get_device_properties(0)
    budget = offline_max_num_batched_tokens(props.total_memory, props.name)
    if budget is None:
        return kwargs
    logger.info("max_num_batched_tokens defaults to %d for the offline LLM on this %s (%.0f GiB), as in vLLM",
                budget, props.name, props.total_memory / 2**30)
    return {**kwargs, "max_num_batched_tokens": budget}


class LLM:
    """Generate text for batches of prompts, as `vllm.LLM` does.

    `LLM()` with no model loads the embedded SmolLM2-135M-Instruct. Keyword arguments are engine arguments (the
    fields of the config dataclasses, vLLM's names, and the not-yet-supported vLLM ones with their accepted values;
    config/engine_args.py); an unknown one raises TypeError naming it, an unsupported value ValueError with the
    message `tokenmill serve` gives for the same flag.
    """

    def __init__(self, model: str | None = None, *, disable_log_stats: bool = True,
                 structured_outputs_config: dict | str | None = None, **kwargs: Any) -> None:
        from tokenmill.structured.config import StructuredOutputsConfig
        # Engine-wide structured-output options, applied to each constrained request as the server does.
        self.structured_outputs_config = StructuredOutputsConfig.from_dict(structured_outputs_config)
        self.structured_outputs_config.check_supported()
        self.llm_engine = LLMEngine.from_engine_args(log_stats=not disable_log_stats, model=model,
                                                     **offline_defaults(kwargs))
        self.model_config = self.llm_engine.model_config  # as vLLM's LLM has it
        self._counter = itertools.count()

    def get_tokenizer(self):
        """The engine's tokenizer; a ValueError with skip_tokenizer_init, as in vLLM (not None to fail later)."""
        tok = self.llm_engine.get_tokenizer()
        if tok is None:
            raise ValueError("No tokenizer: the engine was started with skip_tokenizer_init=True.")
        return tok

    def collective_rpc(self, method: Any, timeout: float | None = None, args: tuple = (),
                       kwargs: dict[str, Any] | None = None) -> list:
        """Call a Worker method (by name) or a function `f(worker, *args, **kwargs)` on every worker; one result
        per worker (LLMEngine.collective_rpc)."""
        return self.llm_engine.collective_rpc(method, timeout, args, kwargs)

    def apply_model(self, func: Any) -> list:
        """Run `func(model)` on the model (a torch.nn.Module) of every worker; one result per worker."""
        return self.collective_rpc(lambda worker: func(worker.runner.model))

    def get_default_sampling_params(self) -> SamplingParams:
        return self.llm_engine.get_default_sampling_params()

    def get_world_size(self, include_dp: bool = True) -> int:
        """Ranks the model runs on: tensor x pipeline parallel size, times data_parallel_size with include_dp."""
        pc = self.llm_engine.parallel_config
        return pc.world_size * (pc.data_parallel_size if include_dp else 1)

    def reset_mm_cache(self) -> None:
        """vLLM's: clears the multimodal input cache. tokenmill serves text only and keeps none: nothing to do."""

    def reset_prefix_cache(self) -> bool:
        return self.llm_engine.reset_prefix_cache()

    # ----- sleep mode (vLLM's; tokenmill/worker/sleep.py): needs LLM(..., enable_sleep_mode=True) -----
    def sleep(self, level: int = 1) -> None:
        """Release the device memory of the weights and the KV cache between uses (RL rollouts): level 1 keeps the
        weights in host memory, level 2 discards them (load or sync them after waking). The KV cache and the
        prefix cache are discarded at both levels. Generating while asleep is a RuntimeError."""
        self.llm_engine.sleep(level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Take the memory back: tags ["weights"] or ["kv_cache"] wake one part (None: both)."""
        self.llm_engine.wake_up(tags)

    def is_sleeping(self) -> bool:
        """True while any part sleeps."""
        return self.llm_engine.is_sleeping()

    def start_profile(self) -> None:
        """Start the torch profiler on every worker (vLLM's): traces go to VLLM_TORCH_PROFILER_DIR, which must be
        set (RuntimeError otherwise); VLLM_TORCH_PROFILER_RECORD_SHAPES / _WITH_STACK / _WITH_PROFILE_MEMORY /
        _WITH_FLOPS choose what they record."""
        self.llm_engine.start_profile()

    def stop_profile(self) -> None:
        """Stop the profiler started by start_profile(); each worker writes its trace (rank<N>.*.pt.trace.json.gz)."""
        self.llm_engine.stop_profile()

    def get_metrics(self) -> list:
        """vLLM's offline metrics records (name, labels, value / values): the speculative-decoding counters."""
        return self.llm_engine.get_metrics()

    # ----- generation -----
    def generate(self, prompts: Any, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, *,
                 use_tqdm: bool | Callable[..., Any] = True, priority: list[int] | None = None,
                 lora_request: Any = None,
                 tokenization_kwargs: dict[str, Any] | None = None) -> list[RequestOutput]:
        """One RequestOutput per prompt, in input order. prompts: a str, a dict, a list of token ids, or a list of
        those. lora_request: one LoRARequest for every prompt, or a list with one (or None) per prompt. use_tqdm:
        show a progress bar; a callable (e.g. a tqdm subclass or functools.partial(tqdm, ...)) makes it, as in
        vLLM. tokenization_kwargs: arguments of the tokenizer call for text prompts (truncation, max_length,
        add_special_tokens; engine/processor.py); truncation keeps a prompt's end, as in vLLM."""
        from tokenmill.engine.processor import check_tokenization_kwargs
        tokenization_kwargs = check_tokenization_kwargs(tokenization_kwargs)
        prompt_list = self._as_prompt_list(prompts)
        params = self._params_for(prompt_list, sampling_params)
        if priority is not None:
            if not isinstance(priority, (list, tuple)):
                raise ValueError(f"priority must be a list with one integer per prompt, got "
                                 f"{type(priority).__name__}.")
            if len(priority) != len(prompt_list):
                raise ValueError(f"priority has {len(priority)} entries for {len(prompt_list)} prompts.")
            wrong = [f"[{i}]: {p!r}" for i, p in enumerate(priority) if isinstance(p, bool) or not isinstance(p, int)]
            if wrong:
                raise ValueError(f"priority must hold integers (lower runs first); got {', '.join(wrong[:3])}.")
        loras = list(lora_request) if isinstance(lora_request, (list, tuple)) else [lora_request] * len(prompt_list)
        if len(loras) != len(prompt_list):
            raise ValueError(f"lora_request has {len(loras)} entries for {len(prompt_list)} prompts.")
        return self._run(prompt_list, params, priority, use_tqdm, loras, tokenization_kwargs)

    def chat(self, messages: Conversation | list[Conversation],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool | Callable[..., Any] = True, lora_request: Any = None,
             chat_template: str | None = None, chat_template_content_format: str = "auto",
             add_generation_prompt: bool = True, continue_final_message: bool = False,
             tools: list[dict] | None = None, chat_template_kwargs: dict[str, Any] | None = None,
             tokenization_kwargs: dict[str, Any] | None = None,
             mm_processor_kwargs: dict[str, Any] | None = None) -> list[RequestOutput]:
        """Render each conversation with the chat template, then generate. Accepts one conversation or a list;
        lora_request and tokenization_kwargs as in generate() (the rendered text adds no special tokens unless
        tokenization_kwargs says add_special_tokens=True). The parameters come in vLLM's order;
        mm_processor_kwargs must stay None or empty (text-only models)."""
        from tokenmill.engine.processor import check_tokenization_kwargs
        if mm_processor_kwargs:
            raise ValueError(f"mm_processor_kwargs={mm_processor_kwargs!r:.80}: tokenmill serves text-only models, "
                             "which have no multimodal processor; leave it unset.")
        encode_kwargs = {"add_special_tokens": False, **check_tokenization_kwargs(tokenization_kwargs)}
        if not isinstance(messages, (list, tuple)):
            raise ValueError("messages must be a conversation (a list of message dicts such as "
                             "{'role': 'user', 'content': '...'}) or a list of conversations, got "
                             f"{type(messages).__name__}.")
        if not messages:
            return []  # no conversations, no outputs (vLLM's answer too)
        convs = [messages] if isinstance(messages[0], dict) else list(messages)
        for i, conv in enumerate(convs):
            if not isinstance(conv, (list, tuple)) or not conv:
                raise ValueError(f"messages[{i}] must be a non-empty list of message dicts (one conversation), got "
                                 f"{conv!r:.80}.")
        tok = self.llm_engine.get_tokenizer()  # None with skip_tokenizer_init: render_chat says so
        prompts = []
        for conv in convs:
            text = render_chat(tok, conv, chat_template=chat_template, content_format=chat_template_content_format,
                               add_generation_prompt=add_generation_prompt,
                               continue_final_message=continue_final_message, tools=tools,
                               chat_template_kwargs=chat_template_kwargs)
            # The template already carries BOS and other special tokens.
            prompts.append({"prompt": text, "prompt_token_ids": tok.encode(text, **encode_kwargs)})
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm, lora_request=lora_request)

    def beam_search(self, prompts: Any, params: "BeamSearchParams", lora_request: Any = None,
                    use_tqdm: bool = False, concurrency_limit: int | None = None) -> list["BeamSearchOutput"]:
        """Beam search over each prompt (see tokenmill/beam_search.py): one BeamSearchOutput per prompt, its
        sequences best first. concurrency_limit (vLLM's): search at most this many prompts at a time (None: all
        together); the results are the same, only the batches are smaller."""
        from tokenmill.beam_search import beam_search
        if lora_request is not None:
            raise ValueError("lora_request: beam search under a LoRA adapter is not supported yet by tokenmill.")
        if concurrency_limit is not None and (isinstance(concurrency_limit, bool)
                                              or not isinstance(concurrency_limit, int) or concurrency_limit < 1):
            raise ValueError(f"concurrency_limit must be None or an integer >= 1, got {concurrency_limit!r}.")
        prompt_list = self._as_prompt_list(prompts)
        step = concurrency_limit or max(len(prompt_list), 1)

        def generate(step_prompts: list, step_params: SamplingParams) -> list[RequestOutput]:
            return self.generate(step_prompts, step_params, use_tqdm=use_tqdm)
        return [out for start in range(0, len(prompt_list), step)
                for out in beam_search(self.llm_engine.processor, generate, self.llm_engine.get_tokenizer(),
                                       prompt_list[start:start + step], params)]

    # ----- helpers -----
    @staticmethod
    def _as_prompt_list(prompts: Any) -> list:
        if isinstance(prompts, (str, dict)):
            return [prompts]
        if isinstance(prompts, (list, tuple)):
            if not prompts:
                return []  # an empty batch (e.g. all filtered out) has no outputs, as in vLLM
            if all(isinstance(p, numbers.Integral) for p in prompts):  # ints, numpy integers
                return [list(prompts)]  # a single prompt given as token ids
            return list(prompts)
        raise ValueError(f"prompts must be a str, dict, token-id list or a list of those; got {type(prompts).__name__}.")

    def _params_for(self, prompts: list, sampling_params) -> list[SamplingParams]:
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        if isinstance(sampling_params, SamplingParams):
            return [sampling_params] * len(prompts)
        if not isinstance(sampling_params, (list, tuple)):
            raise TypeError("sampling_params must be a SamplingParams or a list with one per prompt, got "
                            f"{type(sampling_params).__name__}.")
        sp = list(sampling_params)
        wrong = [f"[{i}]: {type(p).__name__}" for i, p in enumerate(sp) if not isinstance(p, SamplingParams)]
        if wrong:
            raise TypeError(f"sampling_params must hold SamplingParams; got {', '.join(wrong[:3])}.")
        if len(sp) != len(prompts):
            raise ValueError(f"Got {len(sp)} SamplingParams for {len(prompts)} prompts; give one, or one per prompt.")
        return sp

    def _run(self, prompts: list, params: list[SamplingParams], priority: list[int] | None,
             use_tqdm: bool | Callable[..., Any], loras: list | None = None,
             tokenization_kwargs: dict[str, Any] | None = None) -> list[RequestOutput]:
        from tokenmill.entrypoints import best_of
        if not prompts:
            return []  # nothing to run (and no empty progress bar)
        engine = self.llm_engine
        ids = []
        picks: dict[str, best_of.BestOf] = {}
        try:
            for i, (prompt, sp) in enumerate(zip(prompts, params)):
                sp, pick = best_of.expand(sp)
                sp = sp.clone()
                sp.output_kind = RequestOutputKind.FINAL_ONLY
                so = sp.structured_outputs
                if so is not None:
                    so.disable_any_whitespace |= self.structured_outputs_config.disable_any_whitespace
                    so.disable_additional_properties |= self.structured_outputs_config.disable_additional_properties
                rid = str(next(self._counter))
                engine.add_request(rid, prompt, sp, priority=priority[i] if priority else 0,
                                   lora_request=loras[i] if loras else None,
                                   tokenization_kwargs=tokenization_kwargs)
                ids.append(rid)
                if pick is not None:
                    picks[rid] = pick
        except Exception:
            engine.abort_request(ids)  # leave nothing half-added behind
            raise
        results: dict[str, RequestOutput] = {}
        make_bar = use_tqdm if callable(use_tqdm) else tqdm
        bar = make_bar(total=len(ids), desc="Processed prompts", dynamic_ncols=True) if use_tqdm else None
        in_toks = out_toks = 0
        try:
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished:
                        pick = picks.get(out.request_id)
                        results[out.request_id] = pick.select(out) if pick is not None else out
                        if bar is not None:
                            in_toks += len(out.prompt_token_ids or [])
                            out_toks += sum(len(o.token_ids) for o in out.outputs)
                            elapsed = bar.format_dict["elapsed"] or 1e-9
                            bar.set_postfix_str(f"est. speed input: {in_toks / elapsed:.2f} toks/s, "
                                                f"output: {out_toks / elapsed:.2f} toks/s")
                            bar.update(1)
        except BaseException:
            engine.abort_request([i for i in ids if i not in results])
            raise
        finally:
            if bar is not None:
                bar.close()
        return [results[i] for i in ids]


def _pooling_method(name: str):
    def method(self: LLM, *args: Any, **kwargs: Any) -> list:
        raise ValueError(f"LLM.{name}() needs an embedding, pooling or scoring model; tokenmill runs generative models "
                         "only (runner='generate'): use LLM.generate, LLM.chat or LLM.beam_search.")
    method.__name__ = method.__qualname__ = name
    return method


# vLLM's pooling-model methods: a script written for vLLM gets the server's message for the same routes, not an
# AttributeError that reads like a tokenmill bug.
for _name in ("encode", "embed", "classify", "score", "reward"):
    setattr(LLM, _name, _pooling_method(_name))
