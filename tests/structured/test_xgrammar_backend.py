"""Structured outputs through xgrammar: params, config, compilation, simulated constrained decoding, batch masks."""
from __future__ import annotations

import json
import re

import msgspec
import numpy as np
import pytest
import torch

from tokenmill.structured import StructuredOutputsConfig, StructuredOutputsParams, from_response_format
from tokenmill.kernels import triton_bitmask
from tokenmill.structured.backend_xgrammar import (GrammarCompiler, RequestGrammar, allocate_bitmask, fill_bitmasks,
                                                   validate_structured_outputs)

VOCAB = 49152


# ----- fixtures and helpers -------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def compiler(smollm2_tokenizer):
    gc = GrammarCompiler(smollm2_tokenizer, vocab_size=VOCAB)
    yield gc
    gc.shutdown()


@pytest.fixture(scope="module")
def bias(compiler):
    """Logit bias that makes random decoding finish: favour closing characters and stop tokens, shun whitespace.
    (Random logits alone wander through whitespace and endless strings; the grammar is still what decides.)"""
    b = torch.zeros(VOCAB)
    for i, piece in enumerate(compiler.tokenizer_info.decoded_vocab[:VOCAB]):
        if piece and not piece.strip():
            b[i] = -8.0
        elif any(c in piece for c in (b'"', b'}', b']', b',')):
            b[i] = 2.5
    b[compiler.stop_token_ids] = 6.0
    return b


def decode(tokenizer, compiler, params=None, *, seed=0, max_steps=400, bias=None, grammar=None):
    """Simulated constrained decoding: fill mask -> apply to random logits -> argmax -> accept, until terminated."""
    if grammar is None:
        grammar = RequestGrammar(compiler.compile_sync(params))
    bitmask = allocate_bitmask(1, compiler.vocab_size)
    gen = torch.Generator().manual_seed(seed)
    ids = []
    for _ in range(max_steps):
        grammar.fill_bitmask(bitmask, 0)
        logits = torch.randn(1, VOCAB, generator=gen) * 2
        if bias is not None:
            logits += bias
        apply_bitmask(logits, bitmask, [0])
        token = int(torch.argmax(logits[0]))
        assert grammar.accept_tokens([token]), f"masked sampling produced a forbidden token {token}"
        if grammar.is_terminated():
            assert token in compiler.stop_token_ids
            return tokenizer.decode(ids)
        ids.append(token)
    raise AssertionError(f"not terminated after {max_steps} steps: {tokenizer.decode(ids)!r}")


def check_schema(value, schema, root=None, path="$"):
    """A small JSON-schema checker for the keywords these tests use (jsonschema is not a dependency)."""
    root = root if root is not None else schema
    if "$ref" in schema:
        target = root
        for part in schema["$ref"].lstrip("#/").split("/"):
            target = target[part]
        return check_schema(value, target, root, path)
    if "anyOf" in schema:
        errors = []
        for sub in schema["anyOf"]:
            try:
                return check_schema(value, sub, root, path)
            except AssertionError as e:
                errors.append(str(e))
        raise AssertionError(f"{path}: matches no anyOf branch: {errors}")
    if "const" in schema:
        assert value == schema["const"], f"{path}: {value!r} != const {schema['const']!r}"
    if "enum" in schema:
        assert value in schema["enum"], f"{path}: {value!r} not in {schema['enum']}"
    types = schema.get("type")
    if types is not None:
        types = types if isinstance(types, list) else [types]
        py = {"object": dict, "array": list, "string": str, "boolean": bool, "null": type(None),
              "integer": int, "number": (int, float)}
        ok = any(isinstance(value, py[t]) and not (t in ("integer", "number") and isinstance(value, bool))
                 for t in types)
        assert ok, f"{path}: {value!r} is not of type {types}"
    if isinstance(value, dict):
        props = schema.get("properties", {})
        for key in schema.get("required", []):
            assert key in value, f"{path}: missing required key {key!r}"
        if props and schema.get("additionalProperties") is not True:
            assert set(value) <= set(props), f"{path}: unexpected keys {set(value) - set(props)}"
        for key, sub in props.items():
            if key in value:
                check_schema(value[key], sub, root, f"{path}.{key}")
    if isinstance(value, list):
        assert len(value) >= schema.get("minItems", 0), f"{path}: too few items"
        assert len(value) <= schema.get("maxItems", 10 ** 9), f"{path}: too many items"
        for i, item in enumerate(value):
            if "items" in schema:
                check_schema(item, schema["items"], root, f"{path}[{i}]")
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if "minimum" in schema:
            assert value >= schema["minimum"], f"{path}: {value} < minimum"
        if "maximum" in schema:
            assert value <= schema["maximum"], f"{path}: {value} > maximum"
        if "exclusiveMinimum" in schema:
            assert value > schema["exclusiveMinimum"], f"{path}: {value} <= exclusiveMinimum"
    if isinstance(value, str):
        assert len(value) >= schema.get("minLength", 0), f"{path}: too short"
        assert len(value) <= schema.get("maxLength", 10 ** 9), f"{path}: too long"
        if "pattern" in schema:
            assert re.search(schema["pattern"], value), f"{path}: {value!r} !~ {schema['pattern']}"


