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
