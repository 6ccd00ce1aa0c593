"""Structured outputs through xgrammar: compile off the step loop, match per request, mask the batch at once.

    GrammarCompiler   one per engine (tokenizer + model vocab size + config). `submit(params)` compiles in a small
                      thread pool (xgrammar releases the GIL) and returns a Future; an LRU keyed by params.key()
                      hands a second identical request the same Future. `validate(params)` (or the free function
                      `validate_structured_outputs`) parses the spec without compiling token masks: cheap enough
                      for the API server to run before a request enters the engine.
    RequestGrammar    one per request: an xgrammar GrammarMatcher. accept_tokens / fill_bitmask / is_terminated /
                      rollback. Once the grammar is complete only stop tokens are allowed; once one is accepted the
                      grammar is terminated and its row allows only stop tokens (the request must end).
    allocate_bitmask / fill_bitmasks
                      the batch path: a [max_batch, ceil(V/32)] int32 CPU buffer, filled row by row for the
                      constrained rows only (multi-threaded). The model runner applies it to the logits
                      (kernels/triton_bitmask.py); this package stays on the host.

Bitmask rows and logits rows are aligned: bitmask row i masks logits row i (xgrammar's `indices` convention).
"""
from __future__ import annotations

import json
import os
import re
import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
import xgrammar as xgr

from tokenmill.structured.config import StructuredOutputsConfig
from tokenmill.structured.params import StructuredOutputsParams

CompiledGrammar = xgr.CompiledGrammar

# JSON-schema keywords xgrammar 0.2.9 parses but does not enforce (probed: outputs violating them were accepted).
# Rejecting them keeps the promise "accepted means enforced" (vLLM with backend=xgrammar rejects them too).
# oneOf is enforced as anyOf (exact for disjoint branches, how oneOf is nearly always used), and unknown "format"s
# are annotations per the JSON-schema spec.
_UNENFORCED_KEYWORDS = ("not", "if", "then", "else", "dependentSchemas", "dependentRequired")
# Keywords whose value is a schema / a list of schemas / a map of name -> schema (the walker's road map).
_SCHEMA_KEYWORDS = ("items", "additionalItems", "additionalProperties", "unevaluatedProperties",
                    "unevaluatedItems", "contains", "propertyNames", "not", "if", "then", "else")
_SCHEMA_LIST_KEYWORDS = ("anyOf", "oneOf", "allOf", "prefixItems", "items")
_SCHEMA_MAP_KEYWORDS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_XGR_LOCATION = re.compile(r"\[[0-9:]+\] \S+?:\d+: |Check failed: \(.*?\) is false: ")


def _clean(err: BaseException) -> str:
    """xgrammar's C++ message without its timestamp/source-location/check prefixes."""
    return _XGR_LOCATION.sub("", str(err)).strip().rstrip(".") or type(err).__name__


# ----- spec preparation (shared by validation and compilation) --------------------------------------------------

def _walk_schema(schema: Any, path: str, visit) -> None:
    if not isinstance(schema, dict):
        return
    visit(schema, path)
    for key in _SCHEMA_KEYWORDS:
        if isinstance(schema.get(key), dict):
            _walk_schema(schema[key], f"{path}/{key}", visit)
    for key in _SCHEMA_LIST_KEYWORDS:
        if isinstance(schema.get(key), list):
            for i, sub in enumerate(schema[key]):
                _walk_schema(sub, f"{path}/{key}/{i}", visit)
    for key in _SCHEMA_MAP_KEYWORDS:
        if isinstance(schema.get(key), dict):
            for name, sub in schema[key].items():
                _walk_schema(sub, f"{path}/{key}/{name}", visit)


def _check_schema(schema: Any) -> None:
    def visit(node: dict, path: str) -> None:
        for kw in _UNENFORCED_KEYWORDS:
            if kw in node:
                raise ValueError(f"JSON schema keyword {kw!r} (at {path}/{kw}) is not supported by the xgrammar "
                                 "structured-outputs backend")
        if node.get("uniqueItems") is True:
            raise ValueError(f"JSON schema 'uniqueItems': true (at {path}/uniqueItems) is not supported by the "
                             "xgrammar structured-outputs backend")
        if isinstance(node.get("allOf"), list) and len(node["allOf"]) > 1:
            raise ValueError(f"JSON schema 'allOf' with more than one subschema (at {path}/allOf) is not supported "
                             "by the xgrammar structured-outputs backend; merge the subschemas into one")
    _walk_schema(schema, "#", visit)


