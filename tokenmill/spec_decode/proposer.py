"""The drafter interface and the prompt-lookup (n-gram) drafter."""
from __future__ import annotations

import numpy as np



class Proposer:
    """Proposes draft tokens from a request's own tokens.

    Contract: `propose(req_id, tokens, k)` returns at most k token ids that are the drafter's guess of what follows
    `tokens` (all known tokens of the request, prompt then outputs; read-only, valid during the call only); an empty
    list proposes nothing. Drafts are deterministic (draft probability 1 for the proposed token), which is what the
    verification in layers/rejection_sampler assumes. `remove(req_id)` is called when the request leaves the runner
    (a drafter may keep per-request state between calls).
    """

    def propose(self, req_id: str, tokens: np.ndarray, k: int) -> list[int]:
        raise NotImplementedError

    def remove(self, req_id: str) -> None:
        pass


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
