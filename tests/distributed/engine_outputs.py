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
