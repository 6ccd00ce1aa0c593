"""The poolers against a direct per-request torch computation (CPU)."""
from __future__ import annotations

import pytest
import torch

from tokenmill.layers.pooler import FirstTokenPooler, LastTokenPooler, MeanPooler, make_pooler

LENS = [3, 1, 5, 2]


def _batch(dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    hidden = (torch.randn(sum(LENS), 8, generator=g) * 3).to(dtype)
    qsl = torch.tensor([0] + LENS).cumsum(0)
    spans = [hidden[int(a):int(b)].float() for a, b in zip(qsl[:-1], qsl[1:])]
    return hidden, qsl, spans


@pytest.mark.parametrize("normalize", [False, True])
@pytest.mark.parametrize("kind", ["LAST", "CLS", "MEAN"])
def test_pooler_matches_a_direct_computation(kind, normalize):
    hidden, qsl, spans = _batch()
    pick = {"LAST": lambda s: s[-1], "CLS": lambda s: s[0], "MEAN": lambda s: s.mean(0)}[kind]
    want = torch.stack([pick(s) for s in spans])
    if normalize:
        want = want / want.norm(dim=-1, keepdim=True)
    got = make_pooler(kind.lower(), normalize)(hidden, qsl)
    assert got.dtype == torch.float32 and got.shape == (len(LENS), 8)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    if normalize:
        torch.testing.assert_close(got.norm(dim=-1), torch.ones(len(LENS)))


def test_mean_of_half_precision_sums_in_float32():
    hidden, qsl, spans = _batch(torch.bfloat16)
    want = torch.stack([s.mean(0) for s in spans])     # spans are the bf16 values upcast
    torch.testing.assert_close(MeanPooler()(hidden, qsl), want, rtol=1e-6, atol=1e-6)
    assert isinstance(make_pooler("last"), LastTokenPooler) and isinstance(make_pooler("Cls"), FirstTokenPooler)


def test_unknown_pooling_type_is_refused():
    with pytest.raises(ValueError, match="STEP"):
        make_pooler("STEP")
