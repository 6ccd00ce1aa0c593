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
# _gemv_config: the same product choice as `linear`, for the out= variant below.
from tokenmill.layers.linear_ops import _gemv_config, linear
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
        self._packed, self._packed_rows = None, 0  # enable_fp16_copies: FBGEMM's packed fp16 copy
        self._half: torch.Tensor | None = None  # and a plain fp16 one
        self._half_rows = 0

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

    def enable_fp16_copies(self, packed_rows: int, half_rows: int) -> None:
        """CPU products of at most packed_rows rows (one rank) run through FBGEMM's fp16-weight linear on a packed
        fp16 copy of the weight (fp32 activations, sums and logits; needs kernels.cpu_features.fbgemm_fp16_rows());
        larger ones of at most half_rows rows through a plain fp16 product (fp16 activations and logits). An
        approximate weight format's choice: see GGUFCpuConfig.process_model_after_loading. The copies are taken now:
        weights loaded later are not in them. The fp32 weight stays for the embedding lookups and larger products."""
        w = self.weight.detach()
        self._packed = torch.ops.quantized.linear_prepack_fp16(w, None) if packed_rows > 0 else None
        self._half = w.to(torch.float16) if half_rows > packed_rows else None
        self._packed_rows, self._half_rows = packed_rows, half_rows

    def discard_weight_copies(self) -> None:
        """The weight is about to be replaced (sleep level 2, then a weight sync): the fp16 copies would go on
        answering with the old one, so they go; products run on the fp32 weight from now on."""
        self._packed = self._half = None
        self._packed_rows = self._half_rows = 0

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """hidden [T, H] -> logits [T, vocab], identical on every rank (gathered over the TP group). out: a
        contiguous [T, vocab] tensor of hidden's dtype to write them into (the CUDA graphs' shared logits buffer);
        it is then the result."""
        if self.tp_size == 1:
            rows = hidden.shape[0]
            if out is None and hidden.dtype == torch.float32:
                if self._packed is not None and rows <= self._packed_rows:
                    return torch.ops.quantized.linear_dynamic_fp16(hidden.contiguous(), self._packed)
                if self._half is not None and rows <= self._half_rows:
                    # x W^T at every row count: W x^T (as for fp32 below) measured no faster once its output's
                    # transposing copy counts (AVX-512 FP16, 49152 x 576, 2 cores: 16 / 20 / 32 rows 4.2-4.4 /
                    # 4.8-4.9 / 6.6-7.0 ms against 4.0-4.3 / 6.6-6.7 / 7.3-7.4).
                    return F.linear(hidden.to(torch.float16), self._half).to(hidden.dtype)
            if out is None and not hidden.is_cuda and hidden.dtype == torch.float32 and 2 <= rows <= _CPU_WT_ROWS:
                # The same fp32 product as W x^T, which torch's CPU GEMM runs far faster than x W^T at a few rows
                # of a wide head (2 cores, 49152 x 576: 2 rows 5.6 against 26 ms, 4 rows 6.1 / 21, 16 rows 20 / 28,
                # 64 rows 52 / 60; from ~256 rows x W^T is faster).
                return torch.mm(self.weight, hidden.t()).t().contiguous()
            return linear(hidden, self.weight) if out is None else _linear_into(hidden, self.weight, out)
        logits = tensor_model_parallel_all_gather(linear(hidden, self.weight), -1, self.parallel)
        if out is not None:
            return out.copy_(logits[..., :self.num_embeddings])
        if logits.shape[-1] != self.num_embeddings:  # drop the padding rows' logits (samplers want contiguous rows)
            logits = logits[..., :self.num_embeddings].contiguous()
        return logits


_CPU_WT_ROWS = 64


def _linear_into(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out = x @ weight.T by the kernel `linear` would pick (the gemv where the device's table lists the product,
    else cuBLAS: F.linear without a bias is this same mm), so a graph's logits equal the eager ones."""
    if out.shape != (x.shape[0], weight.shape[0]) or out.dtype != x.dtype or not out.is_contiguous():
        raise ValueError(f"compute_logits: out must be a contiguous {(x.shape[0], weight.shape[0])} {x.dtype} "
                         f"tensor, got {tuple(out.shape)} {out.dtype}")
    cfg = _gemv_config(x, weight, None)
    if cfg is None:
        return torch.mm(x, weight.t(), out=out)
    from tokenmill.kernels.triton_gemv import gemv
    return gemv(x, weight, None, config=cfg, out=out)


class ParallelLMHead(VocabParallelEmbedding):
    """An untied LM head: the same vocabulary split as the embedding; `forward(hidden)` returns gathered logits."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.compute_logits(hidden)
