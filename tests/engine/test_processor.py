"""Prompt and request validation in the Processor (no model)."""
from types import SimpleNamespace

import pytest

from tokenmill.engine.processor import Processor
from tokenmill.sampling_params import SamplingParams


@pytest.fixture()
def processor():
    cfg = SimpleNamespace(model_config=SimpleNamespace(max_model_len=64, max_logprobs=5, vocab_size=100),
                          cache_config=SimpleNamespace(block_size=4),
                          scheduler_config=SimpleNamespace(scheduling_policy="fcfs"))
    return Processor(cfg, tokenizer=None, eos_token_ids=[2])


def test_cache_salt_reaches_every_request(processor):
    _, reqs = processor.process("r", {"prompt_token_ids": [5, 6, 7], "cache_salt": "tenant"},
                                SamplingParams(n=2, max_tokens=3))
    assert [r.cache_salt for r in reqs] == ["tenant", "tenant"]
    _, reqs = processor.process("r", {"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=3))
    assert reqs[0].cache_salt is None


@pytest.mark.parametrize("salt", ["", 3, ["a"]])
def test_bad_cache_salt_is_rejected(processor, salt):
    with pytest.raises(ValueError, match="cache_salt must be a non-empty string"):
        processor.process("r", {"prompt_token_ids": [5], "cache_salt": salt}, SamplingParams())


def test_unknown_prompt_keys_are_rejected_not_ignored(processor):
    with pytest.raises(ValueError, match=r"\['multi_modal_data'\].*text-only"):
        processor.process("r", {"prompt_token_ids": [5], "multi_modal_data": {"image": None}}, SamplingParams())
    with pytest.raises(ValueError, match=r"\['promt'\]"):
        processor.process("r", {"promt": "typo", "prompt_token_ids": [5]}, SamplingParams())


def test_children_of_n_survive_the_trip_to_the_engine_core(processor):
    """n=2 with best_of=2: each child is one sample, so best_of must go with n; a child that kept best_of=2 beside
    n=1 failed SamplingParams' check when the core decoded it, and that killed the core process."""
    import msgspec

    from tokenmill.core.messages import EngineCoreRequest
    _, reqs = processor.process("r", {"prompt_token_ids": [5, 6]}, SamplingParams(n=2, best_of=2, max_tokens=3))
    decoder = msgspec.msgpack.Decoder(EngineCoreRequest)
    for req in reqs:
        back = decoder.decode(msgspec.msgpack.encode(req))
        assert (back.sampling_params.n, back.sampling_params.best_of) == (1, None)
    # best_of > n is the entry points' job (LLM, the server): the engine says so instead of ignoring it
    with pytest.raises(ValueError, match="best_of"):
        processor.process("r", {"prompt_token_ids": [5]}, SamplingParams(n=1, best_of=3))


def test_prompt_token_ids_of_numpy_or_torch_integers_are_accepted(processor):
    import numpy as np
    import torch
    for given in (np.array([5, 6, 7]), torch.tensor([5, 6, 7]), (5, 6, 7), [np.int64(5), 6, np.int32(7)]):
        _, [req] = processor.process("r", {"prompt_token_ids": given}, SamplingParams(max_tokens=2))
        assert req.prompt_token_ids == [5, 6, 7] and all(type(t) is int for t in req.prompt_token_ids)


@pytest.mark.parametrize("ids,match", [
    ("abc", "prompt_token_ids must be a list of integer token ids, got str"),
    (5, "prompt_token_ids must be a list of integer token ids, got int"),
    ([5, 1.0], r"prompt_token_ids\[1\] must be an integer token id, got 1.0 \(float\)"),
    ([True], r"prompt_token_ids\[0\] must be an integer token id, got True \(bool\)"),
    ([[5, 6]], r"prompt_token_ids\[0\] must be an integer token id"),
    ([5, 100], r"Token id 100 is out of vocabulary \(valid ids are 0..99\)"),
])
def test_bad_prompt_token_ids_say_what_is_wrong(processor, ids, match):
    """A wrong type is not reported as an id "out of vocabulary"."""
    with pytest.raises(ValueError, match=match):
        processor.process("r", {"prompt_token_ids": ids}, SamplingParams())


def test_request_id_must_be_a_string(processor):
    """vLLM refuses other ids: an int id would miss abort("5") and fail the msgpack trip to a core process."""
    with pytest.raises(TypeError, match="request_id must be a string, got int"):
        processor.process(5, {"prompt_token_ids": [5]}, SamplingParams())


@pytest.mark.parametrize("priority", ["1", 1.5, None, True])
def test_priority_must_be_an_integer(processor, priority):
    """The priority scheduler orders requests by it: a string beside an int broke its heap mid-run."""
    with pytest.raises(ValueError, match="priority must be an integer"):
        processor.process("r", {"prompt_token_ids": [5]}, SamplingParams(), priority=priority)


def test_whole_vocabulary_logprobs_say_how_to_allow_them(processor):
    """logprobs=-1 (vLLM: the whole vocabulary) beyond max_logprobs: the message says what -1 asked for and how
    to allow it."""
    for name in ("logprobs", "prompt_logprobs"):
        with pytest.raises(ValueError, match=rf"{name}=-1 \(the whole vocabulary, 100 tokens\) but at most 5 .*"
                                             r"max_logprobs=-1 allows any number"):
            processor.process("r", {"prompt_token_ids": [5]}, SamplingParams(**{name: -1}))
