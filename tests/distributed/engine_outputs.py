"""What the parallel-engine tests compare against TP=1: greedy tokens with their logprobs, one seeded random
sample, and prompt logprobs, from one generate call."""
from __future__ import annotations

from tokenmill import LLM, SamplingParams

ENGINE = dict(max_model_len=256, num_gpu_blocks_override=64, max_num_seqs=8)


def generate(llm: LLM, prompts: list[str], max_tokens: int):
    """(greedy [(tokens, logprobs)] per prompt, the seeded sample's tokens, the prompt logprobs of prompts[1])."""
    greedy = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=2)
    # A seeded random request: every rank draws the same counter-based noise, so N ranks sample what one does.
    seeded = SamplingParams(temperature=1.0, seed=7, max_tokens=max_tokens, ignore_eos=True)
    plp = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1)
    outs = llm.generate(prompts + prompts[:1] + prompts[1:2], [greedy] * len(prompts) + [seeded, plp],
                        use_tqdm=False)
    greedy_outs = [(o.outputs[0].token_ids, [d[t].logprob for t, d in zip(o.outputs[0].token_ids,
                                                                         o.outputs[0].logprobs)])
                   for o in outs[:len(prompts)]]
    prompt_lps = [None if d is None else max(d.values(), key=lambda x: x.logprob).logprob
                  for d in outs[-1].prompt_logprobs]
    return greedy_outs, outs[-2].outputs[0].token_ids, prompt_lps


def assert_matches_reference(got, ref) -> None:
    """`generate`'s results of a parallel engine against TP=1's: the same greedy and seeded tokens, logprobs and
    prompt logprobs within 1e-4."""
    (greedy, seeded, plp), (ref_greedy, ref_seeded, ref_plp) = got, ref
    for (tokens, lps), (ref_tokens, ref_lps) in zip(greedy, ref_greedy, strict=True):
        assert tokens == ref_tokens
        assert max(abs(a - b) for a, b in zip(lps, ref_lps)) < 1e-4
    assert seeded == ref_seeded
    assert plp[0] is None and ref_plp[0] is None
    assert max(abs(a - b) for a, b in zip(plp[1:], ref_plp[1:])) < 1e-4


def reference_cache(models: dict[str, str], prompts: list[str], max_tokens: int):
    """arch -> the TP=1 results, computed once per arch."""
    cache: dict[str, tuple] = {}

    def get(arch: str):
        if arch not in cache:
            cache[arch] = generate(LLM(models[arch], **ENGINE), prompts, max_tokens)
        return cache[arch]
    return get


def shutdown(llm: LLM) -> None:
    llm.llm_engine.engine_core.executor.shutdown()
