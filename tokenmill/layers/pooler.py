"""Poolers: a request's hidden states -> one vector, what a pooling (embedding) model returns instead of tokens.

The model runner calls a pooler in place of the sampler when the model runs as a pooling model. No public pooling
API uses this yet (`--runner pooling` is refused by the parser); this is the seam such an API plugs into.
"""
from __future__ import annotations

import abc

import torch
import torch.nn.functional as F


class Pooler(abc.ABC):
    """Pools each request's span of the step's hidden states.

    Contract: `hidden` is [T, H], the final hidden states of the step's tokens (request after request);
    `query_start_loc` is a [B + 1] int64 tensor on hidden's device, request i owning rows
    [query_start_loc[i], query_start_loc[i + 1]) (each span non-empty and covering the request's whole prompt:
    the runner pools a request only when its prompt was computed in one step). Returns [B, H] float32; with
    `normalize`, each row has unit L2 norm. No host sync.
    """

    def __init__(self, normalize: bool = False) -> None:
        self.normalize = normalize

    def __call__(self, hidden: torch.Tensor, query_start_loc: torch.Tensor) -> torch.Tensor:
        out = self.pool(hidden, query_start_loc).float()
        return F.normalize(out, p=2, dim=-1) if self.normalize else out

    @abc.abstractmethod
    def pool(self, hidden: torch.Tensor, query_start_loc: torch.Tensor) -> torch.Tensor:
        """[B, H] (any float dtype) before normalisation."""


class LastTokenPooler(Pooler):
    """The hidden state of each request's last token (decoder embedding models: e5-mistral, Qwen3-Embedding)."""

    def pool(self, hidden: torch.Tensor, query_start_loc: torch.Tensor) -> torch.Tensor:
        return hidden[query_start_loc[1:] - 1]


class FirstTokenPooler(Pooler):
    """The hidden state of each request's first token (CLS pooling)."""

    def pool(self, hidden: torch.Tensor, query_start_loc: torch.Tensor) -> torch.Tensor:
        return hidden[query_start_loc[:-1]]


class MeanPooler(Pooler):
    """The mean of each request's hidden states, summed in float32 (one index_add over the tokens)."""

    def pool(self, hidden: torch.Tensor, query_start_loc: torch.Tensor) -> torch.Tensor:
        lens = query_start_loc[1:] - query_start_loc[:-1]
        seg = torch.repeat_interleave(torch.arange(len(lens), device=hidden.device), lens,
                                      output_size=hidden.shape[0])
        sums = torch.zeros(len(lens), hidden.shape[1], dtype=torch.float32, device=hidden.device)
        sums.index_add_(0, seg, hidden.float())
        return sums / lens.unsqueeze(1).to(torch.float32)


POOLERS: dict[str, type[Pooler]] = {"LAST": LastTokenPooler, "CLS": FirstTokenPooler, "MEAN": MeanPooler}


def make_pooler(pooling_type: str, normalize: bool = False) -> Pooler:
    """The pooler named by vLLM's pooling types (LAST, CLS, MEAN; case-insensitive)."""
    cls = POOLERS.get(pooling_type.upper())
    if cls is None:
        raise ValueError(f"Unknown pooling type {pooling_type!r}: one of {', '.join(POOLERS)}.")
    return cls(normalize)
