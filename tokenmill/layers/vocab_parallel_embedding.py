"""The token embedding and the LM head, with the vocabulary split over the TP ranks.

Rank r holds rows [r * per_rank, (r + 1) * per_rank) of the vocabulary, per_rank = ceil(vocab / tp); rows past the
vocabulary (on the last ranks) are zero padding. The embedding looks up the ids it holds, zeroes the others and
all-reduces; the LM head computes logits for its rows and all-gathers them, so every rank holds the full
[tokens, vocab] logits. With one rank both are exactly `F.embedding` / `F.linear` over the whole table.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.distributed import get_parallel_state
from tokenmill.layers.linear_ops import linear
from tokenmill.distributed.communication_op import (tensor_model_parallel_all_gather,
                                                    tensor_model_parallel_all_reduce)


class VocabParallelEmbedding(nn.Module):
    """ids -> embeddings with the table split by vocabulary rows; `compute_logits` lets a tied LM head share it."""

    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__()
        self.parallel = get_parallel_state()  # the state current at build time is the one this layer talks in
        self.tp_size, self.tp_rank = self.parallel.tp_size, self.parallel.tp_rank
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.per_rank = -(-num_embeddings // self.tp_size)
        self.vocab_start = self.tp_rank * self.per_rank
        self.vocab_end = min(self.vocab_start + self.per_rank, num_embeddings)  # padding rows lie past this
        self.weight = nn.Parameter(torch.empty(self.per_rank, embedding_dim), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        self.weight.full_shape = torch.Size((num_embeddings, embedding_dim))

    def weight_loader(self, param: torch.Tensor, loaded: torch.Tensor, shard_id=None) -> None:
        if loaded.shape != self.weight.full_shape:
            raise ValueError(f"Checkpoint tensor of shape {tuple(loaded.shape)} does not fit the vocabulary table "
                             f"{tuple(self.weight.full_shape)}.")
        n = max(self.vocab_end - self.vocab_start, 0)
        param.data[:n].copy_(loaded[self.vocab_start:self.vocab_start + n])
        param.data[n:].zero_()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(ids, self.weight)
        outside = (ids < self.vocab_start) | (ids >= self.vocab_end)
        local = torch.where(outside, 0, ids - self.vocab_start)
        emb = F.embedding(local, self.weight).masked_fill_(outside.unsqueeze(-1), 0)
        return tensor_model_parallel_all_reduce(emb, self.parallel)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [T, H] -> logits [T, vocab], identical on every rank (gathered over the TP group)."""
        logits = linear(hidden, self.weight)
        if self.tp_size == 1:
            return logits
        logits = tensor_model_parallel_all_gather(logits, -1, self.parallel)
        if logits.shape[-1] != self.num_embeddings:  # drop the padding rows' logits (samplers want contiguous rows)
            logits = logits[..., :self.num_embeddings].contiguous()
        return logits


class ParallelLMHead(VocabParallelEmbedding):
    """An untied LM head: the same vocabulary split as the embedding; `forward(hidden)` returns gathered logits."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.compute_logits(hidden)