def _close_objects(schema: Any) -> Any:
    """A copy of `schema` where every object that declares properties forbids other keys."""
    schema = json.loads(json.dumps(schema))

    def visit(node: dict, path: str) -> None:
        if "properties" in node or "patternProperties" in node:
            node["additionalProperties"] = False
    _walk_schema(schema, "#", visit)
    return schema


def _json_schema_text(params: StructuredOutputsParams, config: StructuredOutputsConfig) -> str:
    schema = params.json
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as e:
            raise ValueError(f"structured_outputs.json is not valid JSON: {e}") from None
    if schema is True:
        schema = {}
    if not isinstance(schema, dict):
        raise ValueError(f"structured_outputs.json must be a JSON schema object; got {schema!r:.200}")
    _check_schema(schema)
    if params.disable_additional_properties or config.disable_additional_properties:
        schema = _close_objects(schema)
    return json.dumps(schema)


def _json_format(params: StructuredOutputsParams, config: StructuredOutputsConfig) -> dict[str, Any]:
    if params.whitespace_pattern is not None:
        raise ValueError("structured_outputs.whitespace_pattern is not supported by the xgrammar backend; use "
                         "disable_any_whitespace for compact JSON")
    if params.disable_any_whitespace or config.disable_any_whitespace:
        return dict(any_whitespace=False, separators=(",", ":"))
    return dict(any_whitespace=True)


# xgrammar writes the characters of a length-bounded JSON string (minLength / maxLength) as this class, which lets
# raw control characters (a tab, U+0017...) into the string: the answer is then not valid JSON for a strict parser
# (json.loads). Its unbounded strings already exclude them; the bounded ones are given the same class.
_LOOSE_STRING_CHARS = '[^\\"\\\\\\r\\n]'
_JSON_STRING_CHARS = '[^\\0-\\x1f\\"\\\\]'


def _strict_strings(ebnf: str) -> str:
    """xgrammar EBNF with every JSON string character class valid JSON."""
    return ebnf.replace(_LOOSE_STRING_CHARS, _JSON_STRING_CHARS)


def _strict_json_ebnf(schema_text: str, fmt: dict[str, Any]) -> str:
    """The EBNF of xgrammar's grammar for a JSON schema, with every string character class valid JSON."""
    return _strict_strings(str(xgr.Grammar.from_json_schema(schema_text, **fmt)))


def _structural_tag_grammar(text: str, compiler: xgr.GrammarCompiler | None):
    """A structural tag's grammar, through its EBNF so that the JSON schemas inside get strict strings too. A tag
    that names tokens needs the vocabulary: the compiler builds it directly (None without a compiler: unchecked)."""
    try:
        ebnf = _strict_strings(str(xgr.Grammar.from_structural_tag(text)))
    except Exception as e:
        if "tokenizer_info" not in str(e):
            raise
        return None if compiler is None else compiler.compile_structural_tag(text)
    return xgr.Grammar.from_ebnf(ebnf) if compiler is None else compiler.compile_grammar(ebnf)


def _choice_ebnf(choices: Sequence[str]) -> str:
    # JSON string escapes (quote, backslash, \n, \u plus four hex digits) are also xgrammar EBNF escapes.
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def _is_ebnf(grammar: str) -> bool:
    """EBNF/GBNF (`root ::= ...`) versus Lark (`start: ...`)."""
    return "::=" in grammar


