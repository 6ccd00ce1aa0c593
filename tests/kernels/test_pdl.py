"""The PDL launch arguments (tokenmill/kernels/pdl.py); the GPU chains themselves are checked in check_pdl_chain."""
from __future__ import annotations

import pytest
import torch

from tokenmill.kernels import pdl


def test_only_the_products_trigger_early_by_default():
    assert pdl.EARLY_KINDS == {"gemv"} and pdl.EARLY_KINDS <= set(pdl.KINDS)


def test_launch_mode_is_scoped_and_checks_kinds():
    with pdl.launch_mode(enabled=False, early=pdl.KINDS):
        assert pdl._early == set(pdl.KINDS) and not pdl._enabled
        with pdl.launch_mode(early=()):
            assert pdl._early == frozenset() and pdl._enabled
        assert pdl._early == set(pdl.KINDS) and not pdl._enabled
    assert pdl._early == pdl.EARLY_KINDS and pdl._enabled
    with pytest.raises(ValueError, match=r"unknown kernel kind.*'attn'"):
        with pdl.launch_mode(early=("attn", "norm")):
            pass
    assert pdl._early == pdl.EARLY_KINDS


def test_no_pdl_off_cuda():
    with pdl.launch_mode(early=pdl.KINDS):
        assert pdl.launch_kwargs(torch.device("cpu"), "gemv") == {"PDL": 0}
    assert not pdl.pdl_enabled(torch.device("cpu"))


@pytest.mark.gpu
def test_launch_kwargs_on_a_pdl_device():
    dev = torch.device("cuda")
    if not pdl.pdl_enabled(dev):
        pytest.skip("programmatic dependent launch needs compute capability 9.0+")
    assert pdl.launch_kwargs(dev, "gemv") == {"PDL": 2, "launch_pdl": True}
    assert pdl.launch_kwargs(dev, "attention") == {"PDL": 1, "launch_pdl": True}
    with pdl.launch_mode(enabled=False):
        assert pdl.launch_kwargs(dev, "gemv") == {"PDL": 0}
