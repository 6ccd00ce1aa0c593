"""Turns user inputs (text or token ids + SamplingParams) into validated EngineCoreRequests."""
from __future__ import annotations

import numbers
import time
from typing import Any

from tokenmill.config import TokenmillConfig
from tokenmill.core.messages import EngineCoreRequest
from tokenmill.inputs import PromptType, TextPrompt, TokensPrompt
from tokenmill.sampling_params import SamplingParams

# The tokenizer-call arguments a request may set (vLLM's `tokenization_kwargs`); others are refused by name rather
# than passed on, since transformers ignores keywords it does not know.
TOKENIZATION_KWARGS = {"truncation": (bool,), "max_length": (int,), "add_special_tokens": (bool,)}


def check_tokenization_kwargs(kwargs: dict[str, Any] | None) -> dict[str, Any]:
    """`kwargs` checked (names and types), as a dict; raises ValueError naming the unknown or malformed ones."""
    if kwargs is None:
        return {}
    if not isinstance(kwargs, dict):
        raise ValueError(f"tokenization_kwargs must be a dict, got {type(kwargs).__name__}.")
    unknown = sorted(k for k in kwargs if k not in TOKENIZATION_KWARGS)
    if unknown:
        raise ValueError(f"tokenization_kwargs: unknown key(s) {unknown}; tokenmill accepts "
                         f"{sorted(TOKENIZATION_KWARGS)}.")
    for key, value in kwargs.items():
        if not isinstance(value, TOKENIZATION_KWARGS[key]) or (key == "max_length" and
                                                                (isinstance(value, bool) or value < 1)):
            want = "an integer >= 1" if key == "max_length" else "a bool"
            raise ValueError(f"tokenization_kwargs[{key!r}] must be {want}, got {value!r}.")
    if kwargs.get("truncation") and "max_length" not in kwargs:
        raise ValueError("tokenization_kwargs: truncation=True needs max_length (the most prompt tokens to keep).")
    return dict(kwargs)


