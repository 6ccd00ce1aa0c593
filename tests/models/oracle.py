"""Helpers the model-family tests share: HF's teacher-forced logprobs and the token lists of LLM outputs."""
from __future__ import annotations

import torch


def hf_logprobs(hf, ids: list[int]) -> torch.Tensor:
    """log_softmax of HF's logits at every position of `ids` (one forward, fp32)."""
    with torch.no_grad():
        logits = hf(input_ids=torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits, -1)


def tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


# A stop string no tiny random model writes. It makes an output's length uncertain, so the scheduler admits such
# requests as vLLM does (blocks for what they compute now, none kept for their growth) and a tight pool preempts.
NEVER_STOP = "\x00\x01 never \x02"


def assert_greedy_matches_hf(hf, outs, tol: float = 1e-4) -> None:
    """Each output's tokens are HF's argmax at every position (teacher-forced on prompt + output) and their
    logprobs are within tol of HF's."""
    for out in outs:
        c = out.outputs[0]
        ref = hf_logprobs(hf, out.prompt_token_ids + c.token_ids)
        n = len(out.prompt_token_ids)
        for i, (tid, lp) in enumerate(zip(c.token_ids, c.logprobs)):
            assert tid == int(ref[n - 1 + i].argmax()), (n, i)
            assert abs(lp[tid].logprob - ref[n - 1 + i][tid].item()) < tol, (n, i)
