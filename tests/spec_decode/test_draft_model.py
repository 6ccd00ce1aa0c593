"""Draft-model speculation: greedy and seeded outputs are the plain engine's with any draft; the target as its own
draft is accepted every time; the draft's KV survives chunked prefill, prefix hits and preemption; a draft that
cannot serve is refused at start-up naming the key."""
from __future__ import annotations

import json
import os
import shutil

import pytest

from tests.spec_decode.conftest import cycle_prompt, make_llm
from tests.spec_decode.test_greedy_exact import PROMPTS, generate, ids, spec_counts
from tokenmill.config.engine_args import create_engine_config
from tokenmill.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=40)


def draft(path: str, k: int = 4, **kw) -> dict:
    return {"model": path, "num_speculative_tokens": k, **kw}


@pytest.fixture(scope="module")
def baseline(cycle_model):
    return make_llm(cycle_model)


@pytest.fixture(scope="module")
def self_draft(cycle_model):
    return make_llm(cycle_model, draft(cycle_model))


def test_target_as_its_own_draft_is_always_accepted(baseline, self_draft):
    want = ids(generate(baseline, GREEDY))
    d0, a0 = spec_counts(self_draft)
    assert ids(generate(self_draft, GREEDY)) == want
    drafts, accepted = spec_counts(self_draft)
    assert drafts - d0 > 100 and accepted - a0 == drafts - d0
    m = {x.name: x for x in self_draft.get_metrics()}
    assert m["vllm:spec_decode_num_drafts"].value > 0


def test_unrelated_draft_gives_the_plain_tokens(baseline, cycle_model, tiny_llama):
    spec = make_llm(cycle_model, draft(tiny_llama, k=3))
    assert ids(generate(spec, GREEDY)) == ids(generate(baseline, GREEDY))
    drafts, accepted = spec_counts(spec)
    assert drafts > 0 and accepted < drafts


@pytest.mark.parametrize("setting", [dict(temperature=1.0), dict(temperature=0.7, top_k=20, top_p=0.9)],
                         ids=lambda s: ",".join(s))
def test_seeded_sampling_equals_the_plain_engine(baseline, self_draft, setting):
    prompts = PROMPTS[:3]
    params = [SamplingParams(max_tokens=24, seed=5 + i, **setting) for i in range(len(prompts))]
    d0, a0 = spec_counts(self_draft)
    assert ids(generate(self_draft, params, prompts)) == ids(generate(baseline, params, prompts))
    drafts, accepted = spec_counts(self_draft)
    assert accepted > a0


def test_chunked_prefill_prefix_hits_and_preemption(cycle_model):
    """The draft follows prefill chunk by chunk, starts a prefix hit from the blocks' draft KV, and starts over after
    a preemption; its own model drafting for it keeps acceptance at 100% through all of them."""
    prompts = [cycle_prompt(700, 8), list(range(300, 370)), cycle_prompt(1400, 70), cycle_prompt(2100, 5)]
    kw = dict(max_num_batched_tokens=16, long_prefill_token_threshold=0, enable_prefix_caching=True)
    want = ids(generate(make_llm(cycle_model, **kw), GREEDY, prompts))
    spec = make_llm(cycle_model, draft(cycle_model), **kw)
    assert ids(generate(spec, GREEDY, prompts)) == want
    # The same prompts again: prefix hits, whose draft KV the first run wrote.
    assert ids(generate(spec, GREEDY, prompts)) == want
    assert spec.llm_engine.engine_core.scheduler.kv.prefix_hits > 0
    drafts, accepted = spec_counts(spec)
    assert drafts > 0 and accepted == drafts

    many = [cycle_prompt(7 * (100 + i), 24) for i in range(8)]
    kw = dict(num_gpu_blocks_override=14, max_model_len=128)
    spec = make_llm(cycle_model, draft(cycle_model), **kw)
    assert ids(generate(spec, GREEDY, many)) == ids(generate(make_llm(cycle_model, **kw), GREEDY, many))
    assert spec.llm_engine.engine_core.scheduler._num_preemptions > 0
    drafts, accepted = spec_counts(spec)
    assert accepted == drafts > 0


