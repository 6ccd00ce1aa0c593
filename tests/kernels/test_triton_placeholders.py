"""The in-graph placeholder fill: ids[i] = prev[src[i]] exactly where src[i] >= 0, nothing else touched."""
from __future__ import annotations

import pytest
import torch

from tests.kernels.kernel_check import DEV
from tokenmill.kernels.triton_placeholders import fill_placeholders


@pytest.mark.parametrize("n,n_prev", [(1, 1), (7, 3), (1500, 600)])
def test_fill_placeholders_matches_definition(n, n_prev):
    g = torch.Generator().manual_seed(n)
    ids = torch.randint(0, 50000, (n,), generator=g)
    src = torch.randint(-1, n_prev, (n,), generator=g)
    src[0] = -1
    prev = torch.randint(0, 50000, (n_prev,), generator=g)
    expect = ids.clone()
    for i in range(n):
        if src[i] >= 0:
            expect[i] = prev[src[i]]
    out = ids.to(DEV)
    fill_placeholders(out, src.to(DEV), prev.to(DEV))
    assert torch.equal(out.cpu(), expect)


def test_fill_placeholders_empty_and_all_none():
    ids = torch.arange(5, device=DEV)
    fill_placeholders(ids, torch.full((5,), -1, device=DEV), torch.zeros(1, dtype=torch.long, device=DEV))
    assert ids.tolist() == [0, 1, 2, 3, 4]
    empty = torch.empty(0, dtype=torch.long, device=DEV)
    fill_placeholders(empty, empty, torch.zeros(1, dtype=torch.long, device=DEV))
