"""Speculative decoding on CUDA (run with `pytest -m gpu` on the device): verify widths and the draft model's proposal
replay captured graphs, and give the plain engine's greedy tokens."""
from __future__ import annotations

import pytest

pytestmark = pytest.mark.gpu

PROMPTS = [list(range(40, 70)), list(range(500, 503)), list(range(900, 961, 3)), [7] * 20]


def _count_verify_replays(runner) -> list[int]:
    """Patch the target's graph runner to count replays of graphs with several tokens per request."""
    cg, seen = runner.cuda_graphs, [0]
    run = cg.run

    def counted(key, n):
        seen[0] += key.q > 1
        return run(key, n)
    cg.run = counted
    return seen


def _generate(llm, n=40, prompts=PROMPTS):
    from tokenmill import SamplingParams
    sp = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], sp,
                                                         use_tqdm=False)]


@pytest.mark.parametrize("method", ["draft_model", "ngram"])
def test_spec_decode_graphs_give_the_plain_tokens(tiny_model_factory, tmp_path, method):
    from tests.spec_decode.conftest import cycle_prompt, write_cycle_model
    from tokenmill import LLM
    d = tiny_model_factory("llama")
    prompts = PROMPTS
    if method == "ngram":  # a model that continues its cycles, so prompt lookup drafts k tokens that are accepted
        d = write_cycle_model(d, str(tmp_path / "cycle"), mix=0.05)
        prompts = [cycle_prompt(7 * i + 1, 12 + 5 * i) for i in range(4)]
    kw = dict(dtype="float32", max_model_len=256, num_gpu_blocks_override=256, max_num_seqs=8)
    want = _generate(LLM(d, **kw), prompts=prompts)
    spec = {"model": d, "num_speculative_tokens": 4} if method == "draft_model" else \
        {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}
    spec["step_aside"] = False
    llm = LLM(d, speculative_config=spec, **kw)
    runner = llm.llm_engine.engine_core.executor.worker.runner
    assert (1, 5) in runner.cuda_graphs.graphs
    verify = _count_verify_replays(runner)
    assert _generate(llm, prompts=prompts) == want
    m = {x.name: x for x in llm.get_metrics()}
    drafts, accepted = (m[f"vllm:spec_decode_num_{k}_tokens"].value for k in ("draft", "accepted"))
    assert accepted > 0 and verify[0] > 0
    if method == "draft_model":
        graphs = runner.spec_state.proposer.graphs
        assert graphs.graphs and graphs.proposals > 0
        # The target drafting for itself: fp32 on both sides, so (near-ties apart) every draft is accepted.
        assert accepted >= 0.9 * drafts


def test_draft_model_in_bf16_with_a_smaller_draft(tiny_model_factory):
    """A bf16 target with a different draft (the tiny Qwen3 shares the tokenizer): runs through the graphs."""
    from tokenmill import LLM
    target, other = tiny_model_factory("llama"), tiny_model_factory("qwen3")
    llm = LLM(target, dtype="bfloat16", max_model_len=256, num_gpu_blocks_override=256, max_num_seqs=8,
              speculative_config={"model": other, "num_speculative_tokens": 3, "step_aside": False})
    outs = _generate(llm, 24)
    assert all(len(o) == 24 for o in outs)
    assert llm.llm_engine.engine_core.executor.worker.runner.spec_state.proposer.graphs.proposals > 0