def _structural_tag_text(text: str) -> str:
    try:
        obj = json.loads(text)
    except ValueError as e:
        raise ValueError(f"structured_outputs.structural_tag is not valid JSON: {e}") from None
    if not isinstance(obj, dict):
        raise ValueError("structured_outputs.structural_tag must be a JSON object")
    if "structures" in obj:  # vLLM's legacy form: {"structures": [{"begin", "schema", "end"}], "triggers": [...]}
        try:
            items = [xgr.StructuralTagItem(begin=s["begin"], schema=json.dumps(s.get("schema", {})), end=s["end"])
                     for s in obj["structures"]]
            triggers = obj["triggers"]
        except (KeyError, TypeError) as e:
            raise ValueError("structured_outputs.structural_tag: each of 'structures' needs 'begin', 'schema' and "
                             f"'end', and 'triggers' must be a list of strings ({e!r})") from None
        except Exception as e:  # pydantic ValidationError
            raise ValueError(f"structured_outputs.structural_tag is malformed: {e}") from None
        return xgr.StructuralTag.from_legacy_structural_tag(items, triggers).model_dump_json(indent=None)
    if "format" not in obj:
        raise ValueError("structured_outputs.structural_tag needs 'format' (or vLLM's legacy 'structures' and "
                         "'triggers')")
    return text


def _build(params: StructuredOutputsParams, config: StructuredOutputsConfig, compiler: xgr.GrammarCompiler | None,
           tokenizer_info: xgr.TokenizerInfo | None = None):
    """Compile `params` with `compiler`, or (compiler None) only parse it into an xgr.Grammar. Raises ValueError."""
    kind = params.kind
    try:
        if kind in ("json", "json_object"):
            text = _json_schema_text(params, config) if kind == "json" else '{"type": "object"}'
            ebnf = _strict_json_ebnf(text, _json_format(params, config))
            return xgr.Grammar.from_ebnf(ebnf) if compiler is None else compiler.compile_grammar(ebnf)
        if kind == "regex":
            return xgr.Grammar.from_regex(params.regex) if compiler is None else compiler.compile_regex(params.regex)
        if kind == "choice":
            ebnf = _choice_ebnf(params.choice)
            return xgr.Grammar.from_ebnf(ebnf) if compiler is None else compiler.compile_grammar(ebnf)
        if kind == "grammar":
            if _is_ebnf(params.grammar):
                if compiler is None:
                    return xgr.Grammar.from_ebnf(params.grammar)
                return compiler.compile_grammar(params.grammar)
            if compiler is None:
                return xgr.Grammar.from_lark(params.grammar, tokenizer_info=tokenizer_info)
            return compiler.compile_lark(params.grammar)
        if kind == "structural_tag":
            return _structural_tag_grammar(_structural_tag_text(params.structural_tag), compiler)
    except Exception as e:  # xgrammar raises RuntimeError subclasses (and pydantic errors for structural tags)
        if type(e) is ValueError:  # ours, already worded for the user
            raise
        what = {"json": "JSON schema", "json_object": "JSON object grammar", "regex": "regex",
                "choice": "choice list", "structural_tag": "structural tag"}.get(kind)
        if kind == "grammar":
            what = "EBNF grammar" if _is_ebnf(params.grammar) else "Lark grammar (no '::=' rules, so read as Lark)"
        raise ValueError(f"invalid structured_outputs.{kind}: cannot use this {what}: {_clean(e)}") from None
    raise AssertionError(kind)


_validated: OrderedDict[str, None] = OrderedDict()
_validated_lock = threading.Lock()


def validate_structured_outputs(params: StructuredOutputsParams,
                                config: StructuredOutputsConfig | None = None) -> None:
    """Check that `params` can be compiled (schema/regex/grammar syntax, unsupported features) without building
    token masks; needs no tokenizer. Raises ValueError with a message for a 400. Results are remembered."""
    config = config or StructuredOutputsConfig()
    key = params.key() + ("|daw" if config.disable_any_whitespace else "") + (
        "|dap" if config.disable_additional_properties else "")
    with _validated_lock:
        if key in _validated:
            _validated.move_to_end(key)
            return
    _build(params, config, None)
    with _validated_lock:
        _validated[key] = None
        while len(_validated) > 1024:
            _validated.popitem(last=False)


# ----- the compiler ---------------------------------------------------------------------------------------------

