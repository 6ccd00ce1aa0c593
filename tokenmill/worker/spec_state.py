"""The model runner's speculative-decoding side: the drafter, each step's drafts, verification and the next drafts."""
from __future__ import annotations

import numpy as np
import torch

from tokenmill.layers.rejection_sampler import accept_fixed_rate, accept_matching
from tokenmill.spec_decode import DraftStep, make_proposer


class SpecDecodeState:
    """Owns the drafter and what the runner needs between its calls.

    Contract: `add_request` / `remove` as requests enter and leave the runner's batch; `begin_step` writes the
    scheduled drafts after each request's known tokens (the inputs read them; verification keeps or overwrites
    them); `accept` picks the kept tokens from the target's draws at every verified position; `propose` asks the
    drafter for the next drafts once the kept tokens are in the batch. Requests whose sampling reads the outputs
    before each position (penalties, min_tokens, bad words, grammars, logit bias, allowed tokens) are never drafted
    for: verifying a run of drafts does not update those position by position.
    """

    def __init__(self, config, device: torch.device, kv_dtypes: dict) -> None:
        self.spec = config.speculative_config
        self.k = self.spec.num_speculative_tokens
        self.proposer = make_proposer(config, device, kv_dtypes)
        self.drafts: dict[str, list[int]] = {}  # this step's, by request
        self.no_drafts: set[str] = set()
        self._accept_rng = np.random.default_rng(config.model_config.seed)  # benchmark_acceptance_rate only

    def add_request(self, req_id: str, row: int, params, num_computed: int) -> None:
        if drafts_verify_exactly(params):
            self.proposer.add_request(req_id, row, num_computed)
        else:
            self.no_drafts.add(req_id)

    def remove(self, req_id: str) -> None:
        self.proposer.remove(req_id)
        self.no_drafts.discard(req_id)

    def begin_step(self, drafts: dict[str, list[int]], batch) -> None:
        self.drafts = drafts
        for rid, d in drafts.items():
            row = batch.req_id_to_row[rid]
            n = int(batch.num_tokens[row])
            batch.token_ids[row, n:n + len(d)] = d

    def num_drafts(self, req_ids: list[str], sample_idx: np.ndarray) -> np.ndarray:
        return np.fromiter((len(self.drafts.get(req_ids[i], ())) for i in sample_idx), dtype=np.int64,
                           count=len(sample_idx))

    def accept(self, req_ids: list[str], sample_idx: np.ndarray, n_sample: np.ndarray,
               targets: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(tokens kept per sampling request, the token at every verified position): the run of drafts that the
        target's own draws agree with, plus the draw after it (layers/rejection_sampler.accept_matching). With
        benchmark_acceptance_rate the kept drafts stand whatever the target drew there."""
        if not self.drafts:  # nothing verified (speculation stood aside): each request keeps its one draw
            return np.ones(len(n_sample), dtype=np.int64), targets
        starts = np.cumsum(n_sample) - n_sample
        drafts = np.full(len(targets), -1, dtype=np.int64)
        for j, i in enumerate(sample_idx):
            d = self.drafts.get(req_ids[i])
            if d:
                drafts[starts[j]:starts[j] + len(d)] = d
        rate = self.spec.benchmark_acceptance_rate
        if rate is None:
            return accept_matching(targets, drafts, n_sample), targets
        keep = accept_fixed_rate(n_sample, rate, self._accept_rng)
        local = np.arange(len(targets)) - np.repeat(starts, n_sample)
        forced = local < np.repeat(keep - 1, n_sample)
        return keep, np.where(forced, drafts, targets)

    def propose(self, batch, req_ids: list[str], rows: np.ndarray, sample_idx: np.ndarray, keep: np.ndarray,
                seq_lens: np.ndarray, qsl: np.ndarray | None = None) -> list[list[int]]:
        """The next step's drafts of each request of the step (after its kept tokens are in the batch). Called on
        speculative steps only (above disable_by_batch_size running requests the engine's gate schedules none). A
        drafter with a model also catches up on prefill chunks here. qsl: the step's query_start_loc (where each
        request's tokens sit in the step's input, for a drafter that reads the target's hidden states)."""
        k = self.k
        n = len(req_ids)
        sampling = np.zeros(n, dtype=bool)
        sampling[sample_idx] = True
        accepted = np.zeros(n, dtype=np.int64)
        accepted[sample_idx] = keep - 1
        tracked = np.fromiter((rid not in self.no_drafts for rid in req_ids), dtype=bool, count=n)
        ends = np.where(sampling, batch.num_tokens[rows], seq_lens)
        sel = np.flatnonzero(tracked)
        first = count = flat = None
        if qsl is not None:
            count = np.diff(qsl)[sel]
            first, flat = seq_lens[sel] - count, qsl[:-1][sel]
        step = DraftStep([req_ids[i] for i in sel], rows[sel], ends[sel], sampling[sel], accepted[sel], k,
                         first, count, flat)
        drafts = self.proposer.propose_batch(batch, step)
        out: list[list[int]] = [[] for _ in range(n)]
        rate = self.spec.benchmark_acceptance_rate
        for i, d in zip(sel.tolist(), drafts):
            if rate is not None and sampling[i] and len(d) < k:  # benchmark mode verifies k drafts every step
                row = int(rows[i])
                d = d + [int(batch.token_ids[row, batch.num_tokens[row] - 1])] * (k - len(d))
            out[i] = d
        return out


def drafts_verify_exactly(params) -> bool:
    """Whether verifying a run of drafts samples each position as one-token steps would: not when the sampling
    of a position reads the outputs before it (penalties, min_tokens, bad words) or a grammar constrains it, nor
    with logit_bias / allowed_token_ids (SamplingState applies those to one row per request, not to each position
    of a run)."""
    return (params.frequency_penalty == 0 and params.presence_penalty == 0 and params.repetition_penalty == 1
            and not params.min_tokens and not params.bad_words_token_ids and params.structured_outputs is None
            and not params.logit_bias and params.allowed_token_ids is None)