SCHEMAS = {
    "flat": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                              "age": {"type": "integer"}}, "required": ["name", "age"]},
    "nested": {"type": "object", "properties": {
        "user": {"type": "object", "properties": {"id": {"type": "integer", "minimum": 1},
                                                  "email": {"type": "string", "maxLength": 20}},
                 "required": ["id", "email"]},
        "active": {"type": "boolean"}}, "required": ["user", "active"]},
    "array_of_objects": {"type": "object", "properties": {"items": {
        "type": "array", "minItems": 1, "maxItems": 3,
        "items": {"type": "object", "properties": {"sku": {"type": "string", "maxLength": 8},
                                                   "qty": {"type": "integer", "minimum": 0, "maximum": 99}},
                  "required": ["sku", "qty"]}}}, "required": ["items"]},
    "enums": {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                               "size": {"type": "string", "enum": ["S", "M", "L"]}},
              "required": ["color", "size"]},
    "integer_bounds": {"type": "object", "properties": {"small": {"type": "integer", "minimum": -5, "maximum": 5},
                                                        "pct": {"type": "number", "minimum": 0, "maximum": 100},
                                                        "pos": {"type": "integer", "exclusiveMinimum": 0,
                                                                "maximum": 1000}},
                       "required": ["small", "pct", "pos"]},
    "nullable_anyof": {"type": "object", "properties": {"note": {"type": ["string", "null"], "maxLength": 10},
                                                        "value": {"anyOf": [{"type": "integer"},
                                                                            {"type": "boolean"}]}},
                       "required": ["note", "value"]},
    "defs_ref": {"$defs": {"point": {"type": "object", "properties": {"x": {"type": "integer"},
                                                                      "y": {"type": "integer"}},
                                     "required": ["x", "y"]}},
                 "type": "object", "properties": {"a": {"$ref": "#/$defs/point"}, "b": {"$ref": "#/$defs/point"}},
                 "required": ["a", "b"]},
    "const_pattern_array": {"type": "object", "properties": {
        "version": {"const": 2}, "code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"},
        "flags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 4}},
        "required": ["version", "code", "flags"]},
    "top_level_array": {"type": "array", "items": {"type": "string", "enum": ["x", "yy", "zzz"]},
                        "minItems": 2, "maxItems": 5},
}


