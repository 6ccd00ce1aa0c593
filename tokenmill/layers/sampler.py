"""The sampler: logits [B, V] -> one token per row (+ optional logprobs), vectorized over the batch.

Order of operations follows vLLM v1:
  (a) raw logprobs (logprobs_mode raw_logprobs / raw_logits) from the unprocessed logits;
  (b) allowed_token_ids, bad words, min_tokens (stop ids masked to -inf), logit_bias (added), penalties;
  (c) greedy rows: argmax of the processed logits;
  (d) random rows: temperature, min_p, top-k / top-p (vLLM v1 applies min-p, an argmax-invariant logits processor,
      before top-k / top-p; every stage keeps the ties of its boundary value), then the exponential race with
      counter-based noise (`sampling_rng`), so seeded rows are reproducible whatever the batch composition;
  (e) processed logprobs (processed_logprobs / processed_logits) from the logits the random draw saw.
Every optional stage is skipped unless `SamplingMetadata` says some row in the batch needs it; an all-greedy batch
with nothing else is a single argmax.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenmill.core.messages import LogprobsLists
from tokenmill.kernels.sampling_rng import log_exponential

LOGPROBS_MODES = ("raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits")
_NEG_INF = float("-inf")


@dataclass
class SamplingMetadata:
    """Per-step sampling inputs for a batch of B rows, all tensors on the model's device.

    A field that is None means *no row in this batch* uses that feature, and the sampler skips the stage; when a
    field is set, rows that do not use the feature hold its neutral value (top_k 0, top_p 1, min_p 0, penalties
    0/0/1). Built by `tokenmill.worker.sampling_state.SamplingState.make_metadata`.
    """
    all_greedy: bool
    all_random: bool
    greedy_mask: torch.Tensor | None = None        # [B] bool; only set for mixed greedy/random batches
    temperature: torch.Tensor | None = None        # [B] f32, greedy rows hold 1.0; None = nothing to divide
    seeds: torch.Tensor | None = None              # [B] int64 RNG seeds; None when all_greedy
    positions: torch.Tensor | None = None          # [B] int64 output index being sampled (RNG counter)
    top_k: torch.Tensor | None = None              # [B] int64, 0 = off
    max_top_k: int = 0                             # max top_k over rows with top-k (lets us use topk, not sort)
    top_p: torch.Tensor | None = None              # [B] f32
    min_p: torch.Tensor | None = None              # [B] f32
    frequency_penalties: torch.Tensor | None = None    # [B] f32
    presence_penalties: torch.Tensor | None = None     # [B] f32
    repetition_penalties: torch.Tensor | None = None   # [B] f32
    output_token_counts: torch.Tensor | None = None    # [B, V] f32 counts of each token in the outputs so far
    prompt_token_mask: torch.Tensor | None = None      # [B, V] bool, token occurs in the prompt (repetition only)
    logit_bias_index: torch.Tensor | None = None       # [2, N] int64 (batch row, token id)
    logit_bias_values: torch.Tensor | None = None      # [N] f32
    allowed_rows: torch.Tensor | None = None           # [R] int64 batch rows with allowed_token_ids
    allowed_mask: torch.Tensor | None = None           # [R, V] bool, True = NOT allowed (masked to -inf)
    bad_words_index: torch.Tensor | None = None        # [2, N] int64 (batch row, banned token id) this step
    min_tokens_index: torch.Tensor | None = None       # [2, N] int64 (batch row, stop token id) this step
    max_num_logprobs: int | None = None                # largest logprobs N in the batch; -1 = vocab; None = none
    logprobs_mode: str = "raw_logprobs"

    @property
    def no_penalties(self) -> bool:
        return self.output_token_counts is None

    @property
    def needs_processing(self) -> bool:
        """True when stage (b) has anything to do."""
        return not (self.no_penalties and self.logit_bias_index is None and self.allowed_rows is None
                    and self.bad_words_index is None and self.min_tokens_index is None)


@dataclass
class LogprobsTensors:
    """Logprobs for B positions: column 0 is the chosen token, columns 1..K the top-K in descending order.

    ranks[i] is the chosen token's rank, 1 = most likely; ties count only strictly greater tokens.
    """
    token_ids: torch.Tensor  # [B, K+1] int64
    logprobs: torch.Tensor   # [B, K+1] float32
    ranks: torch.Tensor      # [B] int64

    def tolists(self) -> LogprobsLists:
        # One transfer per tensor; callers trim each row to the N its request asked for.
        return LogprobsLists(token_ids=self.token_ids.tolist(), logprobs=self.logprobs.tolist(),
                             ranks=self.ranks.tolist())


@dataclass
class SamplerOutput:
    sampled_token_ids: torch.Tensor      # [B] int64
    logprobs: LogprobsTensors | None     # None unless some row asked for logprobs


def gather_logprobs(logprobs: torch.Tensor, token_ids: torch.Tensor, num_logprobs: int) -> LogprobsTensors:
    """Chosen-token logprob + rank and the top-`num_logprobs` (-1 = whole vocab) from a [B, V] logprob matrix."""
    vocab = logprobs.shape[-1]
    k = vocab if num_logprobs < 0 else min(num_logprobs, vocab)
    token_ids = token_ids.to(torch.int64)
    chosen = logprobs.gather(1, token_ids[:, None])
    ranks = (logprobs > chosen).sum(dim=-1) + 1
    if k == 0:
        return LogprobsTensors(token_ids[:, None], chosen.float(), ranks)
    top_vals, top_ids = logprobs.topk(k, dim=-1)
    return LogprobsTensors(torch.cat([token_ids[:, None], top_ids], dim=1),
                           torch.cat([chosen, top_vals], dim=1).float(), ranks)


def compute_prompt_logprobs(logits: torch.Tensor, target_token_ids: torch.Tensor,
                            num_logprobs: int) -> LogprobsTensors:
    """Prompt logprobs: logits [T, V] predict target_token_ids [T]; raw log_softmax in fp32; -1 = whole vocab."""
    lp = torch.log_softmax(logits.to(torch.float32), dim=-1)
    return gather_logprobs(lp, target_token_ids, num_logprobs)


# ----- logits processors (all in place on float32 [B, V]) -----

def apply_penalties(logits: torch.Tensor, md: SamplingMetadata) -> None:
    counts = md.output_token_counts
    if md.repetition_penalties is not None:
        # HF/vLLM: tokens seen in prompt or output get positive logits divided, negative multiplied.
        seen = md.prompt_token_mask | (counts > 0)
        rep = torch.where(seen, md.repetition_penalties[:, None], 1.0)
        logits.copy_(torch.where(logits > 0, logits / rep, logits * rep))
    if md.frequency_penalties is not None:
        logits.sub_(md.frequency_penalties[:, None] * counts)
    if md.presence_penalties is not None:
        logits.sub_(md.presence_penalties[:, None] * (counts > 0))


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> None:
    """Drop tokens with prob < min_p * max prob. In log space: logit < max_logit + log(min_p); no softmax needed,
    and min_p = 0 gives log 0 = -inf, i.e. nothing dropped."""
    thr = logits.amax(dim=-1, keepdim=True) + torch.log(min_p)[:, None]
    logits.masked_fill_(logits < thr, _NEG_INF)


def apply_top_k_top_p(logits: torch.Tensor, k: torch.Tensor | None, p: torch.Tensor | None,
                      max_top_k: int = 0) -> None:
    """Top-k (k <= 0 = off) then top-p on the top-k-renormalized distribution; both reduce to a per-row logit
    threshold, so the result never depends on how the sort orders ties, and each row keeps >= 1 token."""
    vocab = logits.shape[-1]
    if k is None and p is None:
        return
    if p is None:
        # Top-k only: a partial topk of the largest k in the batch is much cheaper than a full sort.
        kk = min(max_top_k, vocab) if max_top_k > 0 else vocab
        vals = logits.topk(kk, dim=-1).values  # descending
        thr = vals.gather(1, (k.clamp(1, kk) - 1)[:, None])
        thr = thr.masked_fill((k <= 0)[:, None], _NEG_INF)
        logits.masked_fill_(logits < thr, _NEG_INF)
        return
    s = logits.sort(dim=-1).values  # ascending
    if k is not None:
        kk = torch.where(k > 0, k, vocab).clamp(max=vocab)
        s = s.masked_fill(s < s.gather(1, (vocab - kk)[:, None]), _NEG_INF)
    # Drop the ascending prefix whose cumulative probability is <= 1 - p; never drop the top token.
    cum = s.softmax(dim=-1).cumsum_(dim=-1)
    drop = cum <= (1.0 - p)[:, None]
    drop[:, -1] = False
    thr = s.gather(1, drop.sum(dim=-1, keepdim=True))
    logits.masked_fill_(logits < thr, _NEG_INF)


class Sampler(torch.nn.Module):
    """logits [B, V] (float32 or bf16) + SamplingMetadata -> SamplerOutput.

    float32 input logits are modified in place (they are the model's fresh output; copying them would cost a
    [B, V] pass per step). The only device->host sync is the caller's read of the sampled ids.
    fuse_noise=True draws the random tokens with Triton kernels (the same integers and tokens as the torch path):
    tokenmill.kernels.triton_sampling for plain temperature sampling (without the ~15 [B, V] int64 passes), and
    tokenmill.kernels.triton_topk_topp for min-p / top-k / top-p (without the full-vocabulary sort; no host sync,
    so it also runs inside CUDA graphs). The torch path (CPU) sorts; both keep exactly the same set.
    """

    def __init__(self, fuse_noise: bool = False) -> None:
        super().__init__()
        self.fuse_noise = fuse_noise

    def forward(self, logits: torch.Tensor, md: SamplingMetadata) -> SamplerOutput:
        want_lp = md.max_num_logprobs is not None
        if md.all_greedy and not want_lp and not md.needs_processing:
            # Fast path. argmax on bf16 equals argmax on its exact fp32 upcast.
            return SamplerOutput(logits.argmax(dim=-1), None)

        if (self.fuse_noise and md.all_random and not want_lp and not md.needs_processing and md.min_p is None
                and md.top_k is None and md.top_p is None):
            # Plain temperature sampling: the race kernel reads the model-dtype logits and divides by the
            # temperature itself (same fp32 values and tokens), skipping two [B, V] passes (fp32 copy, divide).
            from tokenmill.kernels.triton_sampling import race_argmax
            return SamplerOutput(race_argmax(logits, md.seeds, md.positions, md.temperature), None)

        truncates = md.top_k is not None or md.top_p is not None or md.min_p is not None
        if self.fuse_noise and truncates and not md.all_greedy:
            return self._truncated_fused(logits, md)

        logits = logits.to(torch.float32)
        mode = md.logprobs_mode
        lp_src = None
        if want_lp and mode == "raw_logprobs":
            lp_src = torch.log_softmax(logits, dim=-1)
        elif want_lp and mode == "raw_logits":
            lp_src = logits.clone()

        self._process(logits, md)

        greedy = None if md.all_random else logits.argmax(dim=-1)
        if md.all_greedy:
            sampled = greedy
        else:
            if md.temperature is not None:
                logits.div_(md.temperature[:, None])
            if md.min_p is not None:
                apply_min_p(logits, md.min_p)
            apply_top_k_top_p(logits, md.top_k, md.top_p, md.max_top_k)
            # Exponential race: argmax(logits - log q), q ~ Exp(1) from (seed, position, token). Written into the
            # noise buffer so `logits` stays intact for processed logprobs.
            if self.fuse_noise:
                from tokenmill.kernels.triton_sampling import race_argmax
                rand_tok = race_argmax(logits, md.seeds, md.positions)
            else:
                noise = log_exponential(md.seeds, md.positions, logits.shape[-1], logits.device)
                rand_tok = torch.sub(logits, noise, out=noise).argmax(dim=-1)
            sampled = rand_tok if greedy is None else torch.where(md.greedy_mask, greedy, rand_tok)

        lp_out = None
        if want_lp:
            if lp_src is None:
                lp_src = torch.log_softmax(logits, dim=-1) if mode == "processed_logprobs" else logits
            lp_out = gather_logprobs(lp_src, sampled, md.max_num_logprobs)
        return SamplerOutput(sampled, lp_out)

    def _truncated_fused(self, logits: torch.Tensor, md: SamplingMetadata) -> SamplerOutput:
        """min-p / top-k / top-p rows on the GPU: tokenmill.kernels.triton_topk_topp draws the race winner over the
        kept set without sorting (the same token as the torch path below; when md.max_top_k <= TOPK_SELECT_MAX the
        rows with top-k come from torch.topk's candidates, without a pass over the row) and, when processed logprobs
        need it, returns each row's threshold so the kept set is `scaled logits >= threshold`."""
        from tokenmill.kernels.triton_topk_topp import topk_topp_sample
        want_lp = md.max_num_logprobs is not None
        mode = md.logprobs_mode
        lp_src = None
        if want_lp or md.needs_processing:
            logits = logits.to(torch.float32)
            if want_lp and mode == "raw_logprobs":
                lp_src = torch.log_softmax(logits, dim=-1)
            elif want_lp and mode == "raw_logits":
                lp_src = logits.clone()
            self._process(logits, md)
        greedy = None if md.all_random else logits.argmax(dim=-1)
        want_thr = want_lp and lp_src is None
        rand_tok, thr = topk_topp_sample(logits, md.seeds, md.positions, md.temperature, md.top_k, md.top_p,
                                         md.min_p, want_threshold=want_thr, max_top_k=md.max_top_k)
        sampled = rand_tok if greedy is None else torch.where(md.greedy_mask, greedy, rand_tok)
        lp_out = None
        if want_lp:
            if lp_src is None:   # processed: the temperature-scaled logits with the dropped tokens at -inf
                if md.temperature is not None:
                    logits.div_(md.temperature[:, None])
                logits.masked_fill_(logits < thr[:, None], _NEG_INF)
                lp_src = torch.log_softmax(logits, dim=-1) if mode == "processed_logprobs" else logits
            lp_out = gather_logprobs(lp_src, sampled, md.max_num_logprobs)
        return SamplerOutput(sampled, lp_out)

    @staticmethod
    def _process(logits: torch.Tensor, md: SamplingMetadata) -> None:
        """Stage (b): request-level constraints and penalties, in vLLM's order."""
        if md.allowed_rows is not None:
            rows = md.allowed_rows
            logits[rows] = logits[rows].masked_fill(md.allowed_mask, _NEG_INF)
        if md.bad_words_index is not None:
            logits.index_put_(tuple(md.bad_words_index), logits.new_full((), _NEG_INF))
        if md.min_tokens_index is not None:
            logits.index_put_(tuple(md.min_tokens_index), logits.new_full((), _NEG_INF))
        if md.logit_bias_index is not None:
            logits.index_put_(tuple(md.logit_bias_index), md.logit_bias_values, accumulate=True)
        if not md.no_penalties:
            apply_penalties(logits, md)
