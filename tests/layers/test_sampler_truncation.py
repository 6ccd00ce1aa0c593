"""min-p / top-k / top-p: the sampled distribution is exactly vLLM v1's, on the torch path (large samples, CPU) and
through Sampler(fuse_noise=True), which runs the sort-free Triton kernel (under TRITON_INTERPRET without CUDA).

The oracle is written from the rules (float64, O(V^2), no sort): min-p on the temperature-scaled distribution
(vLLM v1 runs it as an argmax-invariant logits processor, before top-k / top-p), then top-k keeping every tie of the
k-th value, then top-p on the renormalised survivors keeping a token when the mass strictly above it is < top_p.
"""
from __future__ import annotations

import math

import pytest
import torch

from tokenmill.layers.sampler import Sampler, SamplingMetadata

# Pearson chi-square bounds at the 1e-4 upper tail, by degrees of freedom: a correct sampler fails one test with
# probability 1e-4 over random seeds (the seeds are fixed, so each outcome is deterministic).
_CHI2_1E4 = {1: 15.14, 2: 18.42, 3: 21.11, 4: 23.51, 5: 25.74, 6: 27.86, 7: 29.88}


def ref_keep(y: torch.Tensor, k: int = 0, p: float = 1.0, min_p: float = 0.0) -> torch.Tensor:
    y = y.double()
    keep = y >= y.max() + (math.log(min_p) if min_p > 0 else -math.inf)
    above = (y[None, :] > y[:, None]) & keep[None, :]
    if k > 0:
        keep &= above.sum(1) < k
        above &= keep[None, :]
    if p < 1:
        e = torch.where(keep, (y - y.max()).exp(), 0.0)
        keep &= (above.double() * e[None, :]).sum(1) < p * e.sum()
    return keep


def md_for(n, temp, k=None, p=None, min_p=None, seed=7, **kw):
    full = lambda v, dt: None if v is None else torch.full((n,), v, dtype=dt)  # noqa: E731
    return SamplingMetadata(all_greedy=False, all_random=True, temperature=torch.full((n,), float(temp)),
                            seeds=torch.full((n,), seed), positions=torch.arange(n), top_k=full(k, torch.int64),
                            max_top_k=k or 0, top_p=full(p, torch.float32), min_p=full(min_p, torch.float32), **kw)


ROW = torch.tensor([1.2, 0.5, 0.5, -0.3, 2.0, -1.0, 0.1, -2.4])   # a tie at 0.5, straddled by some boundaries


@pytest.mark.parametrize("temp,k,p,min_p", [
    (0.6, None, 0.95, None), (0.7, 20, 0.8, None), (0.6, None, None, 0.05), (1.0, 3, None, None),
    (1.0, 2, None, None), (0.9, 4, 0.7, 0.1), (1.5, None, 0.6, 0.2), (1.0, 6, 0.999, None)])
def test_torch_path_frequencies_match_exact_probabilities(temp, k, p, min_p):
    n = 40_000
    tok = Sampler()(ROW.expand(n, -1).clone(), md_for(n, temp, k, p, min_p)).sampled_token_ids
    y = ROW / temp
    keep = ref_keep(y, k or 0, 1.0 if p is None else p, min_p or 0.0)
    probs = torch.where(keep, (y.double() - y.max()).exp(), 0.0)
    probs /= probs.sum()
    counts = torch.bincount(tok, minlength=len(ROW)).double()
    assert (counts[~keep] == 0).all(), (counts, keep)   # nothing outside the kept set, ever
    dof = int(keep.sum()) - 1
    if dof == 0:
        return
    exp = probs[keep] * n
    chi2 = float(((counts[keep] - exp) ** 2 / exp).sum())
    assert chi2 < _CHI2_1E4[dof], (chi2, counts, exp)


def test_min_p_runs_before_top_p():
    # min-p first (vLLM v1) renormalises top-p's distribution: here top_p 0.8 keeps {4, 0} after min_p 0.3 dropped
    # the tail, but would also keep token 1 or 2 on the full distribution.
    y = ROW.clone()
    tok = Sampler()(ROW.expand(2000, -1).clone(), md_for(2000, 1.0, None, 0.8, 0.3)).sampled_token_ids
    assert set(tok.tolist()) == {0, 4}
    assert ref_keep(y, 0, 0.8, 0.3).nonzero().flatten().tolist() == [0, 4]
    assert int(ref_keep(y, 0, 0.8, 0.0).sum()) > 2


def _mixed_batch(mode):
    g = torch.Generator().manual_seed(1)
    b, v = 6, 96
    logits = torch.randn(b, v, generator=g) * 2
    logits[2] = torch.randint(0, 3, (v,), generator=g).float()
    greedy = torch.tensor([False, True, False, False, False, False])
    md = SamplingMetadata(
        all_greedy=False, all_random=False, greedy_mask=greedy,
        temperature=torch.tensor([0.6, 1.0, 0.8, 1.3, 0.7, 1.0]), seeds=torch.arange(b) * 13 - 20,
        positions=torch.tensor([0, 3, 1 << 35, 7, 2, 9]), top_k=torch.tensor([0, 0, 5, 20, 3, 0]), max_top_k=20,
        top_p=torch.tensor([0.95, 1.0, 0.5, 0.8, 1.0, 0.3]), min_p=torch.tensor([0.0, 0.0, 0.0, 0.05, 0.2, 0.0]),
        frequency_penalties=torch.tensor([0.0, 0.5, 0.0, 0.2, 0.0, 0.0]), presence_penalties=None,
        repetition_penalties=None, output_token_counts=torch.zeros(b, v).index_fill_(1, torch.tensor([4, 9]), 2.0),
        max_num_logprobs=3, logprobs_mode=mode)
    return logits, md


@pytest.mark.parametrize("mode", ["processed_logprobs", "processed_logits", "raw_logprobs"])
def test_fused_sampler_equals_torch_path_with_penalties_greedy_rows_and_logprobs(mode):
    logits, md = _mixed_batch(mode)
    fused = Sampler(fuse_noise=True)(logits.clone(), md)
    ref = Sampler(fuse_noise=False)(logits.clone(), md)
    assert torch.equal(fused.sampled_token_ids, ref.sampled_token_ids)
    assert torch.equal(fused.logprobs.token_ids, ref.logprobs.token_ids)
    assert torch.equal(fused.logprobs.ranks, ref.logprobs.ranks)
    assert torch.allclose(fused.logprobs.logprobs, ref.logprobs.logprobs, atol=1e-5)
    top3 = fused.logprobs.logprobs[4, 1:].double().exp().sum()   # row 4 keeps at most 3 tokens (top_k 3)
    if mode == "processed_logprobs":   # the truncated distribution: its 3 best tokens carry all the mass
        assert abs(float(top3) - 1) < 1e-5
    elif mode == "raw_logprobs":
        assert float(top3) < 0.9


def test_fused_sampler_reads_model_dtype_logits_without_processing():
    logits = (torch.randn(4, 64, generator=torch.Generator().manual_seed(2)) * 2).bfloat16()
    md = md_for(4, 0.7, 20, 0.8)
    md.top_k[1], md.top_p[2] = 0, 1.0
    assert torch.equal(Sampler(fuse_noise=True)(logits.clone(), md).sampled_token_ids,
                       Sampler(fuse_noise=False)(logits.clone(), md).sampled_token_ids)