def _outside_strings(text: str) -> str:
    return re.sub(r'"(?:[^"\\]|\\.)*"', '""', text)


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int] | torch.Tensor,
                  vocab_size: int | None = None) -> None:
    """Set logits[r, t] = -inf for every disallowed token t of every row r in `rows`, in place; other rows are
    untouched. bitmask row r belongs to logits row r. vocab_size (default: what the bitmask covers) is the grammar
    vocabulary: logits columns beyond it (a model vocab padded past the tokenizer's) are masked too in the
    constrained rows. The compact grammar mask widened on the host to the full-width mask that
    tokenmill.kernels.triton_bitmask applies (the model runner builds that mask its own way)."""
    rows = [int(r) for r in (rows.tolist() if isinstance(rows, torch.Tensor) else rows)]
    if not rows:
        return
    batch, width = logits.shape
    covered = min(bitmask.shape[-1] * 32 if vocab_size is None else vocab_size, width)
    words = -(-width // 32)
    full = torch.full((batch, words), -1, dtype=torch.int32)
    src = bitmask.cpu()[rows]
    full[rows] = 0
    whole, part = divmod(covered, 32)
    full[rows, :whole] = src[:, :whole]
    if part:  # the word holding the grammar's last tokens keeps only their bits
        full[rows, whole] = src[:, whole] & ((1 << part) - 1)
    triton_bitmask.apply_bitmask(logits, full.to(logits.device), np.asarray(rows, dtype=np.int64))


# ----- simulated decoding -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", list(SCHEMAS))
def test_json_schema_outputs_validate(smollm2_tokenizer, compiler, bias, name):
    schema = SCHEMAS[name]
    for seed in (0, 1):
        text = decode(smollm2_tokenizer, compiler, StructuredOutputsParams(json=schema, disable_any_whitespace=True),
                      seed=seed, bias=bias)
        check_schema(json.loads(text), schema)
        assert not re.search(r"\s", _outside_strings(text)), f"whitespace in compact JSON: {text!r}"


def test_json_schema_with_any_whitespace(smollm2_tokenizer, compiler, bias):
    schema = SCHEMAS["nested"]
    text = decode(smollm2_tokenizer, compiler, StructuredOutputsParams(json=json.dumps(schema)), seed=3, bias=bias)
    check_schema(json.loads(text), schema)


def test_regex(smollm2_tokenizer, compiler, bias):
    pattern = r"(\d{3})-([a-z]{2,5})(\.[A-Z])?"
    for seed in range(3):
        text = decode(smollm2_tokenizer, compiler, StructuredOutputsParams(regex=pattern), seed=seed, bias=bias)
        assert re.fullmatch(pattern, text), text


def test_choice(smollm2_tokenizer, compiler, bias):
    choices = ["positive", "negative", 'neu"tral', "caf\u00e9 \\ ok"]
    seen = set()
    for seed in range(8):
        text = decode(smollm2_tokenizer, compiler, StructuredOutputsParams(choice=choices), seed=seed, bias=bias)
        assert text in choices, text
        seen.add(text)
    assert len(seen) >= 2, seen
    # the empty string is a valid choice: the stop token is allowed at once
    assert decode(smollm2_tokenizer, compiler, StructuredOutputsParams(choice=["", "x"]), bias=bias) == ""


def test_ebnf_grammar(smollm2_tokenizer, compiler, bias):
    grammar = r'''
root ::= "SELECT " cols " FROM " table (" WHERE " cond)?
cols ::= col (", " col)*
col ::= "id" | "name" | "price"
table ::= [a-z]+
cond ::= col " = " [0-9]+
'''
    parse = re.compile(r"SELECT (id|name|price)(, (id|name|price))* FROM [a-z]+( WHERE (id|name|price) = [0-9]+)?")
    for seed in range(3):
        text = decode(smollm2_tokenizer, compiler, StructuredOutputsParams(grammar=grammar), seed=seed, bias=bias)
        assert parse.fullmatch(text), text


def test_lark_grammar(smollm2_tokenizer, compiler, bias):
    grammar = 'start: "yes" | "no" | NUMBER\nNUMBER: /[1-9][0-9]?/\n'
    text = decode(smollm2_tokenizer, compiler, StructuredOutputsParams(grammar=grammar), bias=bias)
    assert re.fullmatch(r"yes|no|[1-9][0-9]?", text), text


def test_json_object(smollm2_tokenizer, compiler, bias):
    for seed in range(3):
        text = decode(smollm2_tokenizer, compiler, StructuredOutputsParams(json_object=True), seed=seed, bias=bias)
        assert isinstance(json.loads(text), dict), text


@pytest.mark.parametrize("bounds", [{"maxLength": 8}, {"minLength": 1}, {"minLength": 1, "maxLength": 8}, {}])
def test_strings_never_hold_raw_control_characters(compiler, bounds):
    """JSON forbids raw U+0000-U+001F inside strings (json.loads rejects them). xgrammar's class for length-bounded
    strings let them through (a random-weight answer held a raw U+0017); every string rule must refuse them."""
    schema = {"type": "object", "properties": {"s": {"type": "string", **bounds}}, "required": ["s"]}
    for bad in ("\t", "\x17", "\x00", "\n"):
        grammar = RequestGrammar(compiler.compile_sync(StructuredOutputsParams(json=schema)))
        assert not grammar.matcher.accept_string('{"s": "a' + bad), repr(bad)
    grammar = RequestGrammar(compiler.compile_sync(StructuredOutputsParams(json=schema)))
    assert grammar.matcher.accept_string('{"s": "héllo"}')
    assert grammar.matcher.is_completed()


def test_config_disable_any_whitespace(smollm2_tokenizer, bias):
    gc = GrammarCompiler(smollm2_tokenizer, vocab_size=VOCAB, config={"disable_any_whitespace": True})
    grammar = RequestGrammar(gc.compile_sync(StructuredOutputsParams(json=SCHEMAS["flat"])))
    assert grammar.matcher.accept_string('{"name":"a","age":1}')  # compact separators
    grammar = RequestGrammar(gc.compile_sync(StructuredOutputsParams(json=SCHEMAS["flat"])))
    assert not grammar.matcher.accept_string('{"name": "a"')
    text = decode(smollm2_tokenizer, gc, StructuredOutputsParams(json_object=True), seed=5, bias=bias)
    assert isinstance(json.loads(text), dict) and not re.search(r"\s", _outside_strings(text))
    gc.shutdown()


def test_disable_additional_properties(compiler):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "additionalProperties": True}
    open_ = RequestGrammar(compiler.compile_sync(StructuredOutputsParams(json=schema, disable_any_whitespace=True)))
    assert open_.matcher.accept_string('{"a":1,"extra":2}')
    closed = RequestGrammar(compiler.compile_sync(
        StructuredOutputsParams(json=schema, disable_any_whitespace=True, disable_additional_properties=True)))
    assert closed.matcher.accept_string('{"a":1')
    assert not closed.matcher.accept_string(',"extra"')


