"""The batch bitmask apply must mask exactly what xgrammar's reference apply masks, on both paths."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import triton

from tokenmill.kernels import triton_bitmask
from tokenmill.kernels.triton_bitmask import apply_bitmask


def _case(b, v, constrained, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(b, v, generator=g)
    words = -(-v // 32)
    bitmask = torch.full((b, words), -1, dtype=torch.int32)
    rand = torch.randint(-(2**31), 2**31 - 1, (len(constrained), words), generator=g, dtype=torch.int64)
    bitmask[constrained] = rand.to(torch.int32)
    ref = logits.clone()
    for r in constrained:  # the definition, bit by bit
        bits = [(int(bitmask[r, t // 32]) >> (t % 32)) & 1 for t in range(v)]
        ref[r, torch.tensor(bits) == 0] = float("-inf")
    return logits, bitmask, ref


@pytest.mark.parametrize("b,v,constrained", [(4, 100, [1, 3]), (3, 4096 + 33, [0, 1, 2]), (5, 64, [])])
def test_cpu_path_matches_definition(b, v, constrained):
    logits, bitmask, ref = _case(b, v, constrained, seed=v)
    apply_bitmask(logits, bitmask, np.array(constrained, dtype=np.int64))
    assert torch.equal(logits, ref)


@pytest.mark.parametrize("b,v,constrained", [(4, 100, [1, 3]), (2, 4096 + 33, [1])])
def test_triton_kernel_matches_definition(b, v, constrained):
    # Runs compiled on a GPU, in Triton's interpreter on the CPU (tests/kernels/conftest.py).
    logits, bitmask, ref = _case(b, v, constrained, seed=b)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    logits, bitmask = logits.to(dev), bitmask.to(dev)
    triton_bitmask._apply_bitmask_kernel[(b, triton.cdiv(v, 4096))](logits, bitmask, v, logits.stride(0),
                                                                     bitmask.stride(0), BLOCK=4096)
    assert torch.equal(logits.cpu(), ref)


def test_rejects_a_bitmask_that_does_not_cover_the_logits():
    with pytest.raises(ValueError, match="does not cover"):
        apply_bitmask(torch.zeros(2, 100), torch.zeros(2, 3, dtype=torch.int32))