def test_draft_context_shorter_than_the_target(baseline, cycle_model):
    """Requests that grow past the draft's max_model_len decode on without drafts."""
    spec = make_llm(cycle_model, draft(cycle_model, max_model_len=48))
    params = SamplingParams(temperature=0, max_tokens=60)
    assert ids(generate(spec, params)) == ids(generate(baseline, params))
    drafts, accepted = spec_counts(spec)
    assert 0 < accepted == drafts


def _with_config(src: str, dst: str, **changes) -> str:
    shutil.copytree(src, dst)
    path = os.path.join(dst, "config.json")
    with open(path) as f:
        cfg = json.load(f)
    cfg.update(changes)
    with open(path, "w") as f:
        json.dump(cfg, f)
    return dst


def test_bad_drafts_are_refused_naming_the_key(cycle_model, tmp_path):
    other_vocab = _with_config(cycle_model, str(tmp_path / "v"), vocab_size=1000)
    for f in os.listdir(other_vocab):  # no tokenizer: the config vocab sizes are compared
        if f.startswith(("tokenizer", "special_tokens", "vocab", "merges")):
            os.remove(os.path.join(other_vocab, f))
    cases = [
        (draft(other_vocab), "vocab_size 1000"),
        (draft(str(tmp_path / "missing")), "the draft `model`"),
        (draft(cycle_model, draft_tensor_parallel_size=2), "draft_tensor_parallel_size"),
        (draft(cycle_model, max_model_len=10 ** 6), "`max_model_len` (1000000) is larger"),
        (draft(cycle_model, k=17), "`num_speculative_tokens` must be an integer in 1..16"),
        ({"method": "draft_model", "num_speculative_tokens": 2}, "method draft_model needs `model`"),
        (draft(cycle_model, prompt_lookup_max=3), None),
    ]
    for value, said in cases:
        if said is None:  # a key of another method is accepted by vLLM's config too
            create_engine_config(model=cycle_model, dtype="float32", speculative_config=value)
            continue
        with pytest.raises(ValueError) as e:
            create_engine_config(model=cycle_model, dtype="float32", speculative_config=value)
        assert said in str(e.value), (said, str(e.value))


def test_draft_kv_is_exact_where_attention_decides(tiny_llama):
    """The random tiny Llama (whose tokens depend on its attention, unlike the cycle model's) drafting for itself
    through chunked prefill: every draft is accepted only if the draft's KV holds exactly the request's tokens."""
    prompts = [list(range(40, 70)), list(range(500, 503)), list(range(900, 961, 3))]
    kw = dict(max_num_batched_tokens=16, long_prefill_token_threshold=0)
    spec = make_llm(tiny_llama, draft(tiny_llama, k=5), **kw)
    assert ids(generate(spec, GREEDY, prompts)) == ids(generate(make_llm(tiny_llama, **kw), GREEDY, prompts))
    drafts, accepted = spec_counts(spec)
    assert accepted == drafts > 50


def _runner(llm):
    return llm.llm_engine.engine_core.executor.worker.runner


def test_one_pass_proposal_body_equals_the_step_by_step_path(tiny_llama):
    """The body that CUDA graphs capture (draft_graph.py: re-feed the last two tokens, then k - 1 steps, KV slots
    from the block table on the device), run eagerly: the same tokens, every draft still accepted, and most
    proposals made by it."""
    prompts = [list(range(40, 70)), list(range(500, 503)), list(range(900, 961, 3))]
    kw = dict(max_num_batched_tokens=16, long_prefill_token_threshold=0, max_num_seqs=4)
    spec = make_llm(tiny_llama, draft(tiny_llama, k=5), **kw)
    runner = _runner(spec)
    runner.spec_state.proposer.use_proposal_graphs([1, 2, 4], max_blocks=runner.batch.block_table.shape[1], capture=False)
    assert ids(generate(spec, GREEDY, prompts)) == ids(generate(make_llm(tiny_llama, **kw), GREEDY, prompts))
    drafts, accepted = spec_counts(spec)
    assert accepted == drafts > 50
    assert runner.spec_state.proposer.graphs.proposals > drafts / 5 / 2
