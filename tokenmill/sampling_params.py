"""vLLM-compatible sampling parameters.

`SamplingParams` is a msgspec struct so it crosses the engine-core process boundary as-is. Every field is
validated on construction: a bad value raises ValueError naming the field and what is allowed. Checks that
need the model (vocabulary size, max_logprobs, max_model_len) happen in `engine/processor.py`.
"""
from __future__ import annotations

import copy
import dataclasses
import enum
import math
from typing import Any

import msgspec

from tokenmill import envs
from tokenmill.logger import init_logger
from tokenmill.structured.params import GuidedDecodingParams, StructuredOutputsParams, as_structured_outputs

__all__ = ["BeamSearchParams", "GuidedDecodingParams", "RequestOutputKind", "SamplingParams", "SamplingType",
           "StructuredOutputsParams"]

logger = init_logger(__name__)

_GREEDY_EPS = 1e-5
# vLLM raises a positive temperature below this to it (logits / tiny t overflow to inf and NaN).
_MIN_TEMPERATURE = 0.01


class RequestOutputKind(enum.IntEnum):
    """How outputs are reported while a request runs."""
    CUMULATIVE = 0  # every output holds everything produced so far
    DELTA = 1       # every output holds only what is new since the last one
    FINAL_ONLY = 2  # one output, when the request finishes


class SamplingType(enum.IntEnum):
    GREEDY = 0
    RANDOM = 1
    RANDOM_SEED = 2


