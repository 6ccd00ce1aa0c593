"""Sampler and counter-based RNG tests (CPU, fast). Metadata is built by hand here; the SamplingState-driven
end-to-end tests live in tests/worker/test_sampling_state.py."""
import pytest
import torch

from tokenmill.kernels import sampling_rng
from tokenmill.layers.sampler import (LogprobsTensors, Sampler, SamplingMetadata, apply_min_p, apply_top_k_top_p,
                                      compute_prompt_logprobs)

V = 50
NEG = float("-inf")


def logits_(b, v=V, seed=0):
    return torch.randn(b, v, generator=torch.Generator().manual_seed(seed)) * 2


def greedy_md(**kw):
    return SamplingMetadata(all_greedy=True, all_random=False, **kw)


def random_md(b, temperature=1.0, seeds=None, positions=None, **kw):
    seeds = torch.arange(b) + 100 if seeds is None else torch.as_tensor(seeds)
    positions = torch.zeros(b, dtype=torch.long) if positions is None else torch.as_tensor(positions)
    temp = torch.as_tensor(temperature, dtype=torch.float32).expand(b).clone()
    return SamplingMetadata(all_greedy=False, all_random=True, temperature=temp, seeds=seeds, positions=positions,
                            **kw)


def sample(logits, md):
    return Sampler()(logits.clone(), md)


# ----- RNG -----

def test_rng_uniform_statistics():
    n = 100_000
    u = sampling_rng.uniform(torch.tensor([1, 2, 1, -7]), torch.tensor([0, 0, 1, 1 << 40]), n, "cpu")
    assert u.dtype == torch.float32 and u.shape == (4, n)
    assert 0 < u.min() and u.max() < 1
    assert torch.allclose(u.mean(1), torch.full((4,), 0.5), atol=0.005)
    hist = torch.stack([torch.histc(r, bins=20, min=0, max=1) for r in u])
    chi2 = ((hist - n / 20) ** 2 / (n / 20)).sum(1)  # 19 dof: mean 19, 1e-4 tail ~ 50
    assert (chi2 < 50).all(), chi2
    # Rows for different seeds / positions, and adjacent columns of one row, are decorrelated.
    assert (torch.corrcoef(u) - torch.eye(4)).abs().max() < 0.02
    assert abs(torch.corrcoef(torch.stack([u[0, :-1], u[0, 1:]]))[0, 1]) < 0.02


def test_rng_is_pure_and_pinned():
    a = sampling_rng.random_bits(torch.tensor([5, 9]), torch.tensor([3, 4]), 16, "cpu")
    b = sampling_rng.random_bits(torch.tensor([9, 7, 5]), torch.tensor([4, 0, 3]), 16, "cpu")
    assert torch.equal(a[0], b[2]) and torch.equal(a[1], b[0])  # a row depends only on its own (seed, pos)
    assert a.min() >= 0 and a.max() < 2 ** 32
    assert len(set(a[0].tolist())) == 16  # distinct within a row: the mix is a bijection
    # Golden values: changing the hash changes every seeded sample in the wild, so it must be deliberate.
    assert sampling_rng.random_bits(torch.tensor([0]), torch.tensor([0]), 4, "cpu")[0].tolist() == \
        [1702623729, 3509718413, 3044512414, 1437021296]
    assert sampling_rng.random_bits(torch.tensor([12345]), torch.tensor([7]), 4, "cpu")[0].tolist() == \
        [421758611, 500124850, 3886310025, 1777039895]


def race_case(device="cpu"):
    x = logits_(5, v=3000, seed=9).to(device)
    md = random_md(5, 1.0, seeds=[1, -2, 3 << 40, 4, 5], positions=[0, 9, 2, 77, 1 << 33], top_p=torch.full((5,), 0.95))
    for f in ("temperature", "seeds", "positions", "top_p"):
        setattr(md, f, getattr(md, f).to(device))
    return x, md


def test_race_argmax_matches_sampler():
    x, md = race_case()
    plain = random_md(5, 1.0, md.seeds, md.positions)
    assert torch.equal(sampling_rng.race_argmax(x, md.seeds, md.positions), sample(x, plain).sampled_token_ids)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (compiling on CPU takes ~20 s)")
