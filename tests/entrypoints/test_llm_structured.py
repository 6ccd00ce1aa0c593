"""Structured outputs end to end with the embedded SmolLM2 (offline): every answer fits its constraint."""
from __future__ import annotations

import json
import re

import pytest

from tokenmill import LLM, SamplingParams
from tokenmill.structured import StructuredOutputsParams

SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 0,
                                                                         "maximum": 120}},
     "required": ["name", "age"]},
    {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
                                      "visits": {"type": "array", "items": {"type": "integer"}, "maxItems": 3}},
     "required": ["city", "visits"]},
    {"type": "object", "properties": {"ok": {"type": "boolean"}, "score": {"type": "number"},
                                      "inner": {"type": "object", "properties": {"k": {"type": "string"}},
                                                "required": ["k"]}},
     "required": ["ok", "inner"]},
]


_TYPES = {"string": str, "integer": int, "number": (int, float), "boolean": bool, "array": list, "object": dict}


def check(schema, value):
    """The subset of JSON-schema validation these schemas use."""
    assert isinstance(value, dict)
    for key in schema.get("required", []):
        assert key in value
    for key, sub in schema["properties"].items():
        if key not in value:
            continue
        v = value[key]
        assert isinstance(v, _TYPES[sub["type"]]), (key, v)
        if "enum" in sub:
            assert v in sub["enum"]
        if "minimum" in sub:
            assert sub["minimum"] <= v <= sub["maximum"]
        if sub["type"] == "object":
            check(sub, v)


@pytest.fixture(scope="module")
def llm():
    return LLM(max_model_len=1024)


def test_json_regex_choice_always_fit(llm):
    prompts, params = [], []
    for i, schema in enumerate(SCHEMAS):
        for seed in range(2):
            prompts.append(f"Answer with JSON (case {i}).")
            params.append(SamplingParams(temperature=0.8, seed=seed, max_tokens=200,
                                         structured_outputs=StructuredOutputsParams(json=schema)))
    prompts += ["Give me a ticket code:", "Which city is the capital of Italy?", "Hi!"]
    params += [SamplingParams(temperature=0.8, seed=3, max_tokens=20,
                              structured_outputs=StructuredOutputsParams(regex=r"[A-Z]{3}-[0-9]{4}")),
               SamplingParams(temperature=0, max_tokens=10,
                              structured_outputs=StructuredOutputsParams(choice=["Paris", "Rome", "Oslo"])),
               SamplingParams(temperature=0, max_tokens=8)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    for k, o in enumerate(outs[:6]):
        c = o.outputs[0]
        assert c.finish_reason == "stop", c.text
        check(SCHEMAS[k // 2], json.loads(c.text))
    assert re.fullmatch(r"[A-Z]{3}-[0-9]{4}", outs[6].outputs[0].text)
    assert outs[7].outputs[0].text == "Rome"
    free = llm.generate("Hi!", SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)[0].outputs[0]
    assert outs[8].outputs[0].token_ids == free.token_ids  # unconstrained neighbours are untouched
    sched = llm.llm_engine.engine_core.scheduler
    assert sched.kv.num_free_blocks() == sched.kv.num_blocks


def test_bad_constraints_raise(llm):
    with pytest.raises(ValueError):
        llm.generate("x", SamplingParams(structured_outputs=StructuredOutputsParams(regex="[unclosed")),
                     use_tqdm=False)
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams(regex="a", choice=["b"])
    assert llm.generate("ok", SamplingParams(max_tokens=2), use_tqdm=False)[0].finished


def test_grammar_starts_after_reasoning_end_token(tiny_model_factory):
    """With a reasoning model the grammar applies only after the end-of-reasoning token: the tokens before it are
    the model's own (unconstrained) choice, and what follows it matches the constraint."""
    llm = LLM(tiny_model_factory("llama"), max_model_len=256, num_gpu_blocks_override=64)
    free = llm.generate("Hello", SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0].token_ids
    trigger = free[2]  # stands in for `</think>`: the greedy model emits it as its third token
    sp = SamplingParams(temperature=0, max_tokens=30, structured_outputs=StructuredOutputsParams(regex=r"[0-9]{3}"))
    sp._grammar_after_token_id = trigger
    out = llm.generate("Hello", sp, use_tqdm=False)[0].outputs[0]
    cut = out.token_ids.index(trigger) + 1
    assert out.token_ids[:cut] == free[:cut]
    tok = llm.get_tokenizer()
    assert re.fullmatch(r"[0-9]{3}", tok.decode(out.token_ids[cut:], skip_special_tokens=True))
    assert out.finish_reason == "stop"


def test_structured_outputs_config_applies_offline(llm):
    """LLM(structured_outputs_config=...) is vLLM's engine-wide option: disable_any_whitespace makes every JSON
    answer compact; a bad key fails at construction, naming it."""
    compact = LLM.__new__(LLM)  # the same engine, another engine-wide option set (loading twice is slow)
    compact.__dict__.update(llm.__dict__)
    from tokenmill.structured.config import StructuredOutputsConfig
    compact.structured_outputs_config = StructuredOutputsConfig.from_dict({"disable_any_whitespace": True})
    sp = [SamplingParams(temperature=0.8, seed=s, max_tokens=120,
                         structured_outputs=StructuredOutputsParams(json=SCHEMAS[s % 3])) for s in range(4)]
    for o in compact.generate(["Describe it as JSON."] * 4, sp, use_tqdm=False):
        text = o.outputs[0].text
        assert o.outputs[0].finish_reason == "stop", text
        assert json.dumps(json.loads(text), separators=(",", ":"), ensure_ascii=False) == text
    assert sp[0].structured_outputs.disable_any_whitespace is False  # the caller's params are not changed
    with pytest.raises(ValueError, match="disable_any_whitespac"):
        LLM(structured_outputs_config={"disable_any_whitespac": True})
    with pytest.raises(ValueError, match="reasoning_parser: not supported yet"):
        LLM(structured_outputs_config={"reasoning_parser": "qwen3"})


def test_guided_decoding_spelling_matches_structured_outputs(llm):
    """vLLM's older `SamplingParams(guided_decoding=GuidedDecodingParams(...))` constrains exactly as
    structured_outputs does: the same greedy tokens for every constraint kind."""
    from tokenmill.sampling_params import GuidedDecodingParams
    specs = [dict(choice=["Paris", "Rome", "Oslo"]), dict(regex=r"[A-Z]{2}-[0-9]{3}"), dict(json=SCHEMAS[0]),
             dict(grammar='root ::= "yes" | "no"')]
    prompts = ["Which city is the capital of Italy?", "A ticket code:", "Describe a person as JSON.", "Yes or no?"]
    new = [SamplingParams(temperature=0, max_tokens=60, structured_outputs=StructuredOutputsParams(**s)) for s in specs]
    old = [SamplingParams(temperature=0, max_tokens=60, guided_decoding=GuidedDecodingParams(backend="xgrammar", **s))
           for s in specs]
    a = llm.generate(prompts, new, use_tqdm=False)
    b = llm.generate(prompts, old, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in b] == [o.outputs[0].token_ids for o in a]
    assert b[0].outputs[0].text == "Rome" and re.fullmatch(r"[A-Z]{2}-[0-9]{3}", b[1].outputs[0].text)
