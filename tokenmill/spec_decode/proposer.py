"""The drafter interface and the prompt-lookup (n-gram) drafter."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class DraftStep:
    """What a step left for the drafter, one entry per request the step ran (runner rows, batch order).

    ends[i]: tokens of row i the target has now run or sampled (a prefill chunk's end; for a sampling request all its
    known tokens, the last one just sampled). propose[i]: row i wants up to k drafts (it sampled, and its sampling
    can be verified run-wise). accepted[i]: drafts of row i the target kept this step (0 where none were verified).
    first[i], count[i], flat[i]: the target ran positions first .. first + count - 1 of row i this step, as tokens
    flat .. flat + count - 1 of the step's input (where an EAGLE head finds their hidden states); None when the
    caller does not know them.
    """
    req_ids: list[str]
    rows: np.ndarray
    ends: np.ndarray
    propose: np.ndarray
    accepted: np.ndarray
    k: int
    first: np.ndarray | None = None
    count: np.ndarray | None = None
    flat: np.ndarray | None = None


class Proposer:
    """Proposes draft tokens after each step.

    Contract: `propose_batch(batch, step)` returns, for each request of the step, at most k token ids that are the
    drafter's guess of what follows the request's known tokens (`batch.token_ids[row, :num_tokens[row]]`, prompt
    then outputs), [] where `step.propose` is False or it has no guess. Drafts are deterministic (draft probability 1
    for the proposed token), which is what the verification in layers/rejection_sampler assumes. The default asks
    `propose(req_id, tokens, k)` per request (host-side drafters). `add_request` / `remove` are called as requests
    enter and leave the runner (a drafter may keep per-request state between calls).

    A drafter with its own model (`has_model`) also takes part in set-up: it loads its weights, adds its KV bytes
    per block to the target's (it writes its KV into the target's blocks, in its own cache tensors), and runs in
    the memory profile.
    """
    has_model = False

    def propose(self, req_id: str, tokens: np.ndarray, k: int) -> list[int]:
        raise NotImplementedError

    def propose_batch(self, batch, step: DraftStep) -> list[list[int]]:
        out: list[list[int]] = []
        for i, rid in enumerate(step.req_ids):
            row = int(step.rows[i])
            out.append(self.propose(rid, batch.token_ids[row, :batch.num_tokens[row]], step.k)
                       if step.propose[i] else [])
        return out

    def add_request(self, req_id: str, row: int, num_computed: int) -> None:
        pass

    def remove(self, req_id: str) -> None:
        pass

    # ----- a drafter with a model of its own -----
    def load_model(self, backend_cls: type, target=None) -> None:
        """target: the target model (an EAGLE head shares its embedding / LM head and reads its hidden states)."""
        pass

    def kv_cache_bytes_per_block(self, block_size: int) -> int:
        return 0

    def initialize_kv_cache(self, num_blocks: int, block_size: int, max_num_reqs: int,
                            graph_sizes: list[int] | None = None, max_model_len: int = 0) -> None:
        pass

    def profile_run(self, num_tokens: int) -> None:
        pass

    def release_kv_cache(self) -> None:
        """Drop a drafter's KV cache and the graphs that point into it (sleep mode); initialize_kv_cache makes
        them again."""
        for name in ("kv_caches", "graphs"):
            if hasattr(self, name):
                setattr(self, name, None)


class NgramProposer(Proposer):
    """Prompt lookup: find the latest earlier occurrence of the context's last n tokens (n from prompt_lookup_max
    down to prompt_lookup_min, the longest that occurs wins) and propose the k tokens that followed it.

    The match lengths of every earlier end position are computed at once with numpy (one vectorized compare per
    n-gram length), so the cost per step is O(context x prompt_lookup_max) in array operations, no Python loop over
    the context.
    """

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n

    def propose(self, req_id: str, tokens: np.ndarray, k: int) -> list[int]:
        return ngram_lookup(tokens, self.min_n, self.max_n, k)


def ngram_lookup(tokens: np.ndarray, min_n: int, max_n: int, k: int) -> list[int]:
    """The k tokens after the latest earlier occurrence of the longest suffix of `tokens` of length min_n..max_n
    (an occurrence may overlap the suffix itself but must end before the last token); [] when none occurs."""
    n = len(tokens)
    if n < min_n + 1 or k <= 0:
        return []
    t = np.asarray(tokens)
    # alive[e]: the tokens ending at e (e < n - 1) match the context's last `length` tokens.
    ends = n - 1
    alive = t[:ends] == t[n - 1]
    length = alive.astype(np.int32)
    for j in range(1, min(max_n, n - 1)):
        shifted = np.zeros(ends, dtype=bool)
        shifted[j:] = t[:ends - j] == t[n - 1 - j]
        alive &= shifted
        if not alive.any():
            break
        length += alive
    best = int(length.max()) if ends else 0
    if best < min_n:
        return []
    e = int(np.flatnonzero(length == best)[-1])  # the latest occurrence of the longest match
    return t[e + 1:min(e + 1 + k, n)].tolist()
