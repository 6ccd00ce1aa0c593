"""The runner's pooler seam (CPU): with a pooler set, a step returns each finished prompt's pooled hidden state
in place of a sampled token, equal to pooling HF's final hidden states of the same weights."""
from __future__ import annotations

import pytest
import torch

from tokenmill.core.sched_output import CachedRequestData, NewRequestData, SchedulerOutput
from tokenmill.layers.pooler import LastTokenPooler, MeanPooler
from tokenmill.sampling_params import SamplingParams

PROMPTS = [[5, 17, 42, 7, 99, 3], [8, 1, 2]]


@pytest.fixture(scope="module")
def runner_and_hf(tiny_model_factory):
    import transformers as tf

    from tokenmill import LLM
    d = tiny_model_factory("llama")
    llm = LLM(d, dtype="float32", max_model_len=64, num_gpu_blocks_override=16, max_num_seqs=4, enforce_eager=True)
    hf = tf.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    yield llm.llm_engine.engine_core.executor.worker.runner, hf
    del llm


def _step(runner, pooler, prompts, first_id=0):
    new = [NewRequestData(f"r{first_id + i}", p, [], SamplingParams(max_tokens=1), [i], 0)
           for i, p in enumerate(prompts)]
    sched = SchedulerOutput(new, CachedRequestData(), {n.req_id: len(n.prompt_token_ids) for n in new},
                            sum(map(len, prompts)), set())
    runner.pooler = pooler
    try:
        runner.execute_model(sched)
        out = runner.sample_tokens(None).get()
    finally:
        runner.pooler = None
        done = SchedulerOutput([], CachedRequestData(), {}, 0, {n.req_id for n in new})
        runner.execute_model(done)   # forget them
    return out


@pytest.mark.parametrize("pooler,pick", [(MeanPooler(normalize=True), lambda h: h.mean(0)),
                                         (LastTokenPooler(), lambda h: h[-1])], ids=["mean-normalized", "last"])
def test_pooled_states_match_hf(runner_and_hf, pooler, pick):
    runner, hf = runner_and_hf
    out = _step(runner, pooler, PROMPTS)
    assert out.sampled_token_ids == [[], []] and len(out.pooler_output) == 2
    for prompt, got in zip(PROMPTS, out.pooler_output):
        with torch.no_grad():
            h = hf.model(torch.tensor([prompt])).last_hidden_state[0].float()
        want = pick(h)
        if pooler.normalize:
            want = want / want.norm()
        # fp32 on both sides; on CUDA the Triton kernels' dots run in TF32.
        tol = 3e-3 if torch.cuda.is_available() else 1e-4
        torch.testing.assert_close(got.cpu(), want, rtol=tol, atol=tol)


def test_a_chunked_prompt_is_refused(runner_and_hf):
    runner, _ = runner_and_hf
    new = NewRequestData("chunked", PROMPTS[0], [], SamplingParams(max_tokens=1), [0], 0)
    sched = SchedulerOutput([new], CachedRequestData(), {"chunked": 3}, 3, set())
    runner.pooler = MeanPooler()
    try:
        with pytest.raises(NotImplementedError, match="one step"):
            runner.execute_model(sched)
    finally:
        runner.pooler = None
        runner.execute_model(SchedulerOutput([], CachedRequestData(), {}, 0, {"chunked"}))