class SamplingParams(msgspec.Struct, kw_only=True, omit_defaults=True, dict=True):
    """Sampling parameters for one request, with vLLM's names, defaults and meanings.

    temperature 0 means greedy decoding; top_k 0 or -1 means no top-k; logprobs / prompt_logprobs of N return the
    N most likely tokens per position (plus the chosen one), -1 means the whole vocabulary.
    """
    n: int = 1
    best_of: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    detokenize: bool = True
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    truncate_prompt_tokens: int | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    structured_outputs: StructuredOutputsParams | None = None
    # vLLM's older spelling of structured_outputs (a GuidedDecodingParams): moved there on construction.
    guided_decoding: StructuredOutputsParams | None = None
    extra_args: dict[str, Any] | None = None

    # Filled by the engine, not by users.
    _all_stop_token_ids: set[int] = msgspec.field(default_factory=set)
    _bad_words_token_ids: list[list[int]] | None = None
    _eos_token_id: int | None = None
    # Structured outputs of a reasoning model: the grammar applies only after this token (e.g. `</think>`).
    _grammar_after_token_id: int | None = None

    def __post_init__(self) -> None:
        self._check_types()
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        elif self.stop is None:
            self.stop = []
        else:
            self.stop = list(self.stop)
        # Duplicates dropped (first occurrence kept), as vLLM does.
        self.stop_token_ids = list(dict.fromkeys(self.stop_token_ids or []))
        bad_words = [self.bad_words] if isinstance(self.bad_words, str) else list(self.bad_words or [])
        if any(not isinstance(w, str) or not w.strip() for w in bad_words):
            raise ValueError(f"SamplingParams.bad_words must be non-empty strings, got {bad_words!r}.")
        self.bad_words = list(dict.fromkeys(bad_words))
        if self.seed == -1:
            self.seed = None  # vLLM: -1 means unseeded
        if self.logit_bias is not None:
            if any(isinstance(k, bool) for k in self.logit_bias):
                raise ValueError(f"SamplingParams.logit_bias must be keyed by token ids, got {self.logit_bias!r}.")
            try:
                self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()}
            except (TypeError, ValueError, AttributeError) as e:
                raise ValueError(f"SamplingParams.logit_bias must map token ids to numbers: {e}") from None
            if not all(math.isfinite(v) for v in self.logit_bias.values()):
                raise ValueError("SamplingParams.logit_bias values must be finite numbers.")
        if isinstance(self.logprobs, bool):
            self.logprobs = 1 if self.logprobs else None
        if isinstance(self.prompt_logprobs, bool):
            self.prompt_logprobs = 1 if self.prompt_logprobs else None
        self._verify()
        if 0 < self.temperature < _MIN_TEMPERATURE:
            logger.warning("temperature %s is below %s, which may overflow to inf / NaN; raised to %s (as vLLM "
                           "does).", self.temperature, _MIN_TEMPERATURE, _MIN_TEMPERATURE)
            self.temperature = _MIN_TEMPERATURE
        if self.temperature < _GREEDY_EPS:
            # Greedy: the filters cannot change the argmax, so turn them off (vLLM does the same).
            self.top_p, self.top_k, self.min_p = 1.0, 0, 0.0
            if self.n > 1:  # n identical sequences: vLLM refuses the request rather than computing them
                raise ValueError(f"SamplingParams.n must be 1 when using greedy sampling (temperature=0), got "
                                 f"{self.n}; give a temperature > 0 for {self.n} different samples.")
        if self.top_k == -1:
            self.top_k = 0
        # Union, not assignment: msgspec re-runs __post_init__ when decoding a struct the engine already filled.
        self._all_stop_token_ids = set(self._all_stop_token_ids) | set(self.stop_token_ids)

    _FLOAT_FIELDS = ("presence_penalty", "frequency_penalty", "repetition_penalty", "temperature", "top_p", "min_p")
    _INT_FIELDS = ("n", "top_k", "min_tokens")
    _BOOL_FIELDS = ("ignore_eos", "include_stop_str_in_output", "detokenize", "skip_special_tokens",
                    "spaces_between_special_tokens")

    def _check_types(self) -> None:
        """Wrong types are ValueErrors naming the field (not TypeErrors from a comparison deep inside)."""
        for name in self._FLOAT_FIELDS:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise ValueError(f"SamplingParams.{name} must be a finite number, got {v!r}.")
        for name in self._INT_FIELDS:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int):
                raise ValueError(f"SamplingParams.{name} must be an integer, got {v!r}.")
        for name in self._BOOL_FIELDS:
            v = getattr(self, name)
            # A string such as "false" would otherwise read as true.
            if isinstance(v, (str, bytes)) or not (isinstance(v, bool) or v in (0, 1)):
                raise ValueError(f"SamplingParams.{name} must be True or False, got {v!r}.")
        if self.stop is not None and not isinstance(self.stop, (str, list, tuple)):
            raise ValueError(f"SamplingParams.stop must be a string or a list of strings, got {self.stop!r}.")
        for name in ("stop_token_ids", "bad_words", "allowed_token_ids"):
            v = getattr(self, name)
            if v is not None and not isinstance(v, (list, tuple, str if name == "bad_words" else list)):
                raise ValueError(f"SamplingParams.{name} must be a list, got {v!r}.")
        if self.logit_bias is not None and not isinstance(self.logit_bias, dict):
            raise ValueError(f"SamplingParams.logit_bias must be a dict of token id -> bias, got {self.logit_bias!r}.")
        if self.extra_args is not None and not isinstance(self.extra_args, dict):
            raise ValueError(f"SamplingParams.extra_args must be a dict or None, got {self.extra_args!r}.")

    @classmethod
    def from_optional(cls, **kwargs: Any) -> "SamplingParams":
        """Build from keyword arguments, dropping the ones that are None (protocol layers use this)."""
        return cls(**{k: v for k, v in kwargs.items() if v is not None})

    def _verify(self) -> None:
        def bad(field: str, allowed: str, value: Any) -> ValueError:
            return ValueError(f"SamplingParams.{field} must be {allowed}, got {value!r}.")

        if not isinstance(self.n, int) or self.n < 1:
            raise bad("n", "an integer >= 1", self.n)
        if self.best_of is not None and (isinstance(self.best_of, bool) or not isinstance(self.best_of, int)
                                         or self.best_of < self.n):
            raise bad("best_of", f"an integer >= n ({self.n}): the number of candidates the n results are picked "
                      "from", self.best_of)
        most = envs.VLLM_MAX_N_SEQUENCES
        for name in ("n", "best_of"):
            if (getattr(self, name) or 0) > most:
                raise bad(name, f"at most {most} (VLLM_MAX_N_SEQUENCES)", getattr(self, name))
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not -2.0 <= v <= 2.0:
                raise bad(name, "in [-2, 2]", v)
        if not self.repetition_penalty > 0.0:
            raise bad("repetition_penalty", "> 0", self.repetition_penalty)
        if not 0.0 <= self.temperature <= 2.0:   # vLLM's (and OpenAI's) range
            raise bad("temperature", "in [0, 2]", self.temperature)
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", "in (0, 1]", self.top_p)
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise bad("top_k", "-1, 0 (both disable it) or a positive integer", self.top_k)
        if not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", "in [0, 1]", self.min_p)
        # bool is an int to Python, but True as a count or a token id is a mistake, not 1.
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise bad("seed", "an integer or None", self.seed)
        if self.max_tokens is not None and (isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int)
                                            or self.max_tokens < 1):
            raise bad("max_tokens", "an integer >= 1 (or None for as many as fit)", self.max_tokens)
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise bad("min_tokens", "an integer >= 0", self.min_tokens)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", f"<= max_tokens ({self.max_tokens})", self.min_tokens)
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or v < -1):
                raise bad(name, "None, -1 (whole vocabulary) or an integer >= 0", v)
        if self.truncate_prompt_tokens is not None and (
                isinstance(self.truncate_prompt_tokens, bool) or not isinstance(self.truncate_prompt_tokens, int)
                or (self.truncate_prompt_tokens < 1 and self.truncate_prompt_tokens != -1)):
            raise bad("truncate_prompt_tokens", "None, -1 (max_model_len) or an integer >= 1",
                      self.truncate_prompt_tokens)
        if any(not isinstance(s, str) or s == "" for s in self.stop):
            raise bad("stop", "non-empty strings", self.stop)
        if any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", "non-negative integers", self.stop_token_ids)
        if self.stop and not self.detokenize:
            raise bad("stop", "empty when detokenize=False (stop strings need text)", self.stop)
        if self.allowed_token_ids is not None:
            if len(self.allowed_token_ids) == 0:
                raise bad("allowed_token_ids", "a non-empty list of token ids", self.allowed_token_ids)
            if any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in self.allowed_token_ids):
                raise bad("allowed_token_ids", "non-negative integers", self.allowed_token_ids)
        if self.logit_bias and any(k < 0 for k in self.logit_bias):
            raise bad("logit_bias", "keyed by non-negative token ids", self.logit_bias)
        if self.guided_decoding is not None:
            if self.structured_outputs is not None:
                raise ValueError("SamplingParams.guided_decoding and SamplingParams.structured_outputs are two "
                                 "spellings of one setting; give only one (structured_outputs is the current one).")
            # Cleared once moved, as vLLM does: the struct is re-validated when it reaches the engine core.
            self.structured_outputs = as_structured_outputs(self.guided_decoding, "guided_decoding")
            self.guided_decoding = None
        elif self.structured_outputs is not None:
            self.structured_outputs = as_structured_outputs(self.structured_outputs, "structured_outputs")
        if not isinstance(self.output_kind, RequestOutputKind):
            try:
                self.output_kind = RequestOutputKind(self.output_kind)
            except ValueError:
                raise bad("output_kind", "a RequestOutputKind (CUMULATIVE=0, DELTA=1, FINAL_ONLY=2)",
                          self.output_kind) from None

    # ----- derived properties used by the engine -----
    @property
    def sampling_type(self) -> SamplingType:
        if self.temperature < _GREEDY_EPS:
            return SamplingType.GREEDY
        return SamplingType.RANDOM if self.seed is None else SamplingType.RANDOM_SEED

    @property
    def all_stop_token_ids(self) -> set[int]:
        return self._all_stop_token_ids

    @property
    def stopping_token_ids(self) -> set[int] | list[int]:
        """The token ids that end the request: all_stop_token_ids, less the EOS ids under ignore_eos (which
        all_stop_token_ids keeps, as vLLM does, so that min_tokens still holds EOS back)."""
        return self.stop_token_ids if self.ignore_eos else self._all_stop_token_ids

    @property
    def bad_words_token_ids(self) -> list[list[int]] | None:
        return self._bad_words_token_ids

    def clone(self) -> "SamplingParams":
        """A deep copy: the engine fills private fields per request and must not touch the caller's object."""
        return copy.deepcopy(self)

    def update_from_tokenizer(self, eos_token_id: int | None, bad_words_ids: list[list[int]] | None) -> None:
        """Called by the processor once the tokenizer is known: adds EOS to the stop set and stores bad words.
        EOS joins all_stop_token_ids even with ignore_eos, as in vLLM: min_tokens masks every id of that set, and
        ignore_eos only keeps EOS from ending the request (see stopping_token_ids)."""
        self._eos_token_id = eos_token_id
        if eos_token_id is not None:
            self._all_stop_token_ids.add(eos_token_id)
        self._bad_words_token_ids = bad_words_ids or None

    def __repr__(self) -> str:
        fields = {f: getattr(self, f) for f in self.__struct_fields__ if not f.startswith("_")}
        return "SamplingParams(" + ", ".join(f"{k}={v!r}" for k, v in fields.items()) + ")"


@dataclasses.dataclass
class BeamSearchParams:
    """vLLM's beam-search parameters."""
    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.beam_width, int) or self.beam_width < 1:
            raise ValueError(f"BeamSearchParams.beam_width must be an integer >= 1, got {self.beam_width!r}.")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"BeamSearchParams.max_tokens must be an integer >= 1, got {self.max_tokens!r}.")
        if not self.temperature >= 0.0:
            raise ValueError(f"BeamSearchParams.temperature must be >= 0, got {self.temperature!r}.")
