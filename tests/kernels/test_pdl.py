"""The PDL launch switches (tokenmill/kernels/pdl.py); the GPU chains themselves are checked in check_pdl_chain."""
from __future__ import annotations

import pytest
import torch

from tokenmill.kernels import pdl


def test_early_kinds_parse_lists_and_all():
    assert pdl._early_kinds("") == frozenset()
    assert pdl._early_kinds(" attention, norm ") == {"attention", "norm"}
    assert pdl._early_kinds("all") == set(pdl.KINDS)


def test_unknown_early_kind_is_named():
    with pytest.raises(ValueError, match=r"TOKENMILL_PDL_EARLY.*'attn'"):
        pdl._early_kinds("attn,norm")


def test_no_pdl_off_cuda(monkeypatch):
    monkeypatch.setenv("TOKENMILL_PDL_EARLY", "all")
    assert pdl.launch_kwargs(torch.device("cpu"), "gemv") == {"PDL": 0}
