"""Verification of draft tokens: which of k drafted tokens a request keeps, and the token that follows them.

Two exact rules:

- `accept_matching` for deterministic drafts (n-gram, suffix: draft probability 1 for the proposed token). The
  sampler draws the target's token at each of the k + 1 positions with the same counter-based noise it would use
  without speculation (seed, output index): the exponential race is a coupling of the target distribution, so the
  draft at position i is kept exactly when the target's own draw there equals it, and the first draw that differs
  (or the (k+1)-th) is the bonus token. Every output token is therefore the token the non-speculative engine would
  have produced for that prefix, for every sampling setting the sampler supports, greedy included (its draw is the
  argmax), and a seeded request gives the same output with and without speculation. The acceptance probability of
  a draft d is p(d), the most a deterministic draft can get (standard rejection sampling: min(1, p(d) / 1)).
- `rejection_sample` for drafts with a distribution q (a draft model): keep draft d with probability
  min(1, p(d) / q(d)), else draw from the residual max(0, p - q) renormalised; the output is distributed as p.
"""
from __future__ import annotations

import numpy as np
import torch


def accept_matching(targets: np.ndarray, drafts: np.ndarray, n_sample: np.ndarray) -> np.ndarray:
    """How many tokens each request keeps, given the target's draws at all its k_i + 1 positions.

    targets: [sum(n_sample)] the target's token at each verified position, request after request; drafts: the
    same layout, the draft token each position checks (its last position, the bonus, holds anything); n_sample:
    k_i + 1 per request. Returns [len(n_sample)]: 1 + the number of leading drafts the target agrees with.
    """
    n_sample = np.asarray(n_sample, dtype=np.int64)
    if not len(n_sample):
        return n_sample
    starts = np.cumsum(n_sample) - n_sample
    local = np.arange(len(targets)) - np.repeat(starts, n_sample)
    stop = targets != drafts
    stop[starts + n_sample - 1] = True           # the bonus position always ends the run
    first = np.where(stop, local, np.iinfo(np.int64).max)
    return np.minimum.reduceat(first, starts) + 1


def accept_fixed_rate(n_sample: np.ndarray, rate: float, rng: np.random.Generator) -> np.ndarray:
    """Benchmark mode: each draft is kept with probability `rate` whatever the target says (for dummy weights,
    whose drafts real verification never accepts); returns the tokens kept per request as accept_matching does."""
    n_sample = np.asarray(n_sample, dtype=np.int64)
    k = n_sample - 1
    if not len(k) or not k.max():
        return np.ones(len(k), dtype=np.int64)
    ok = rng.random((len(k), int(k.max()))) < rate
    ok &= np.arange(ok.shape[1])[None, :] < k[:, None]
    leading = np.where(ok.all(axis=1), k, np.argmin(ok, axis=1))
    return leading + 1


def rejection_sample(target_probs: torch.Tensor, draft_probs: torch.Tensor, draft_ids: torch.Tensor,
                     generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Standard speculative sampling for one request's k drafts drawn from distributions q.

    target_probs: [k + 1, V] the target's (processed) distributions at the k + 1 positions; draft_probs: [k, V] the
    drafter's at the first k; draft_ids: [k]. Returns (tokens [num kept], num kept): the accepted drafts, then
    one token from the residual at the first rejection or from target_probs[k] when all k are accepted. The
    output's distribution equals the target's (Leviathan et al. 2023, Chen et al. 2023).
    """
    k = draft_ids.shape[0]
    p = target_probs[:k].gather(1, draft_ids[:, None])[:, 0]
    q = draft_probs.gather(1, draft_ids[:, None])[:, 0]
    u = torch.rand(k, generator=generator, device=target_probs.device, dtype=target_probs.dtype)
    accepted = u * q < p                           # u < p / q without dividing by a zero q
    rejected = torch.nonzero(~accepted)
    if len(rejected):
        i = int(rejected[0, 0])
        residual = (target_probs[i] - draft_probs[i]).clamp_min(0)
        total = residual.sum()
        residual = residual / total if total > 0 else target_probs[i]
        last = torch.multinomial(residual, 1, generator=generator)
        return torch.cat([draft_ids[:i], last]), torch.tensor(i + 1)
    last = torch.multinomial(target_probs[k], 1, generator=generator)
    return torch.cat([draft_ids, last]), torch.tensor(k + 1)