# ----- EOS, termination, rollback ---------------------------------------------------------------------------------

def _allowed(bitmask, row=0, vocab=VOCAB):
    bits = ((bitmask[row].view(-1, 1) >> torch.arange(32, dtype=torch.int32)) & 1).flatten()[:vocab]
    return set(torch.nonzero(bits).flatten().tolist())


def test_eos_only_after_completion(smollm2_tokenizer, compiler):
    eos = smollm2_tokenizer.eos_token_id
    grammar = RequestGrammar(compiler.compile_sync(StructuredOutputsParams(regex="ab")))
    bm = allocate_bitmask(1, VOCAB)
    grammar.fill_bitmask(bm, 0)
    assert eos not in _allowed(bm)
    assert grammar.matcher.accept_string("ab") and grammar.is_completed() and not grammar.is_terminated()
    grammar.fill_bitmask(bm, 0)
    assert _allowed(bm) == {eos}
    assert grammar.accept_tokens([eos]) and grammar.is_terminated()
    grammar.fill_bitmask(bm, 0)  # terminated: stop tokens only, no exception
    assert _allowed(bm) == {eos}
    assert not grammar.accept_tokens([eos])
    grammar.rollback(1)
    assert not grammar.is_terminated() and grammar.is_completed()


def test_request_stop_tokens_override(compiler):
    grammar = RequestGrammar(compiler.compile_sync(StructuredOutputsParams(regex="ab")), stop_token_ids=[2, 0, 7])
    assert grammar.matcher.accept_string("ab")
    bm = allocate_bitmask(1, VOCAB)
    grammar.fill_bitmask(bm, 0)
    assert _allowed(bm) == {0, 2, 7}
    assert grammar.accept_tokens([7]) and grammar.is_terminated()


def test_forbidden_token_rejected_and_rollback(smollm2_tokenizer, compiler):
    grammar = RequestGrammar(compiler.compile_sync(StructuredOutputsParams(choice=["yes", "no"])))
    bad = smollm2_tokenizer.encode("maybe", add_special_tokens=False)
    assert not grammar.accept_tokens(bad[:1])
    good = smollm2_tokenizer.encode("yes", add_special_tokens=False)
    assert grammar.validate_tokens(good + bad) == len(good) and grammar.num_accepted == 0
    assert grammar.accept_tokens(good) and grammar.is_completed()
    grammar.rollback(len(good))
    assert not grammar.is_completed() and grammar.num_accepted == 0


