"""Speculation under the scheduler's other mechanisms: preemption, chunked prefill, prefix caching, LoRA, and the
sampling settings that are verified one token at a time (no drafts). Greedy tokens equal the plain engine's."""
from __future__ import annotations

import pytest

from tests.spec_decode.conftest import cycle_prompt, make_llm
from tests.spec_decode.test_greedy_exact import NGRAM, generate, ids, spec_counts
from tokenmill.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=40)


def _same_with_drafts(path, prompts, params=GREEDY, **kw):
    """The spec engine's outputs equal the plain engine's, with drafts accepted; returns the spec engine."""
    want = ids(generate(make_llm(path, **kw), params, prompts))
    spec = make_llm(path, NGRAM, **kw)
    assert ids(generate(spec, params, prompts)) == want
    drafts, accepted = spec_counts(spec)
    assert drafts > 0 and accepted > 0, (drafts, accepted)
    return spec


def test_preemption(cycle_model):
    # 8 requests of 64 tokens each need 32 blocks of 16; 14 blocks force preemptions (recompute) mid-run.
    prompts = [cycle_prompt(7 * (100 + i), 24) for i in range(8)]
    spec = _same_with_drafts(cycle_model, prompts, num_gpu_blocks_override=14, max_model_len=128)
    assert spec.llm_engine.engine_core.scheduler._num_preemptions > 0


def test_chunked_prefill(cycle_model):
    # A 16-token budget splits the 70-token prompts into chunks while the short ones decode with drafts, whose
    # count the remaining budget also cuts.
    prompts = [cycle_prompt(700, 8), list(range(300, 370)), cycle_prompt(1400, 70), cycle_prompt(2100, 5)]
    _same_with_drafts(cycle_model, prompts, max_num_batched_tokens=16, long_prefill_token_threshold=0)


def test_prefix_cache_holds_only_verified_tokens(cycle_model):
    # A second request whose prompt is the first's prompt plus its output reuses the blocks the first one filled
    # during speculation: a block that had kept a rejected draft's KV would change its continuation.
    first = [cycle_prompt(700, 10), list(range(40, 70))]
    kw = dict(enable_prefix_caching=True)
    plain, spec = make_llm(cycle_model, **kw), make_llm(cycle_model, NGRAM, **kw)
    outs = ids(generate(plain, GREEDY, first))
    assert ids(generate(spec, GREEDY, first)) == outs
    second = [p + o[:33] for p, o in zip(first, outs)]
    params = SamplingParams(temperature=0, max_tokens=20)
    assert ids(generate(spec, params, second)) == ids(generate(make_llm(cycle_model), params, second))
    assert spec.llm_engine.engine_core.scheduler.kv.prefix_hits > 0


def test_lora(cycle_model, tmp_path):
    from tests.lora.conftest import make_adapter
    from tokenmill.lora.request import LoRARequest
    adapter = make_adapter(cycle_model, str(tmp_path / "qv"), seed=3, r=4, lora_alpha=8,
                           target_modules=["q_proj", "v_proj"])
    kw = dict(enable_lora=True, max_lora_rank=8)
    prompts = [cycle_prompt(700, 10), cycle_prompt(1403, 12)]
    lora = LoRARequest("qv", 1, adapter)
    want = [o.outputs[0].token_ids for o in make_llm(cycle_model, **kw).generate(
        [{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False, lora_request=lora)]
    spec = make_llm(cycle_model, NGRAM, **kw)
    got = [o.outputs[0].token_ids for o in spec.generate(
        [{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False, lora_request=lora)]
    assert got == want
    assert spec_counts(spec)[1] > 0


@pytest.mark.parametrize("extra", [dict(repetition_penalty=1.3), dict(frequency_penalty=0.5),
                                   dict(presence_penalty=0.5), dict(min_tokens=5, stop_token_ids=[705])])
def test_settings_that_read_earlier_outputs_decode_without_drafts(cycle_model, extra):
    """A position's penalties / min_tokens depend on the outputs before it, which a verified run of drafts does
    not update position by position: such requests are never drafted for, and their tokens are the plain ones."""
    prompts = [cycle_prompt(700, 10)]
    params = SamplingParams(temperature=0, max_tokens=12, **extra)
    spec = make_llm(cycle_model, NGRAM)
    assert ids(generate(spec, params, prompts)) == ids(generate(make_llm(cycle_model), params, prompts))
    assert spec_counts(spec) == (0, 0)


def test_structured_outputs_next_to_drafted_requests(cycle_model):
    """A constrained request is sampled one token per step under its grammar's mask (never drafted for) in the same
    batch as drafted ones; both give the plain engine's tokens."""
    from tokenmill.sampling_params import StructuredOutputsParams
    reqs = [{"prompt_token_ids": cycle_prompt(700, 10)}, {"prompt_token_ids": cycle_prompt(1400, 10)}]
    params = [SamplingParams(temperature=0, max_tokens=24),
              SamplingParams(temperature=0, max_tokens=24,
                             structured_outputs=StructuredOutputsParams(regex=r"[0-9]{2,4}-(ab|cd)"))]
    spec = make_llm(cycle_model, NGRAM)
    got = [o.outputs[0] for o in spec.generate(reqs, params, use_tqdm=False)]
    want = [o.outputs[0] for o in make_llm(cycle_model).generate(reqs, params, use_tqdm=False)]
    assert [list(o.token_ids) for o in got] == [list(o.token_ids) for o in want]
    import re
    assert re.fullmatch(r"[0-9]{2,4}-(ab|cd)", got[1].text)
    assert spec_counts(spec)[1] > 0
