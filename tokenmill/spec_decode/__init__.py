"""Speculative decoding: drafters behind one interface (`Proposer`), built from a SpeculativeConfig.

The model runner asks the proposer for up to k drafts per decoding request after each step; the scheduler budgets
them (k + 1 tokens per request) and the runner verifies all k + 1 positions in one forward (layers/rejection_sampler).
"""
from __future__ import annotations

from tokenmill.spec_decode.proposer import Proposer, make_proposer

__all__ = ["Proposer", "make_proposer"]