def test_padded_model_vocab(smollm2_tokenizer):
    gc = GrammarCompiler(smollm2_tokenizer, vocab_size=VOCAB + 64)
    assert gc.vocab_size == VOCAB + 64
    grammar = RequestGrammar(gc.compile_sync(StructuredOutputsParams(json_object=True)))
    bm = allocate_bitmask(1, gc.vocab_size)
    assert bm.shape == (1, (VOCAB + 64) // 32)
    grammar.fill_bitmask(bm, 0)
    allowed = _allowed(bm, vocab=VOCAB + 64)
    assert allowed and max(allowed) < VOCAB
    logits = torch.zeros(1, VOCAB + 64)
    apply_bitmask(logits, bm, [0])
    assert torch.isinf(logits[0, VOCAB:]).all()
    gc.shutdown()


def test_logits_wider_than_grammar_vocab(compiler):
    """A model whose lm_head is wider than the tokenizer vocab the compiler was built with: the extra columns of
    constrained rows are masked, other rows are left alone."""
    grammar = RequestGrammar(compiler.compile_sync(StructuredOutputsParams(regex="[0-9]+")))
    bm = allocate_bitmask(2, VOCAB)
    grammar.fill_bitmask(bm, 1)
    logits = torch.zeros(2, VOCAB + 100)
    apply_bitmask(logits, bm, [1], vocab_size=VOCAB)
    assert torch.isinf(logits[1, VOCAB:]).all() and (logits[0] == 0).all()
    assert torch.isfinite(logits[1]).sum() == len(_allowed(bm, 1))


# ----- batch masks ------------------------------------------------------------------------------------------------

def test_batch_apply_only_constrained_rows(compiler):
    g1 = RequestGrammar(compiler.compile_sync(StructuredOutputsParams(json=SCHEMAS["flat"])))
    g3 = RequestGrammar(compiler.compile_sync(StructuredOutputsParams(regex=r"[a-c]+")))
    bm = allocate_bitmask(8, VOCAB)
    fill_bitmasks([g1, g3], bm, [1, 3])
    logits = torch.randn(4, VOCAB)
    before = logits.clone()
    apply_bitmask(logits, bm, [1, 3])
    assert torch.equal(logits[0], before[0]) and torch.equal(logits[2], before[2])
    for row in (1, 3):
        allowed = _allowed(bm, row)
        finite = set(torch.nonzero(torch.isfinite(logits[row])).flatten().tolist())
        assert finite == allowed and 0 < len(allowed) < VOCAB
        assert torch.equal(logits[row, sorted(allowed)], before[row, sorted(allowed)])
    apply_bitmask(logits, bm, torch.tensor([3]))  # rows as a tensor, idempotent
    assert torch.equal(logits[0], before[0])
    apply_bitmask(logits, bm, [])  # no constrained rows: no work, no change


@pytest.mark.parametrize("threaded", [False, True])
def test_fill_bitmasks_matches_per_row(compiler, monkeypatch, threaded):
    import tokenmill.structured.backend_xgrammar as bx
    monkeypatch.setattr(bx, "_BATCH_FILL_THREADS", 4 if threaded else 1)
    params = [StructuredOutputsParams(json=SCHEMAS[n]) for n in ("flat", "enums", "nested", "defs_ref")]
    params += [StructuredOutputsParams(regex=r"\d+"), StructuredOutputsParams(choice=["a", "b"]),
               StructuredOutputsParams(json_object=True), StructuredOutputsParams(regex="[xyz]{2,4}"),
               StructuredOutputsParams(json=SCHEMAS["flat"])]
    grammars = [RequestGrammar(compiler.compile_sync(p)) for p in params]
    grammars[0].matcher.accept_string('{"name": "Bo')
    grammars[1].matcher.accept_string('{"color": ')
    grammars[5].matcher.accept_string("a")
    grammars[5].accept_tokens([2])  # terminated: its row must allow only the stop token
    grammars[8].matcher.accept_string('{"name": "x", "age": 1')
    rows = [9, 0, 2, 5, 3, 11, 1, 7, 4]
    batch, single = allocate_bitmask(12, VOCAB), allocate_bitmask(12, VOCAB)
    batch.zero_()
    fill_bitmasks(grammars, batch, rows)
    for g, r in zip(grammars, rows):
        g.fill_bitmask(single, r)
    assert torch.equal(batch[rows], single[rows])
    assert _allowed(batch, 11) == {2}
    assert (batch[[6, 8, 10]] == 0).all()  # rows not listed are not written


def test_bfloat16_logits(compiler):
    grammar = RequestGrammar(compiler.compile_sync(StructuredOutputsParams(regex="x")))
    bm = allocate_bitmask(2, VOCAB)
    grammar.fill_bitmask(bm, 0)
    logits = torch.randn(2, VOCAB, dtype=torch.bfloat16)
    apply_bitmask(logits, bm, [0])
    assert torch.isfinite(logits[0]).sum() == len(_allowed(bm)) and torch.isfinite(logits[1]).all()


# ----- compilation cache and errors -------------------------------------------------------------------------------

def test_cache_reuses_compilation(smollm2_tokenizer):
    gc = GrammarCompiler(smollm2_tokenizer, vocab_size=VOCAB)
    schema = SCHEMAS["nested"]
    f1 = gc.submit(StructuredOutputsParams(json=schema))
    f2 = gc.submit(StructuredOutputsParams(json=json.loads(json.dumps(schema))))
    f3 = gc.submit(StructuredOutputsParams(json=json.dumps(schema), disable_fallback=True))
    assert f1 is f2 is f3 and gc.num_compiles == 1
    assert gc.compile_sync(StructuredOutputsParams(json=schema)) is f1.result()
    gc.submit(StructuredOutputsParams(json=schema, disable_any_whitespace=True))
    assert gc.num_compiles == 2
    small = GrammarCompiler(gc.tokenizer_info, cache_size=2)
    for r in ("a", "b", "c", "a"):
        small.compile_sync(StructuredOutputsParams(regex=r))
    assert small.num_compiles == 4  # "a" was evicted by "c"
    gc.shutdown()
    small.shutdown()


BAD = [
    (dict(json={"type": "foo"}), "Unsupported type"),
    (dict(json='{"type": '), "not valid JSON"),
    (dict(json={"$ref": "#/$defs/missing"}), "$defs"),
    (dict(json={"type": "integer", "minimum": 5, "maximum": 1}), "minimum greater than maximum"),
    (dict(json={"type": "object", "properties": {"a": {"not": {"type": "string"}}}}),
     "'not' (at #/properties/a/not)"),
    (dict(json={"type": "array", "uniqueItems": True}), "uniqueItems"),
    (dict(json={"allOf": [{"type": "integer"}, {"minimum": 2}]}), "allOf"),
    (dict(json={"type": "object"}, whitespace_pattern=r"[ ]?"), "whitespace_pattern"),
    (dict(regex="a(b"), "parenthesis is not closed"),
    (dict(regex="a(?=b)"), "Lookahead"),
    (dict(grammar='root ::= foo'), 'Rule "foo" is not defined'),
    (dict(grammar='root ::= "a" | '), "EBNF parser error"),
    (dict(grammar='start ::= "a"'), 'root rule with name "root" is not found'),
    (dict(structural_tag='{"structures": [{"begin": "<a>"}], "triggers": ["<a"]}'), "end"),
    (dict(structural_tag='{"type": "structural_tag"}'), "format"),
]


@pytest.mark.parametrize("kwargs,needle", BAD, ids=[str(i) for i in range(len(BAD))])
def test_invalid_specs_raise_value_error(compiler, kwargs, needle):
    params = StructuredOutputsParams(**kwargs)
    with pytest.raises(ValueError, match=re.escape(needle)) as err:
        compiler.validate(params)
    assert "/project/cpp" not in str(err.value) and "Check failed" not in str(err.value)
    with pytest.raises(ValueError, match=re.escape(needle)):
        validate_structured_outputs(params)
    assert isinstance(compiler.submit(params).exception(timeout=30), ValueError)
    with pytest.raises(ValueError, match=re.escape(needle)):
        compiler.compile_sync(params)


def test_valid_specs_validate(compiler):
    for p in [StructuredOutputsParams(json=s) for s in SCHEMAS.values()] + [
            StructuredOutputsParams(regex=r"\w+@\w+\.com"), StructuredOutputsParams(choice=["a"]),
            StructuredOutputsParams(json_object=True), StructuredOutputsParams(grammar='root ::= "x"'),
            StructuredOutputsParams(grammar='start: "x"')]:
        compiler.validate(p)
        validate_structured_outputs(p)


def test_structural_tag(compiler):
    legacy = {"type": "structural_tag",
              "structures": [{"begin": "<function=get_weather>", "end": "</function>",
                              "schema": {"type": "object", "properties": {"city": {"type": "string"}},
                                         "required": ["city"]}}],
              "triggers": ["<function="]}
    params = from_response_format(legacy)
    compiler.validate(params)
    grammar = RequestGrammar(compiler.compile_sync(params))
    assert grammar.matcher.accept_string('Let me check. <function=get_weather>{"city": "Paris"}</function>')
    grammar = RequestGrammar(compiler.compile_sync(params))
    assert not grammar.matcher.accept_string('<function=get_weather>{"town": 1}')
    new = {"type": "structural_tag", "format": {"type": "const_string", "value": "hello"}}
    grammar = RequestGrammar(compiler.compile_sync(StructuredOutputsParams(structural_tag=json.dumps(new))))
    assert grammar.matcher.accept_string("hello") and grammar.is_completed()


def test_structural_tag_json_strings_never_hold_raw_control_characters(compiler):
    """The JSON inside a structural tag is as strict as a json schema's (length-bounded strings included)."""
    tag = {"type": "structural_tag", "format": {
        "type": "triggered_tags", "triggers": ["<tool>"],
        "tags": [{"begin": "<tool>", "end": "</tool>", "content": {"type": "json_schema", "json_schema": {
            "type": "object", "properties": {"a": {"type": "string", "maxLength": 5}}, "required": ["a"]}}}]}}
    params = StructuredOutputsParams(structural_tag=json.dumps(tag))
    compiler.validate(params)
    for bad in ("\t", "\x17"):
        grammar = RequestGrammar(compiler.compile_sync(params))
        assert not grammar.matcher.accept_string('x <tool>{"a": "b' + bad), repr(bad)
    grammar = RequestGrammar(compiler.compile_sync(params))
    assert grammar.matcher.accept_string('x <tool>{"a": "héllo"}</tool> y')


# ----- params, response_format, config ------------------------------------------------------------------------------

def test_params_exactly_one_constraint():
    with pytest.raises(ValueError, match="exactly one of json, regex, choice, grammar, json_object, "
                                         "structural_tag; got none"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match="got json and regex"):
        StructuredOutputsParams(json={"type": "object"}, regex="a")
    with pytest.raises(ValueError, match="got none"):
        StructuredOutputsParams(json_object=False)
    with pytest.raises(ValueError, match="choice must be a non-empty list"):
        StructuredOutputsParams(choice=[])
    with pytest.raises(ValueError, match="choice must be a list of strings"):
        StructuredOutputsParams(choice=["a", 1])
    with pytest.raises(ValueError, match="regex must be a non-empty string"):
        StructuredOutputsParams(regex="")
    assert StructuredOutputsParams(choice=("a", "b")).choice == ["a", "b"]
    assert StructuredOutputsParams(json=True).json == {}
    assert StructuredOutputsParams(json_object=True).kind == "json_object"


def test_params_msgspec_round_trip():
    class Carrier(msgspec.Struct, kw_only=True, omit_defaults=True):
        structured_outputs: StructuredOutputsParams | None = None

    cases = [StructuredOutputsParams(json=SCHEMAS["defs_ref"], disable_any_whitespace=True),
             StructuredOutputsParams(json=json.dumps(SCHEMAS["flat"])),
             StructuredOutputsParams(regex=r"\d+", disable_fallback=True),
             StructuredOutputsParams(choice=["a", "b"]), StructuredOutputsParams(grammar='root ::= "x"'),
             StructuredOutputsParams(json_object=True, disable_additional_properties=True),
             StructuredOutputsParams(structural_tag='{"format": {"type": "const_string", "value": "x"}}')]
    for p in cases:
        back = msgspec.msgpack.decode(msgspec.msgpack.encode(p), type=StructuredOutputsParams)
        assert back == p and back.key() == p.key()
        carried = msgspec.msgpack.decode(msgspec.msgpack.encode(Carrier(structured_outputs=p)), type=Carrier)
        assert carried.structured_outputs == p
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(Carrier()), type=Carrier).structured_outputs is None
    with pytest.raises((msgspec.ValidationError, ValueError)):
        msgspec.msgpack.decode(msgspec.msgpack.encode({"regex": "a", "choice": ["b"]}), type=StructuredOutputsParams)