class GrammarCompiler:
    """Compiles StructuredOutputsParams into xgrammar CompiledGrammars for one tokenizer, off the caller's thread.

    vocab_size is the model's (logits width, may exceed len(tokenizer)); ids past the tokenizer are never
    allowed. stop_token_ids are what a completed grammar lets through (default: the tokenizer's EOS); pass the
    model's EOS ids (generation_config) so a finished grammar can end the request.
    """

    def __init__(self, tokenizer: Any, vocab_size: int | None = None,
                 config: StructuredOutputsConfig | dict | None = None, *,
                 stop_token_ids: Sequence[int] | None = None, max_workers: int = 2, compile_threads: int = 4,
                 cache_size: int = 512) -> None:
        self.config = StructuredOutputsConfig.from_dict(config)
        if isinstance(tokenizer, xgr.TokenizerInfo):
            self.tokenizer_info = tokenizer
        else:
            self.tokenizer_info = xgr.TokenizerInfo.from_huggingface(
                tokenizer, vocab_size=vocab_size, stop_token_ids=list(stop_token_ids) if stop_token_ids else None)
        self.vocab_size = self.tokenizer_info.vocab_size
        self.stop_token_ids = list(self.tokenizer_info.stop_token_ids)
        # xgrammar's own cache is off: ours (below) holds the futures, so in-flight duplicates share work too.
        self._xgr = xgr.GrammarCompiler(self.tokenizer_info, max_threads=compile_threads, cache_enabled=False)
        self._executor = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="tokenmill-grammar")
        self._cache: OrderedDict[str, Future] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()
        self.num_compiles = 0  # compilations started (cache misses); for tests and metrics

    def submit(self, params: StructuredOutputsParams) -> Future:
        """Start compiling (or reuse the cached compilation of an identical spec). The Future's result is a
        CompiledGrammar; its exception a ValueError for an invalid spec."""
        key = params.key()
        with self._lock:
            fut = self._cache.get(key)
            if fut is not None:
                self._cache.move_to_end(key)
                return fut
            self.num_compiles += 1
            fut = self._executor.submit(_build, params, self.config, self._xgr)
            self._cache[key] = fut
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
            return fut

    def compile_sync(self, params: StructuredOutputsParams) -> CompiledGrammar:
        """Compile and wait (tests, offline warm-up). Raises ValueError for an invalid spec."""
        return self.submit(params).result()

    def validate(self, params: StructuredOutputsParams) -> None:
        """Raise ValueError if `params` cannot be compiled. Parses only (no token masks, ~0.5 ms for a typical
        schema, remembered per spec), except structural tags, which may name tokens and are compiled (cached)."""
        if params.kind == "structural_tag":
            self.compile_sync(params)  # may name tokens, which only the vocabulary resolves; cached for later
            return
        if params.kind == "grammar" and not _is_ebnf(params.grammar):
            _build(params, self.config, None, self.tokenizer_info)  # Lark may name special tokens
            return
        validate_structured_outputs(params, self.config)

    def new_request_grammar(self, compiled: CompiledGrammar,
                            stop_token_ids: Iterable[int] | None = None) -> RequestGrammar:
        return RequestGrammar(compiled, stop_token_ids=stop_token_ids, vocab_size=self.vocab_size)

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


# ----- one request ----------------------------------------------------------------------------------------------

