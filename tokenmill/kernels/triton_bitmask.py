"""Apply an allowed-token bitmask to the logits (structured outputs), for the whole batch at once.

bitmask [B, ceil(V / 32)] int32 covering every logits column: bit j of word w allows token 32 * w + j. Rows that
are not constrained are all ones, so one launch covers a mixed batch without a row-index list (a list would need
its own host->device copy each step, and that copy must not wait for the forward pass in flight).

On CUDA a Triton kernel runs over (row, block of columns). On the CPU only the constrained rows are unpacked, with
numpy; xgrammar's CPU kernel took ~3.5 ms per step for 16 rows of a 49k vocabulary.
"""
from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from tokenmill.kernels.pdl import launch_kwargs, pdl_wait

_BLOCK = 4096


@triton.jit
def _apply_bitmask_kernel(logits_ptr, bitmask_ptr, V, stride_l, stride_b, BLOCK: tl.constexpr,
                          PDL: tl.constexpr = False):
    pdl_wait(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    in_vocab = cols < V
    words = tl.load(bitmask_ptr + row * stride_b + cols // 32, mask=in_vocab, other=-1)
    allowed = ((words >> (cols % 32)) & 1) != 0
    tl.store(logits_ptr + row * stride_l + cols, float("-inf"), mask=in_vocab & ~allowed)


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: np.ndarray | None = None) -> None:
    """In place: logits[r, t] = -inf wherever bitmask row r disallows token t.

    logits [B, V]; bitmask [B, >= ceil(V / 32)] int32 on the logits' device. `rows` (used on the CPU only) lists
    the constrained rows, so the others are skipped there.
    """
    b, v = logits.shape
    if bitmask.shape[0] != b or bitmask.shape[1] * 32 < v:
        raise ValueError(f"apply_bitmask: a bitmask of shape {tuple(bitmask.shape)} does not cover logits of "
                         f"shape {(b, v)}")
    if logits.is_cuda:
        if b:
            _apply_bitmask_kernel[(b, triton.cdiv(v, _BLOCK))](logits, bitmask, v, logits.stride(0),
                                                               bitmask.stride(0), BLOCK=_BLOCK, num_warps=4,
                                                               **launch_kwargs(logits.device, "sampling"))
        return
    idx = torch.from_numpy(np.arange(b) if rows is None else np.asarray(rows, dtype=np.int64))
    if not len(idx):
        return
    packed = bitmask[idx].contiguous().numpy().view(np.uint8)
    disallowed = torch.from_numpy(~np.unpackbits(packed, axis=1, bitorder="little")[:, :v].astype(bool))
    for k, r in enumerate(idx.tolist()):  # in place on row views: a gather + scatter of the rows costs more
        logits[r].masked_fill_(disallowed[k], float("-inf"))
