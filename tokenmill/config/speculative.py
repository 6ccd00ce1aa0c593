"""Speculative decoding configuration: `--speculative-config` / `LLM(speculative_config=...)` as vLLM 0.20 reads it.

The engine argument is one JSON object (a dict from Python, a JSON string on the command line); `SpeculativeConfig`
is its parsed, validated form, kept on `TokenmillConfig.speculative_config` (None: no speculation).
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any

from tokenmill.config.utils import config_field, not_supported_yet

FLAG = "--speculative-config"
BUILT_METHODS = ("ngram", "suffix", "draft_model", "eagle", "eagle3")
# Methods whose drafter is a model of its own, writing its KV into the target's blocks.
MODEL_METHODS = ("draft_model", "eagle", "eagle3")
# vLLM 0.20's methods that tokenmill does not build yet: refused naming the method.
UNBUILT_METHODS = ("mtp", "medusa", "mlp_speculator", "ernie_mtp",
                   "qwen3_next_mtp", "deepseek_mtp", "longcat_flash_mtp", "glm4_moe_mtp")
MAX_SPECULATIVE_TOKENS = 16


@dataclass
class SpeculativeConfig:
    """One parsed `speculative_config`.

    method: ngram (prompt lookup over the request's own tokens), suffix (suffix decoding over the request's tokens
    and earlier outputs), draft_model (a smaller model with the target's vocabulary drafts greedily; `model` and
    the draft_* / quantization / max_model_len / revision keys describe it, and `finalize` builds its ModelConfig,
    `draft_model_config`), or eagle / eagle3 (an EAGLE-1 / EAGLE-3 head at `model` drafts greedily from the
    target's hidden states; `finalize` reads and checks it into `eagle_head`, see config/spec_eagle.py);
    num_speculative_tokens: k, the drafts proposed and verified per decoding request per
    step (1..16). disable_by_batch_size: with more running requests than this the engine decodes without drafts
    (None: always speculate). benchmark_acceptance_rate (a tokenmill extension, for dummy weights): every step
    proposes k tokens and each draft is accepted with this probability whatever the target says, so the
    mechanism's cost can be measured apart from draft quality; the output is then not the model's. step_aside (a
    tokenmill extension, default true): the engine measures seconds per output token with and without drafts and
    decodes without them while that is faster (spec_decode/step_aside.py); false: always speculate.
    """
    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 5
    disable_by_batch_size: int | None = None
    benchmark_acceptance_rate: float | None = None
    step_aside: bool = True
    suffix_decoding_max_tree_depth: int = 24
    suffix_decoding_max_cached_requests: int = 10000
    suffix_decoding_max_spec_factor: float = 1.0
    suffix_decoding_min_token_prob: float = 0.1
    model: str | None = None
    draft_tensor_parallel_size: int | None = None
    quantization: str | None = None
    max_model_len: int | None = None
    revision: str | None = None
    code_revision: str | None = None

    @classmethod
    def from_value(cls, value: Any) -> "SpeculativeConfig | None":
        """Parse the engine argument (None, a dict, or a JSON string); ValueError naming the key on bad input."""
        if value is None or value == {} or value == "":
            return None
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as e:
                raise ValueError(f"{FLAG}: not valid JSON ({e}): {value!r}") from None
        if isinstance(value, SpeculativeConfig):
            return value
        if not isinstance(value, dict):
            raise ValueError(f"{FLAG} must be a JSON object, got {type(value).__name__}: {value!r}")
        d = dict(value)
        method, model = d.pop("method", None), d.pop("model", None)
        if method is None:  # vLLM infers the method from `model` when it is not given
            method = _method_of_model(model)
        if method is None:
            raise ValueError(f"{FLAG}: `method` is required (one of {', '.join(BUILT_METHODS)}).")
        if method in UNBUILT_METHODS:
            raise not_supported_yet("speculative_config", {"method": method},
                                    f"The speculative method `{method}` is not built yet; use method "
                                    f"{', '.join(BUILT_METHODS[:-1])} or {BUILT_METHODS[-1]}.")
        if method not in BUILT_METHODS:
            raise ValueError(f"{FLAG}: unknown `method` {method!r}; allowed: "
                             f"{', '.join(BUILT_METHODS + UNBUILT_METHODS)}.")
        if method in MODEL_METHODS:
            if not model or model in ("ngram", "[ngram]"):
                what = "the draft model's directory, .gguf file" if method == "draft_model" else \
                    "the EAGLE head's directory"
                raise ValueError(f"{FLAG}: method {method} needs `model`, {what} or cached repo id.")
            d["model"] = model
            if method != "draft_model":
                for key in ("quantization", "max_model_len"):
                    if d.get(key) is not None:
                        raise not_supported_yet("speculative_config", {key: d[key]},
                                                f"`{key}` applies to a draft model; an {method} head runs "
                                                "unquantized over the target's context.")
        else:
            if model not in (None, "ngram", "[ngram]"):
                raise ValueError(f"{FLAG}: `model` ({model!r}) names a draft model, which method {method} does not "
                                 "use.")
            for key in _DRAFT_KEYS:
                v = d.pop(key, None)
                if v not in (None, 1) or (key != "draft_tensor_parallel_size" and v is not None):
                    raise ValueError(f"{FLAG}: `{key}` applies to a draft model; method {method} has none.")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"{FLAG}: unknown key(s) {', '.join(map(repr, unknown))}; known: "
                             f"method, model, {', '.join(sorted(names - {'method'}))}.")
        if "num_speculative_tokens" not in d:
            raise ValueError(f"{FLAG}: `num_speculative_tokens` is required.")
        return cls(method=method, **d)

    def __post_init__(self) -> None:
        k = self.num_speculative_tokens
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"{FLAG}: `num_speculative_tokens` must be an integer in 1..{MAX_SPECULATIVE_TOKENS}, "
                             f"got {k!r}.")
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        for key, v in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{FLAG}: `{key}` must be an integer >= 1, got {v!r}.")
        if lo > hi:
            raise ValueError(f"{FLAG}: `prompt_lookup_min` ({lo}) is larger than `prompt_lookup_max` ({hi}).")
        b = self.disable_by_batch_size
        if b is not None and (isinstance(b, bool) or not isinstance(b, int) or b < 1):
            raise ValueError(f"{FLAG}: `disable_by_batch_size` must be an integer >= 1, got {b!r}.")
        r = self.benchmark_acceptance_rate
        if r is not None and not (isinstance(r, (int, float)) and 0.0 <= r <= 1.0):
            raise ValueError(f"{FLAG}: `benchmark_acceptance_rate` must be in [0, 1], got {r!r}.")
        if not isinstance(self.step_aside, bool):
            raise ValueError(f"{FLAG}: `step_aside` must be true or false, got {self.step_aside!r}.")
        for key in ("suffix_decoding_max_tree_depth", "suffix_decoding_max_cached_requests"):
            v = getattr(self, key)
            if isinstance(v, bool) or not isinstance(v, int) or v < (1 if key.endswith("depth") else 0):
                raise ValueError(f"{FLAG}: `{key}` must be a non-negative integer, got {v!r}.")
        if not 0 < self.suffix_decoding_max_spec_factor:
            raise ValueError(f"{FLAG}: `suffix_decoding_max_spec_factor` must be > 0.")
        if not 0 <= self.suffix_decoding_min_token_prob <= 1:
            raise ValueError(f"{FLAG}: `suffix_decoding_min_token_prob` must be in [0, 1].")
        t = self.draft_tensor_parallel_size
        if t is not None and (isinstance(t, bool) or not isinstance(t, int) or t < 1):
            raise ValueError(f"{FLAG}: `draft_tensor_parallel_size` must be an integer >= 1, got {t!r}.")
        m = self.max_model_len
        if m is not None and (isinstance(m, bool) or not isinstance(m, int) or m < 1):
            raise ValueError(f"{FLAG}: `max_model_len` must be an integer >= 1, got {m!r}.")
        self.draft_model_config = None  # set by finalize (draft_model)
        self.eagle_head = None  # set by finalize (eagle, eagle3): a config.spec_eagle.EagleHeadConfig

    @property
    def uses_draft_model(self) -> bool:
        """A drafter with a model of its own that writes KV for its k drafts into the target's blocks (a draft
        model or an EAGLE head): the scheduler reserves k slots past each step for it."""
        return self.method in MODEL_METHODS

    @property
    def uses_eagle(self) -> bool:
        return self.method in ("eagle", "eagle3")

    def finalize(self, target, tensor_parallel_size: int) -> None:
        """Build and check the draft model's ModelConfig against the target's (a config.ModelConfig): same
        vocabulary, a plain full-attention decoder, a context of at most the target's. Raises ValueError naming
        the key."""
        if self.uses_eagle:
            from tokenmill.config.spec_eagle import eagle_head_config
            self.eagle_head = eagle_head_config(self, target, tensor_parallel_size)
            return
        if not self.uses_draft_model:
            return
        from tokenmill.config.spec_draft import draft_model_config
        self.draft_model_config = draft_model_config(self, target, tensor_parallel_size)


_DRAFT_KEYS = ("draft_tensor_parallel_size", "quantization", "max_model_len", "revision", "code_revision",
               "tensor_parallel_size")


def _method_of_model(model: str | None) -> str | None:
    """vLLM's inference of `method` from `model` alone."""
    if model is None:
        return None
    if model in ("ngram", "[ngram]"):
        return "ngram"
    name = model.lower()
    return "eagle3" if "eagle3" in name else "eagle" if "eagle" in name else "draft_model"


@dataclass
class SpeculativeArgs:
    """The engine argument itself (the CLI is generated from this field); parsed into SpeculativeConfig."""
    speculative_config: dict | None = config_field(
        None, help="Speculative decoding as a JSON object, e.g. '{\"method\": \"ngram\", \"num_speculative_tokens\": "
                   "4, \"prompt_lookup_max\": 4}' or '{\"method\": \"suffix\", \"num_speculative_tokens\": 8}'. Keys: "
                   "method (ngram, suffix, draft_model, eagle, eagle3), model (the draft model or EAGLE head), "
                   "num_speculative_tokens (1..16), "
                   "prompt_lookup_min/max, disable_by_batch_size, suffix_decoding_*, draft_tensor_parallel_size, "
                   "quantization / max_model_len / revision (of the draft), benchmark_acceptance_rate (dummy "
                   "weights only), step_aside (default true: decode without drafts while that is measured faster). "
                   "MTP is not supported yet.")

    def __post_init__(self) -> None:
        if isinstance(self.speculative_config, str):  # the CLI hands over the JSON text when it does not parse
            SpeculativeConfig.from_value(self.speculative_config)
        self.parsed = SpeculativeConfig.from_value(self.speculative_config)