def test_params_key():
    a = StructuredOutputsParams(json={"type": "object", "properties": {"a": {}, "b": {}}})
    b = StructuredOutputsParams(json='{"type": "object", "properties": {"a": {}, "b": {}}}')
    c = StructuredOutputsParams(json={"type": "object", "properties": {"b": {}, "a": {}}})
    assert a.key() == b.key() and a.key() != c.key()  # property order shapes the output, so it is in the key
    assert a.key() != StructuredOutputsParams(json=a.json, disable_any_whitespace=True).key()
    assert StructuredOutputsParams(regex="a").key() != StructuredOutputsParams(grammar="a").key()
    assert StructuredOutputsParams(choice=["a", "b"]).key() != StructuredOutputsParams(choice=["ab"]).key()


def test_from_response_format():
    assert from_response_format(None) is None
    assert from_response_format({"type": "text"}) is None
    assert from_response_format({"type": "json_object"}) == StructuredOutputsParams(json_object=True)
    schema = SCHEMAS["flat"]
    p = from_response_format({"type": "json_schema", "json_schema": {"name": "person", "schema": schema,
                                                                     "strict": True}})
    assert p == StructuredOutputsParams(json=schema)
    p = from_response_format({"type": "json_schema", "json_schema": {"name": "p", "schema": json.dumps(schema)}})
    assert p.json == schema
    assert from_response_format({"type": "structural_tag", "format": {"type": "const_string", "value": "x"}}).kind \
        == "structural_tag"
    bad = [({"type": "xml"}, "response_format.type must be one of text, json_object, json_schema"),
           ({}, "response_format.type"),
           ("json", "response_format must be an object"),
           ({"type": "json_schema"}, "response_format.json_schema must be an object"),
           ({"type": "json_schema", "json_schema": {"schema": schema}}, "response_format.json_schema.name"),
           ({"type": "json_schema", "json_schema": {"name": "x"}}, "response_format.json_schema.schema is required"),
           ({"type": "json_schema", "json_schema": {"name": "x", "schema": "{oops"}}, "not valid JSON"),
           ({"type": "json_schema", "json_schema": {"name": "x", "schema": [1]}}, "must be a JSON schema object"),
           ({"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": "yes"}},
            "response_format.json_schema.strict")]
    for rf, needle in bad:
        with pytest.raises(ValueError, match=re.escape(needle)):
            from_response_format(rf)


