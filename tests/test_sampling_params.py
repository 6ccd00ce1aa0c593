"""SamplingParams validation: every bad value is a ValueError naming the field."""
import math

import pytest

from tokenmill import SamplingParams


@pytest.mark.parametrize("kw,field", [
    (dict(temperature="a"), "temperature"), (dict(top_p=None), "top_p"), (dict(presence_penalty=None),
                                                                         "presence_penalty"),
    (dict(temperature=math.inf), "temperature"), (dict(stop=5), "stop"), (dict(stop_token_ids=5), "stop_token_ids"),
    (dict(logit_bias={1: math.nan}), "logit_bias"), (dict(n=0), "n"), (dict(max_tokens=0), "max_tokens"),
    (dict(top_p=0), "top_p"), (dict(min_tokens=5, max_tokens=2), "min_tokens"), (dict(logprobs=-2), "logprobs"),
    (dict(top_k=-3), "top_k"), (dict(repetition_penalty=0), "repetition_penalty"),
])
def test_bad_values_name_the_field(kw, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kw)


def test_normalisation():
    assert SamplingParams(bad_words="hello").bad_words == ["hello"]
    assert SamplingParams(stop="x").stop == ["x"]
    p = SamplingParams(temperature=0, top_p=0.5, top_k=5)
    assert (p.top_p, p.top_k) == (1.0, 0)  # greedy ignores the filters


def test_guided_decoding_is_vllms_older_spelling_of_structured_outputs():
    """`from vllm.sampling_params import GuidedDecodingParams` scripts: the value lands in structured_outputs (as
    the plain StructuredOutputsParams the engine expects), guided_decoding is cleared, and the params survive the
    msgpack trip to the engine core unchanged."""
    import msgspec

    from tokenmill.sampling_params import GuidedDecodingParams, StructuredOutputsParams
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    for given in (GuidedDecodingParams(json=schema, backend="xgrammar"), {"json": schema, "backend": "auto"},
                  GuidedDecodingParams.from_optional(json=schema)):
        p = SamplingParams(guided_decoding=given, temperature=0)
        assert type(p.structured_outputs) is StructuredOutputsParams and p.structured_outputs.json == schema
        assert p.guided_decoding is None
        back = msgspec.msgpack.decode(msgspec.msgpack.encode(p), type=SamplingParams)
        assert back.structured_outputs == p.structured_outputs and back.guided_decoding is None
    assert GuidedDecodingParams.from_optional() is None
    choice = SamplingParams(guided_decoding=GuidedDecodingParams(choice=["x", "y"])).structured_outputs
    assert choice.kind == "choice" and choice.choice == ["x", "y"]
    with pytest.raises(ValueError, match="guided_decoding and SamplingParams.structured_outputs"):
        SamplingParams(guided_decoding=GuidedDecodingParams(regex="a"),
                       structured_outputs=StructuredOutputsParams(regex="b"))
    with pytest.raises(ValueError, match="backend 'outlines'"):
        GuidedDecodingParams(regex="a", backend="outlines")
    with pytest.raises(ValueError, match="exactly one"):
        GuidedDecodingParams(regex="a", choice=["b"])
    with pytest.raises(ValueError, match="guided_decoding"):
        SamplingParams(guided_decoding={"regexp": "a"})
    with pytest.raises(ValueError, match="guided_decoding"):
        SamplingParams(guided_decoding="a+")


def test_best_of_is_at_least_n_and_survives_the_engine_trip():
    import msgspec
    assert SamplingParams(n=2, best_of=5).best_of == 5
    for bad in (1, 0, 1.5, True):
        with pytest.raises(ValueError, match="best_of"):
            SamplingParams(n=2, best_of=bad)
    p = msgspec.msgpack.decode(msgspec.msgpack.encode(SamplingParams(n=2, best_of=2)), type=SamplingParams)
    assert (p.n, p.best_of) == (2, 2)


def test_n_and_best_of_are_capped_by_vllm_max_n_sequences():
    """As vLLM's VLLM_MAX_N_SEQUENCES (default 16384): n=10**12 used to tie up the API server building sequences."""
    from tokenmill import envs
    assert SamplingParams(n=16384).n == 16384
    for kw in (dict(n=16385), dict(n=10 ** 12), dict(best_of=16385)):
        with pytest.raises(ValueError, match=f"{next(iter(kw))} must be at most 16384 .VLLM_MAX_N_SEQUENCES"):
            SamplingParams(**kw)
    with envs.override(VLLM_MAX_N_SEQUENCES=4):
        assert SamplingParams(n=2, best_of=4).best_of == 4
        with pytest.raises(ValueError, match="at most 4"):
            SamplingParams(n=5)


def test_vllm_normalisation_of_seed_stop_ids_and_bad_words():
    """vLLM: seed -1 means unseeded; duplicate stop ids / bad words are dropped; an empty bad word is an error."""
    from tokenmill.sampling_params import SamplingType
    p = SamplingParams(seed=-1, temperature=1.0)
    assert p.seed is None and p.sampling_type == SamplingType.RANDOM
    assert SamplingParams(stop_token_ids=[3, 1, 3]).stop_token_ids == [3, 1]
    assert SamplingParams(bad_words=["a", "b", "a"]).bad_words == ["a", "b"]
    for bad in ([""], ["ok", "  "], [5]):
        with pytest.raises(ValueError, match="bad_words"):
            SamplingParams(bad_words=bad)


@pytest.mark.parametrize("field", ["ignore_eos", "include_stop_str_in_output", "detokenize", "skip_special_tokens",
                                   "spaces_between_special_tokens"])
def test_flags_must_be_booleans(field):
    """A string such as "false" would read as true: refused, naming the field; 0 / 1 pass."""
    for bad in ("false", None, 2, [True]):
        with pytest.raises(ValueError, match=field):
            SamplingParams(**{field: bad})
    assert getattr(SamplingParams(**{field: 0}), field) == 0


def test_output_kind_error_names_the_field():
    from tokenmill.sampling_params import RequestOutputKind
    assert SamplingParams(output_kind=1).output_kind is RequestOutputKind.DELTA
    with pytest.raises(ValueError, match="output_kind"):
        SamplingParams(output_kind=7)


def test_tiny_positive_temperature_is_raised_to_vllms_floor(tm_log):
    """vLLM raises 0 < temperature < 0.01 to 0.01 (with a warning) before deciding greedy vs sampled: 1e-6 samples
    at 0.01, 0 stays greedy."""
    from tokenmill.sampling_params import SamplingType
    for t in (1e-6, 0.005):
        p = SamplingParams(temperature=t)
        assert p.temperature == 0.01 and p.sampling_type == SamplingType.RANDOM
    assert "raised to 0.01" in tm_log.text
    assert SamplingParams(temperature=0).sampling_type == SamplingType.GREEDY
    assert SamplingParams(temperature=0.5).temperature == 0.5


@pytest.mark.parametrize("kw,field", [
    (dict(max_tokens=True), "max_tokens"), (dict(seed=True), "seed"), (dict(truncate_prompt_tokens=True),
                                                                        "truncate_prompt_tokens"),
    (dict(stop_token_ids=[True]), "stop_token_ids"), (dict(allowed_token_ids=[5, False]), "allowed_token_ids"),
])
def test_a_bool_is_not_a_count_or_a_token_id(kw, field):
    """True is an int to Python: as max_tokens, a seed or a token id it would silently mean 1 (or id 0 / 1)."""
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kw)
    assert SamplingParams(logprobs=True).logprobs == 1  # the one flag-like count, as the OpenAI API has it