class Processor:
    """Tokenizes prompts and checks requests against the model (vocabulary, context length, logprob limits)."""

    def __init__(self, config: TokenmillConfig, tokenizer: Any | None, eos_token_ids: list[int]) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.max_model_len = config.model_config.max_model_len
        self.max_logprobs = config.model_config.max_logprobs
        self.vocab_size = config.model_config.vocab_size
        self.eos_token_id = eos_token_ids[0] if eos_token_ids else None
        self.extra_eos_ids = eos_token_ids[1:]
        self.block_size = config.cache_config.block_size
        self.num_blocks: int | None = None  # the KV cache's size, known once the engine core is up
        self._loras: dict[int, Any] = {}  # lora_int_id -> the LoRARequest checked for it

    # ----- prompts -----
    _PROMPT_KEYS = tuple(dict.fromkeys((*TextPrompt.__annotations__, *TokensPrompt.__annotations__)))

    def tokenize_prompt(self, prompt: PromptType,
                        tokenization_kwargs: dict[str, Any] | None = None) -> tuple[str | None, list[int]]:
        """Returns (prompt text or None, prompt token ids). tokenization_kwargs (check_tokenization_kwargs) go to the
        tokenizer call for a text prompt; truncation keeps the prompt's end, as vLLM's generate does."""
        tokenization_kwargs = check_tokenization_kwargs(tokenization_kwargs)
        if isinstance(prompt, dict):
            unknown = sorted(k for k in prompt if k not in self._PROMPT_KEYS)
            if unknown:
                hint = (" tokenmill serves text-only models." if any("multi_modal" in k or "mm_" in k for k in unknown)
                        else "")
                raise ValueError(f"Unsupported prompt dict key(s) {unknown}; a prompt dict takes "
                                 f"{list(self._PROMPT_KEYS)}.{hint}")
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), self._check_ids(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise ValueError("A prompt dict needs a 'prompt' (text) or 'prompt_token_ids' key; got keys "
                                 f"{sorted(prompt)}.")
        if isinstance(prompt, (list, tuple)):
            return None, self._check_ids(prompt)
        if not isinstance(prompt, str):
            raise ValueError(f"A prompt must be a string, a list of token ids or a dict; got {type(prompt).__name__}.")
        if self.tokenizer is None:
            raise ValueError("skip_tokenizer_init=True: prompts must be given as token ids "
                             "({'prompt_token_ids': [...]}).")
        return prompt, self.tokenizer.encode(prompt, **tokenization_kwargs)

    def _check_ids(self, ids: Any) -> list[int]:
        """The prompt's token ids as a new list of ints: a list or tuple, or a 1-D numpy array / torch tensor, of
        integers (numpy integers too) within the vocabulary. Anything else is a ValueError naming
        prompt_token_ids; an id outside the vocabulary, one naming the id."""
        if not isinstance(ids, (list, tuple)) and hasattr(ids, "tolist") and not isinstance(ids, (str, bytes)):
            ids = ids.tolist()  # numpy array, torch tensor
        if not isinstance(ids, (list, tuple)):
            raise ValueError(f"prompt_token_ids must be a list of integer token ids, got {type(ids).__name__}.")
        out = list(ids)
        for i, t in enumerate(out):
            if type(t) is not int:
                if isinstance(t, bool) or not isinstance(t, numbers.Integral):
                    raise ValueError(f"prompt_token_ids[{i}] must be an integer token id, got {t!r} "
                                     f"({type(t).__name__}).")
                out[i] = t = int(t)
            if not 0 <= t < self.vocab_size:
                raise ValueError(f"Token id {t!r} is out of vocabulary (valid ids are 0..{self.vocab_size - 1}).")
        return out

    # ----- params -----
    def _check_params(self, params: SamplingParams) -> None:
        for name in ("logprobs", "prompt_logprobs"):
            n = getattr(params, name)
            if n is None or self.max_logprobs == -1:
                continue
            asked = self.vocab_size if n == -1 else n
            if asked > self.max_logprobs:
                whole = f" (the whole vocabulary, {self.vocab_size} tokens)" if n == -1 else ""
                raise ValueError(f"Requested {name}={n}{whole} but at most {self.max_logprobs} are allowed "
                                 "(raise max_logprobs to allow more; max_logprobs=-1 allows any number).")
        for name, ids in (("logit_bias", list((params.logit_bias or {}).keys())),
                          ("allowed_token_ids", params.allowed_token_ids or [])):
            bad = [t for t in ids if not 0 <= t < self.vocab_size]
            if bad:
                raise ValueError(f"SamplingParams.{name} has token ids outside the vocabulary "
                                 f"(0..{self.vocab_size - 1}): {bad[:5]}.")
        if params.structured_outputs is not None:
            if self.tokenizer is None:
                raise ValueError("SamplingParams.structured_outputs needs a tokenizer (skip_tokenizer_init is set).")
            from tokenmill.structured.backend_xgrammar import validate_structured_outputs
            validate_structured_outputs(params.structured_outputs)  # a bad schema/regex/grammar fails here
        bad_stop = [t for t in params.stop_token_ids if t >= self.vocab_size]
        if bad_stop:
            raise ValueError(f"SamplingParams.stop_token_ids has ids outside the vocabulary: {bad_stop[:5]}.")

    def _bad_words_ids(self, params: SamplingParams) -> list[list[int]] | None:
        if not params.bad_words:
            return None
        if self.tokenizer is None:
            raise ValueError("SamplingParams.bad_words needs a tokenizer (skip_tokenizer_init is set).")
        out: list[list[int]] = []
        for word in params.bad_words:
            # A word can start a text or follow a space; both spellings tokenize differently.
            for text in (word.lstrip(), " " + word.lstrip()):
                ids = self.tokenizer.encode(text, add_special_tokens=False)
                if ids and ids not in out:
                    out.append(ids)
        return out

    # ----- requests -----
    def check_lora(self, lora: Any) -> None:
        """Refuse (ValueError; LoRAAdapterError for the adapter itself) a LoRARequest the engine cannot serve; an
        adapter is read and checked against the model once per lora_int_id (and again with load_inplace)."""
        from tokenmill.lora.request import LoRARequest
        if not isinstance(lora, LoRARequest):
            raise TypeError(f"lora_request must be a LoRARequest, got {type(lora).__name__}.")
        lc = self.config.lora_config
        if lc is None:
            raise ValueError(f"lora_request ({lora.lora_name!r}) needs an engine started with enable_lora=True "
                             "(--enable-lora).")
        seen = self._loras.get(lora.lora_int_id)
        if seen is not None and not lora.load_inplace:
            if (seen.lora_name, seen.lora_path) != (lora.lora_name, lora.lora_path):
                raise ValueError(f"lora_int_id {lora.lora_int_id} already names adapter {seen.lora_name!r} "
                                 f"({seen.lora_path}); give {lora.lora_name!r} another id.")
            return
        from tokenmill.lora.peft import read_adapter
        from tokenmill.models.registry import get_model_class
        mc = self.config.model_config
        read_adapter(lora.lora_name, lora.lora_int_id, lora.lora_path, max_rank=lc.max_lora_rank,
                     text_config=mc.get_text_config(), served_names=[*mc.served_model_name, mc.model or ""],
                     base_model_name=lora.base_model_name,
                     mapping=getattr(get_model_class(mc.architecture), "weight_mapping", None))
        self._loras[lora.lora_int_id] = lora

    def process(self, request_id: str, prompt: PromptType, params: SamplingParams,
                arrival_time: float | None = None, priority: int = 0,
                lora_request: Any = None,
                tokenization_kwargs: dict[str, Any] | None = None) -> tuple[str | None, list[EngineCoreRequest]]:
        """Returns the prompt text and one EngineCoreRequest per sample (n > 1 fans out into n children)."""
        if not isinstance(request_id, str):  # as in vLLM: ids are matched (abort, outputs) and sent as strings
            raise TypeError(f"request_id must be a string, got {type(request_id).__name__}.")
        if lora_request is not None:
            self.check_lora(lora_request)
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling_params must be a SamplingParams, got {type(params).__name__}.")
        if isinstance(priority, bool) or not isinstance(priority, int):  # the scheduler's heap compares them
            raise ValueError(f"priority must be an integer (lower runs first), got {priority!r}.")
        if priority != 0 and self.config.scheduler_config.scheduling_policy != "priority":
            raise ValueError("A request priority was given but scheduling_policy is 'fcfs'; use "
                             "scheduling_policy='priority'.")
        text, ids = self.tokenize_prompt(prompt, tokenization_kwargs)
        salt = prompt.get("cache_salt") if isinstance(prompt, dict) else None
        if salt is not None and (not isinstance(salt, str) or not salt):
            raise ValueError(f"cache_salt must be a non-empty string, got {salt!r}.")
        if params.truncate_prompt_tokens is not None:
            keep = self.max_model_len if params.truncate_prompt_tokens == -1 else params.truncate_prompt_tokens
            if keep > self.max_model_len:
                raise ValueError(f"SamplingParams.truncate_prompt_tokens ({keep}) is larger than the maximum model "
                                 f"length ({self.max_model_len}); give at most {self.max_model_len}, or -1 for "
                                 "max_model_len.")
            ids = ids[-keep:]
        if not ids:
            raise ValueError("The prompt is empty; give at least one token.")
        if len(ids) > self.max_model_len:
            raise ValueError(f"The prompt is {len(ids)} tokens long, longer than the maximum model length of "
                             f"{self.max_model_len} tokens. Shorten the prompt or raise max_model_len.")
        if self.num_blocks is not None and -(-len(ids) // self.block_size) > self.num_blocks:
            raise ValueError(f"The prompt needs {-(-len(ids) // self.block_size)} KV blocks but the cache has only "
                             f"{self.num_blocks}; give the KV cache more memory.")
        self._check_params(params)
        if params.best_of is not None and params.best_of > params.n:
            # The entry points (LLM, the OpenAI server) pick the best n themselves; the engine only samples.
            raise ValueError(f"SamplingParams.best_of ({params.best_of}) > n ({params.n}) is applied by LLM and the "
                             "OpenAI server; when calling the engine directly, ask for n=best_of samples and rank "
                             "them by cumulative_logprob.")
        params = params.clone()
        params.update_from_tokenizer(self.eos_token_id, self._bad_words_ids(params))
        params.all_stop_token_ids.update(self.extra_eos_ids)  # with ignore_eos too: min_tokens masks them
        arrival = time.time() if arrival_time is None else arrival_time
        if params.n == 1:
            return text, [EngineCoreRequest(request_id, ids, params, arrival, priority, salt, lora_request)]
        children = []
        for i in range(params.n):
            child = params.clone()
            child.n, child.best_of = 1, None  # a child is one sample: best_of == n must not outlive n
            child._all_stop_token_ids = set(params.all_stop_token_ids)
            if params.seed is not None:
                child.seed = params.seed + i  # distinct but reproducible samples
            children.append(EngineCoreRequest(f"{i}_{request_id}", ids, child, arrival, priority, salt,
                                              lora_request))
        return text, children
