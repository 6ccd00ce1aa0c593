"""Speculative decoding: drafters behind one interface (`Proposer`), built from a SpeculativeConfig.

The model runner asks the proposer for up to k drafts per decoding request after each step; the scheduler budgets
them (k + 1 tokens per request) and the runner verifies all k + 1 positions in one forward (layers/rejection_sampler).
"""
from __future__ import annotations

from tokenmill.config.speculative import SpeculativeConfig
from tokenmill.spec_decode.proposer import NgramProposer, Proposer
from tokenmill.spec_decode.suffix import SuffixProposer


def make_proposer(config: SpeculativeConfig) -> Proposer:
    if config.method == "ngram":
        return NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
    if config.method == "suffix":
        return SuffixProposer(config)
    raise ValueError(f"speculative method {config.method!r} has no proposer")


__all__ = ["NgramProposer", "Proposer", "SuffixProposer", "make_proposer"]
