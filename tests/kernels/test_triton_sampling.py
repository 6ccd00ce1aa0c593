"""The Triton exponential-race kernels must pick exactly the tokens of the torch implementation."""
from __future__ import annotations

import pytest
import torch

from tokenmill.kernels import sampling_rng
from tokenmill.kernels.triton_sampling import race_argmax

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _case(b, v, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(b, v, generator=g) * 3).to(dtype)
    logits[0, : v // 3] = float("-inf")  # masked tokens (top-k / top-p) never win
    seeds = torch.tensor([1, -2, 3 << 40, 4, (1 << 63) - 1, -(1 << 63), 77, 5][:b], dtype=torch.int64)
    positions = torch.tensor([0, 9, 2, 77, 1 << 33, 5, 6, 1000][:b], dtype=torch.int64)
    return logits.to(DEV), seeds.to(DEV), positions.to(DEV)


@pytest.mark.parametrize("b,v", [(1, 100), (3, 2048), (5, 4100), (2, 2049)])
def test_race_argmax_equals_torch(b, v):
    logits, seeds, positions = _case(b, v, seed=b * v)
    ref = sampling_rng.race_argmax(logits.float(), seeds, positions)
    assert torch.equal(race_argmax(logits, seeds, positions), ref)
    assert (race_argmax(logits, seeds, positions)[0] >= v // 3).item()


def test_race_argmax_is_a_sample_of_softmax():
    # Over many positions, the empirical frequencies follow softmax(logits).
    logits = torch.tensor([[0.0, 1.0, 2.0, -1.0]], device=DEV).repeat(800, 1)
    seeds = torch.full((800,), 123, dtype=torch.int64, device=DEV)
    positions = torch.arange(800, dtype=torch.int64, device=DEV)
    counts = torch.bincount(race_argmax(logits, seeds, positions).cpu(), minlength=4).float() / 800
    assert torch.allclose(counts, torch.softmax(logits[0].cpu(), -1), atol=0.05)  # deterministic: the hash is fixed


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_race_argmax_large_vocab_on_cuda(dtype):
    logits, seeds, positions = _case(8, 151936, dtype)
    logits = logits.repeat(32, 1)
    seeds, positions = seeds.repeat(32), positions.repeat(32) + torch.arange(256, device=DEV)
    assert torch.equal(race_argmax(logits, seeds, positions),
                       sampling_rng.race_argmax(logits.float(), seeds, positions))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_race_argmax_with_temperature_equals_divided_fp32_logits(dtype):
    # The sampler's fast path hands model-dtype logits and the temperatures to the kernel; the torch path upcasts
    # and divides first. The tokens must be the same.
    logits, seeds, positions = _case(5, 3000, dtype, seed=3)
    temp = torch.tensor([0.7, 1.3, 0.31, 2.0, 1.0], device=DEV)
    ref = sampling_rng.race_argmax(logits.float() / temp[:, None], seeds, positions)
    assert torch.equal(race_argmax(logits, seeds, positions, temp), ref)


def test_race_argmax_flag_and_out():
    """With a flag of 0 the kernels write nothing (a graph's skipped draw); with 1 they write the plain draw into
    `out`, temperature included."""
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(3, 5000, generator=g).to(DEV)
    seeds = torch.tensor([1, -7, 2**40], device=DEV)
    positions = torch.tensor([0, 5, 9], device=DEV)
    temp = torch.tensor([0.5, 1.0, 1.7], device=DEV)
    want = race_argmax(logits, seeds, positions, temp)
    out = torch.full((3,), -5, dtype=torch.long, device=DEV)
    race_argmax(logits, seeds, positions, temp, out=out, flag=torch.zeros(1, dtype=torch.int32, device=DEV))
    assert out.tolist() == [-5, -5, -5]
    got = race_argmax(logits, seeds, positions, temp, out=out, flag=torch.ones(1, dtype=torch.int32, device=DEV))
    assert got.data_ptr() == out.data_ptr() and torch.equal(out, want)
    # temperature 1.0 divides exactly: the same tokens as no temperature at all
    ones = torch.ones(3, device=DEV)
    assert torch.equal(race_argmax(logits, seeds, positions, ones), race_argmax(logits, seeds, positions))