class RequestGrammar:
    """The matcher state of one request.

    stop_token_ids: the request's stop tokens (EOS plus SamplingParams.stop_token_ids); when given they replace
    the compiler's, and a completed grammar allows exactly these. After a stop token is accepted the grammar is
    terminated: accept_tokens returns False and fill_bitmask allows stop tokens only.
    """

    __slots__ = ("matcher", "stop_token_ids", "vocab_size", "num_accepted")

    def __init__(self, compiled: CompiledGrammar, stop_token_ids: Iterable[int] | None = None,
                 vocab_size: int | None = None) -> None:
        stops = sorted(set(stop_token_ids)) if stop_token_ids else None
        self.matcher = xgr.GrammarMatcher(compiled, override_stop_tokens=stops)
        self.stop_token_ids = list(self.matcher.stop_token_ids)
        self.vocab_size = vocab_size or compiled.tokenizer_info.vocab_size
        self.num_accepted = 0

    def accept_tokens(self, token_ids: Iterable[int]) -> bool:
        """Advance by the sampled tokens. False: a token the grammar forbids (the mask was not applied) or a
        token after termination; the matcher keeps the tokens accepted before it."""
        matcher = self.matcher
        for t in token_ids:
            if not matcher.accept_token(int(t)):
                return False
            self.num_accepted += 1
        return True

    def validate_tokens(self, token_ids: Sequence[int]) -> int:
        """How many leading tokens of `token_ids` the grammar accepts (state unchanged; for speculative drafts)."""
        n = 0
        for t in token_ids:
            if not self.matcher.accept_token(int(t)):
                break
            n += 1
        if n:
            self.matcher.rollback(n)
        return n

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into bitmask[row] (a CPU int32 tensor)."""
        if self.matcher.is_terminated():
            _fill_stop_only(bitmask, row, self.stop_token_ids)
        else:
            self.matcher.fill_next_token_bitmask(bitmask, row)

    def is_terminated(self) -> bool:
        """True once a stop token was accepted after a complete output: the request is done."""
        return self.matcher.is_terminated()

    def is_completed(self) -> bool:
        """True when the output so far is a complete match (a stop token may come next)."""
        return self.matcher.is_completed()

    def rollback(self, num_tokens: int) -> None:
        """Undo the last num_tokens accepted tokens (speculative decoding, preemption replay)."""
        if num_tokens > 0:
            self.matcher.rollback(num_tokens)
            self.num_accepted -= num_tokens

    def reset(self) -> None:
        self.matcher.reset()
        self.num_accepted = 0


def _fill_stop_only(bitmask: torch.Tensor, row: int, stop_token_ids: Sequence[int]) -> None:
    bitmask[row].zero_()
    for t in stop_token_ids:
        bitmask[row, t >> 5] |= _bit(t & 31)


def _bit(i: int) -> int:
    return (1 << i) - (1 << 32) if i == 31 else 1 << i  # int32: bit 31 is the sign bit


# ----- the batch path -------------------------------------------------------------------------------------------

def allocate_bitmask(max_batch: int, vocab_size: int, pin_memory: bool | None = None) -> torch.Tensor:
    """A [max_batch, ceil(vocab_size / 32)] int32 CPU buffer (pinned when CUDA is present) for fill_bitmasks."""
    if pin_memory is None:
        pin_memory = torch.cuda.is_available()
    shape = xgr.get_bitmask_shape(max_batch, vocab_size)
    return torch.full(shape, -1, dtype=torch.int32, pin_memory=pin_memory)


_batch_matcher: xgr.BatchGrammarMatcher | None = None
# xgrammar's multi-threaded batch fill pays off only with several idle cores: on a 2-core box it was slower than
# the plain loop (32 JSON rows, SmolLM2 vocab: ~0.3 ms either way). Below these sizes the loop is used.
_BATCH_FILL_MIN_ROWS = 8
_BATCH_FILL_THREADS = min(8, (os.cpu_count() or 1) // 2)


def fill_bitmasks(grammars: Sequence[RequestGrammar], bitmask: torch.Tensor, rows: Sequence[int]) -> None:
    """grammars[k].fill_bitmask(bitmask, rows[k]) for every k; with many rows and cores, in one multi-threaded
    xgrammar call. Rows not listed are left as they are (their logits are not masked anyway)."""
    global _batch_matcher
    if len(grammars) != len(rows):
        raise ValueError(f"fill_bitmasks: {len(grammars)} grammars but {len(rows)} rows")
    if len(grammars) < _BATCH_FILL_MIN_ROWS or _BATCH_FILL_THREADS < 4:
        for g, r in zip(grammars, rows):
            g.fill_bitmask(bitmask, r)
        return
    live, live_rows = [], []
    for g, r in zip(grammars, rows):
        if g.matcher.is_terminated():
            _fill_stop_only(bitmask, r, g.stop_token_ids)
        else:
            live.append(g.matcher)
            live_rows.append(int(r))
    if live:
        if _batch_matcher is None:
            _batch_matcher = xgr.BatchGrammarMatcher(_BATCH_FILL_THREADS)
        _batch_matcher.batch_fill_next_token_bitmask(live, bitmask, live_rows)
