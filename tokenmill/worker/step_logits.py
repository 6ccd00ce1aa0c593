"""What the model runner does to a step's logits besides sampling: grammar masks for constrained rows, and the
logprobs of the prompt tokens a prefill chunk covers."""
from __future__ import annotations

import numpy as np
import torch

from tokenmill.core.messages import LogprobsLists
from tokenmill.core.sched_output import GrammarOutput
from tokenmill.layers.sampler import compute_prompt_logprobs
from tokenmill.worker.transfer import to_device


def apply_grammar(grammar: GrammarOutput, req_ids: list[str], sample_idx: np.ndarray, n_sample: np.ndarray,
                  logits: torch.Tensor, device: torch.device) -> None:
    """Mask the logits of constrained rows with their grammars' allowed tokens, for the batch at once."""
    from tokenmill.kernels.triton_bitmask import apply_bitmask
    # A constrained request samples one token per step (it is never drafted for): its logits row is the last of
    # its run.
    ends = np.cumsum(n_sample) - 1
    pos = {req_ids[i]: int(ends[j]) for j, i in enumerate(sample_idx)}
    rows = np.fromiter((pos[rid] for rid in grammar.req_ids), dtype=np.int64, count=len(grammar.req_ids))
    # One row per sampled request, covering every logits column: the scheduler's rows where constrained (columns
    # past the grammar's vocabulary disallowed), all ones elsewhere.
    # Built with numpy: torch's CPU ops on a tensor this size (32 rows x 49k tokens) fan out to its OpenMP threads
    # and took ~1.6 ms each on the H200 host.
    compact = grammar.bitmask.numpy() if isinstance(grammar.bitmask, torch.Tensor) else grammar.bitmask
    words = -(-logits.shape[1] // 32)
    full = np.full((logits.shape[0], words), -1, dtype=np.int32)
    w = min(compact.shape[1], words)
    full[rows, :w] = compact[:, :w]
    full[rows, w:] = 0
    apply_bitmask(logits, to_device(full, device), rows)


def prompt_logprobs(model, batch, wanted: dict[str, int], inp, hidden: torch.Tensor,
                    device: torch.device) -> dict[str, LogprobsLists]:
    """Logprobs of the prompt tokens covered by this step's chunk (position p scores prompt token p + 1), for the
    requests in `wanted` (request id -> number of top logprobs); inp: the step's StepInputs, batch: the runner's
    InputBatch."""
    if not wanted:
        return {}
    out = {}
    for i, rid in enumerate(inp.req_ids):
        n = wanted.get(rid)
        if n is None:
            continue
        row, start = inp.rows[i], int(inp.computed[i])
        end = min(start + int(inp.n_sched[i]), int(batch.num_prompt_tokens[row]) - 1)
        if end <= start:
            continue
        first = int(inp.qsl[i])
        h = hidden[first:first + (end - start)]
        targets = to_device(batch.token_ids[row, start + 1:end + 1].astype(np.int64), device)
        out[rid] = compute_prompt_logprobs(model.compute_logits(h), targets, n).tolists()
    return out