def test_config():
    assert StructuredOutputsConfig.from_dict(None) == StructuredOutputsConfig()
    cfg = StructuredOutputsConfig.from_dict({"backend": "xgrammar", "disable-any-whitespace": True,
                                             "disable_additional_properties": True, "reasoning_parser": "qwen3"})
    assert cfg.backend == "xgrammar" and cfg.disable_any_whitespace and cfg.disable_additional_properties
    assert StructuredOutputsConfig.from_dict('{"backend": "auto"}').backend == "auto"
    for backend in ("guidance", "outlines", "lm-format-enforcer"):
        with pytest.raises(ValueError, match="not supported yet"):
            StructuredOutputsConfig.from_dict({"backend": backend})
    with pytest.raises(ValueError, match="unknown structured outputs backend"):
        StructuredOutputsConfig(backend="magic")
    with pytest.raises(ValueError, match="allowed keys: backend, disable_fallback, disable_any_whitespace"):
        StructuredOutputsConfig.from_dict({"backnd": "auto"})
    with pytest.raises(ValueError, match="true or false"):
        StructuredOutputsConfig.from_dict({"disable_any_whitespace": "yes"})


def test_structural_tag_naming_tokens(compiler):
    tag = {"type": "structural_tag", "format": {"type": "tag", "begin": {"type": "token", "token": "<|im_start|>"},
                                                "content": {"type": "const_string", "value": "ok"}, "end": "."}}
    params = StructuredOutputsParams(structural_tag=json.dumps(tag))
    validate_structured_outputs(params)  # cannot resolve tokens without a vocabulary: left to the compiler
    compiler.validate(params)
    bad = dict(tag, format=dict(tag["format"], begin={"type": "token", "token": "<|no_such_token|>"}))
    with pytest.raises(ValueError, match="structural tag"):
        compiler.validate(StructuredOutputsParams(structural_tag=json.dumps(bad)))
