"""Speculative decoding: drafters behind one interface (`Proposer`), built from a SpeculativeConfig.

The model runner asks the proposer for up to k drafts per decoding request after each step; the scheduler budgets
them (k + 1 tokens per request) and the runner verifies all k + 1 positions in one forward (layers/rejection_sampler).
"""
from __future__ import annotations

import torch

from tokenmill.spec_decode.proposer import DraftStep, NgramProposer, Proposer
from tokenmill.spec_decode.suffix import SuffixProposer


def make_proposer(config, device: torch.device, kv_dtypes: dict) -> Proposer:
    """The drafter of `config.speculative_config` (a TokenmillConfig's); kv_dtypes maps kv_cache_dtype names to
    torch dtypes (a draft model's cache follows the target's setting)."""
    spec = config.speculative_config
    if spec.method == "ngram":
        return NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max)
    if spec.method == "suffix":
        return SuffixProposer(spec)
    if spec.method == "draft_model":
        from tokenmill.spec_decode.draft_model import DraftModelProposer
        return DraftModelProposer(config, device, kv_dtypes)
    if spec.method in ("eagle", "eagle3"):
        from tokenmill.spec_decode.eagle import EagleProposer
        return EagleProposer(config, device, kv_dtypes)
    raise ValueError(f"speculative method {spec.method!r} has no proposer")


__all__ = ["DraftStep", "NgramProposer", "Proposer", "SuffixProposer", "make_proposer"]