def test_fused_noise_is_bit_identical():
    x, md = race_case("cuda")
    assert torch.equal(Sampler(fuse_noise=True)(x.clone(), md).sampled_token_ids, sample(x, md).sampled_token_ids)
    s, p = md.seeds[:3], md.positions[:3]
    bits = torch.compile(lambda s, p: sampling_rng.random_bits(s, p, 3000, "cuda"), dynamic=True)(s, p)
    assert torch.equal(bits, sampling_rng.random_bits(s, p, 3000, "cuda"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_rng_cpu_cuda_identical():
    s, p = torch.tensor([1, -3, 1 << 50]), torch.tensor([0, 7, 123])
    assert torch.equal(sampling_rng.random_bits(s, p, 1000, "cpu"),
                       sampling_rng.random_bits(s, p, 1000, "cuda").cpu())


# ----- greedy / filters -----

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_is_argmax(dtype):
    x = logits_(6).to(dtype)
    out = sample(x, greedy_md())
    assert torch.equal(out.sampled_token_ids, x.float().argmax(-1)) and out.logprobs is None


def ref_keep(logits, k=None, p=None, min_p=None):
    """Probability-space reference: which tokens survive min_p, top-k and top-p (float64, per row)."""
    keep = torch.ones_like(logits, dtype=torch.bool)
    for i, row in enumerate(logits.double()):
        probs = row.softmax(-1)
        if min_p is not None:
            keep[i] &= probs >= min_p[i] * probs.max()
        if k is not None and 0 < k[i] < len(row):
            keep[i] &= row >= row.topk(int(k[i])).values[-1]
        if p is not None:
            q = torch.where(keep[i], probs, 0.0)
            q = q / q.sum()
            order = q.argsort(descending=True)
            before = q[order].cumsum(0) - q[order]  # mass strictly above each token
            kept = torch.zeros_like(keep[i])
            kept[order] = before < p[i]
            keep[i] &= kept
    return keep


@pytest.mark.parametrize("use_k,use_p", [(True, False), (False, True), (True, True)])
def test_top_k_top_p_match_reference(use_k, use_p):
    x = logits_(16, seed=1)
    k = torch.tensor([0, 1, 2, 5, 10, 49, 50, 3] * 2) if use_k else None
    p = torch.tensor([1.0, 0.9, 0.5, 0.1, 0.99, 0.3, 0.7, 0.05] * 2) if use_p else None
    y = x.clone()
    apply_top_k_top_p(y, k, p, max_top_k=int(k.max()) if use_k else 0)
    assert torch.equal(torch.isfinite(y), ref_keep(x, k, p))
    assert torch.equal(y[torch.isfinite(y)], x[torch.isfinite(y)])  # survivors are untouched
    assert torch.isfinite(y).sum(-1).min() >= 1


def test_min_p_matches_reference():
    x = logits_(8, seed=2)
    mp = torch.tensor([0.0, 0.01, 0.05, 0.1, 0.3, 0.5, 0.9, 1.0])
    y = x.clone()
    apply_min_p(y, mp)
    assert torch.equal(torch.isfinite(y), ref_keep(x, min_p=mp))


def test_sampled_tokens_respect_filters():
    x = logits_(64, seed=3)
    k = torch.full((64,), 3)
    md = random_md(64, 0.9, top_k=k, max_top_k=3, top_p=torch.full((64,), 0.8), min_p=torch.full((64,), 0.05))
    tok = sample(x, md).sampled_token_ids
    keep = ref_keep(x / 0.9, k, md.top_p, md.min_p)
    assert keep.gather(1, tok[:, None]).all()


# ----- random sampling -----

def test_seeded_row_is_batch_invariant():
    x = logits_(8, seed=4)
    alone = random_md(1, 0.8, seeds=[42], positions=[5], top_p=torch.tensor([0.9]))
    t_alone = sample(x[:1], alone).sampled_token_ids[0]
    for order_seed in range(5):
        perm = torch.randperm(8, generator=torch.Generator().manual_seed(order_seed))
        seeds = torch.randint(0, 1000, (8,), generator=torch.Generator().manual_seed(order_seed))
        pos = torch.randint(0, 100, (8,), generator=torch.Generator().manual_seed(order_seed + 1))
        temp = torch.rand(8, generator=torch.Generator().manual_seed(order_seed)) + 0.5
        top_p = torch.ones(8)
        seeds[0], pos[0], temp[0], top_p[0] = 42, 5, 0.8, 0.9
        md = random_md(8, temp[perm], seeds=seeds[perm], positions=pos[perm], top_p=top_p[perm],
                       top_k=torch.tensor([0, 0, 3, 0, 5, 0, 0, 0])[perm], max_top_k=5)
        out = sample(x[perm], md).sampled_token_ids
        assert out[(perm == 0).nonzero()[0, 0]] == t_alone


def test_different_seeds_differ():
    x = torch.zeros(64, 1000)  # uniform distribution: a shared seed would give equal tokens
    a = sample(x, random_md(64, seeds=torch.full((64,), 1), positions=torch.arange(64))).sampled_token_ids
    b = sample(x, random_md(64, seeds=torch.full((64,), 2), positions=torch.arange(64))).sampled_token_ids
    c = sample(x, random_md(64, seeds=torch.full((64,), 1), positions=torch.arange(64))).sampled_token_ids
    assert torch.equal(a, c) and (a != b).float().mean() > 0.9
    assert len(set(a.tolist())) > 50  # different positions of one seed differ too


@pytest.mark.parametrize("temp,k,p", [(0.7, None, None), (1.3, 3, None), (1.0, None, 0.8), (0.9, 4, 0.9)])
def test_empirical_distribution_matches_softmax(temp, k, p):
    n, row = 40_000, torch.tensor([1.0, 0.5, 0.0, -0.5, 2.0, -1.0])
    x = row.expand(n, -1).clone()
    kw = {}
    if k is not None:
        kw.update(top_k=torch.full((n,), k), max_top_k=k)
    if p is not None:
        kw["top_p"] = torch.full((n,), p)
    tok = sample(x, random_md(n, temp, seeds=torch.full((n,), 7), positions=torch.arange(n), **kw)).sampled_token_ids
    keep = ref_keep((row / temp)[None], None if k is None else [k], None if p is None else [p])[0]
    probs = torch.where(keep, (row / temp).double().softmax(-1), 0.0)
    probs /= probs.sum()
    counts = torch.bincount(tok, minlength=6).double()
    assert (counts[~keep] == 0).all()
    exp = probs[keep] * n
    chi2 = (((counts[keep] - exp) ** 2) / exp).sum()
    assert chi2 < 25, (chi2, counts, exp)  # <= 5 dof; 25 is a ~1e-4 tail


def test_mixed_greedy_and_random_batch():
    x = logits_(4, seed=5)
    md = random_md(4, torch.tensor([1.0, 1.0, 0.5, 1.0]))
    md.all_random, md.greedy_mask = False, torch.tensor([True, False, False, True])
    out = sample(x, md).sampled_token_ids
    assert out[0] == x[0].argmax() and out[3] == x[3].argmax()


# ----- processors -----

def test_penalties_match_hand_reference():
    x = torch.tensor([[2.0, -1.0, 0.5, -3.0, 1.0], [1.0, 1.0, -1.0, 0.0, 4.0]])
    counts = torch.tensor([[2.0, 1.0, 0.0, 0.0, 0.0], [0.0, 0.0, 3.0, 0.0, 1.0]])
    prompt = torch.tensor([[False, False, True, True, False], [True, False, False, False, False]])
    md = greedy_md(frequency_penalties=torch.tensor([0.5, 0.0]), presence_penalties=torch.tensor([0.25, 1.0]),
                   repetition_penalties=torch.tensor([2.0, 1.5]), output_token_counts=counts,
                   prompt_token_mask=prompt, max_num_logprobs=0, logprobs_mode="processed_logits")
    ref = x.clone()
    for b in range(2):
        for t in range(5):
            if prompt[b, t] or counts[b, t] > 0:
                r = md.repetition_penalties[b]
                ref[b, t] = ref[b, t] / r if ref[b, t] > 0 else ref[b, t] * r
            ref[b, t] -= md.frequency_penalties[b] * counts[b, t]
            ref[b, t] -= md.presence_penalties[b] * (counts[b, t] > 0)
    out = sample(x, md)
    assert torch.allclose(out.logprobs.logprobs[:, 0], ref.gather(1, out.sampled_token_ids[:, None])[:, 0])
    assert torch.equal(out.sampled_token_ids, ref.argmax(-1))
    y = x.clone()
    Sampler._process(y, md)
    assert torch.allclose(y, ref)


def test_bias_allowed_banned():
    x = torch.zeros(3, 6)
    x[:, 0] = 5.0
    md = greedy_md(logit_bias_index=torch.tensor([[0, 0], [4, 4]]), logit_bias_values=torch.tensor([3.0, 3.0]),
                   allowed_rows=torch.tensor([1]), allowed_mask=torch.tensor([[True, True, False, True, True, False]]),
                   bad_words_index=torch.tensor([[2], [0]]), min_tokens_index=torch.tensor([[2], [1]]))
    y = x.clone()
    Sampler._process(y, md)
    assert y[0, 4] == 6.0 and y[0, 0] == 5.0  # bias entries accumulate
    assert torch.isinf(y[1, [0, 1, 3, 4]]).all() and y[1, 2] == 0 and y[1, 5] == 0
    assert torch.isinf(y[2, :2]).all() and torch.isfinite(y[2, 2:]).all()
    assert sample(x, md).sampled_token_ids.tolist() == [4, 2, 2]


# ----- logprobs -----

@pytest.mark.parametrize("n", [0, 3, -1])
def test_logprobs_values_ranks_topk(n):
    x = logits_(5, seed=6)
    x[0, 1] = x[0, 2] = x[0].max() + 1  # a tie at the top
    md = random_md(5, 0.5, max_num_logprobs=n)
    out = sample(x, md)
    lp, tok = torch.log_softmax(x, -1), out.sampled_token_ids
    k = V if n == -1 else n
    t = out.logprobs
    assert t.token_ids.shape == (5, k + 1) and t.logprobs.dtype == torch.float32
    assert torch.equal(t.token_ids[:, 0], tok)
    assert torch.allclose(t.logprobs, lp.gather(1, t.token_ids))
    assert torch.equal(t.ranks, (lp > lp.gather(1, tok[:, None])).sum(-1) + 1)
    if k:
        assert (t.logprobs[:, 1:].diff(dim=1) <= 0).all()
        assert torch.allclose(t.logprobs[:, 1], lp.max(-1).values)
    lists = t.tolists()
    assert len(lists) == 5 and lists.token_ids[2] == t.token_ids[2].tolist() and lists.ranks == t.ranks.tolist()


def test_logprobs_modes():
    x = logits_(4, seed=7)
    mk = lambda mode: random_md(4, 0.5, max_num_logprobs=2, logprobs_mode=mode,  # noqa: E731
                                top_k=torch.full((4,), 2), max_top_k=2)
    raw = sample(x, mk("raw_logprobs"))
    assert torch.allclose(raw.logprobs.logprobs, torch.log_softmax(x, -1).gather(1, raw.logprobs.token_ids))
    rl = sample(x, mk("raw_logits"))
    assert torch.allclose(rl.logprobs.logprobs, x.gather(1, rl.logprobs.token_ids))
    proc = sample(x, mk("processed_logprobs"))
    y = x / 0.5
    y[y < y.topk(2).values[:, -1:]] = NEG
    assert torch.allclose(proc.logprobs.logprobs, torch.log_softmax(y, -1).gather(1, proc.logprobs.token_ids))
    pl = sample(x, mk("processed_logits"))
    assert torch.allclose(pl.logprobs.logprobs, y.gather(1, pl.logprobs.token_ids))
    assert torch.equal(raw.sampled_token_ids, pl.sampled_token_ids)  # the mode never changes the sample


def test_prompt_logprobs():
    x = logits_(7, seed=8).bfloat16()
    tgt = torch.tensor([3, 1, 4, 1, 5, 9, 2])
    out = compute_prompt_logprobs(x, tgt, 2)
    lp = torch.log_softmax(x.float(), -1)
    assert isinstance(out, LogprobsTensors) and out.token_ids.shape == (7, 3)
    assert torch.equal(out.token_ids[:, 0], tgt)
    assert torch.allclose(out.logprobs, lp.gather(1, out.token_ids))
    assert torch.equal(out.ranks, (lp > lp.gather(1, tgt[:, None])).sum(-1) + 1)
    assert compute_prompt_logprobs(x, tgt, -1).token_ids.shape == (7, V + 1)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_plain_temperature_path_is_bit_identical(dtype):
    # Temperature-only sampling goes straight to the race kernel on model-dtype logits; the tokens must equal the
    # torch path's (upcast, divide, hash noise, argmax).
    x = logits_(8, v=151936, seed=4).to("cuda", dtype)
    md = random_md(8, 1.0, seeds=list(range(-4, 4)), positions=[0, 1, 2, 3, 1 << 33, 5, 6, 7])
    md.temperature = torch.tensor([0.6, 1.7, 0.9, 1.0, 0.25, 1.1, 3.0, 0.8])
    for f in ("temperature", "seeds", "positions"):
        setattr(md, f, getattr(md, f).to("cuda"))
    assert torch.equal(Sampler(fuse_noise=True)(x.clone(), md).sampled_token_ids,
                       Sampler(fuse_noise=False)(x.clone(), md).sampled_token_ids)
