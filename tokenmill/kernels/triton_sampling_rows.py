"""Row-streaming building blocks shared by the sort-free sampling kernels (kernels/triton_topk_topp and
kernels/triton_topk_select): the order-preserving int32 key of an fp32 value, temperature scaling as torch rounds
it, the exponential race with sampling_rng's counter-based uniforms, and a full-row race draw over a key bound.

Both kernel modules import these; neither imports the other's internals, so the two stay free of import circles.
"""
from __future__ import annotations

import struct

import triton
import triton.language as tl

from tokenmill.kernels.triton_sampling import _log, _mix32, _uniform


def _host_key(x: float) -> int:
    bits = struct.unpack("<i", struct.pack("<f", x))[0]
    return bits ^ ((bits >> 31) & 0x7FFFFFFF)


_KEY_NEG_INF = _host_key(float("-inf"))


@triton.jit
def _key(y):
    """Order-preserving int32 image of an fp32 value; -0.0 and +0.0 share key 0 (they compare equal)."""
    bits = y.to(tl.int32, bitcast=True)
    k = bits ^ ((bits >> 31) & 0x7FFFFFFF)
    return tl.where(k == -1, 0, k)


@triton.jit
def _unkey(k):
    bits = k ^ ((k >> 31) & 0x7FFFFFFF)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _scale(raw, temp, HAS_TEMP: tl.constexpr):
    y = raw.to(tl.float32)
    if HAS_TEMP:  # IEEE division, as torch's logits.div_(temperature) in fp32
        y = tl.math.div_rn(y, temp)
    return y


@triton.jit
def _chunk(row_ptr, start, V, temp, BLOCK: tl.constexpr, HAS_TEMP: tl.constexpr):
    cols = start + tl.arange(0, BLOCK)
    mask = cols < V
    return cols, mask, _scale(tl.load(row_ptr + cols, mask=mask, other=float("-inf")), temp, HAS_TEMP)


@triton.jit
def _prefetch(row_ptr, start, V, BLOCK: tl.constexpr):
    """The raw values of the chunk at `start`: the row loops issue the next chunk's load before working on the
    current one, so one load round trip overlaps each iteration's arithmetic (the loops are latency-bound)."""
    cols = start + tl.arange(0, BLOCK)
    return tl.load(row_ptr + cols, mask=cols < V, other=float("-inf"))


@triton.jit
def _race(y, cols, row_key, SALT_COL: tl.constexpr):
    """y - log(-log u): the race value of each column (sampling_rng's hash and float steps)."""
    return y - _log(-_log(_uniform(row_key, cols, SALT_COL)))


@triton.jit
def _better(g, cols, best, best_i, V):
    """Fold a chunk's race values into the running (best value, first index holding it)."""
    cb = tl.max(g, axis=0)
    ci = tl.min(tl.where(g == cb, cols, V + 1), axis=0)
    take = cb > best
    return tl.where(take, cb, best), tl.where(take, ci, best_i)


@triton.jit
def _draw(row_ptr, V, temp, row_key, lo, SALT_COL: tl.constexpr, BLOCK: tl.constexpr, HAS_TEMP: tl.constexpr,
          COUNT: tl.constexpr = False):
    """(race winner over the columns whose key is >= lo, their count if COUNT else 0)."""
    best = tl.full([], float("-inf"), tl.float32)
    best_i = tl.full([], 0, tl.int32)
    cnt = tl.full([], 0, tl.int32)
    nxt = _prefetch(row_ptr, 0, V, BLOCK)
    for start in range(0, V, BLOCK):
        cur = nxt
        nxt = _prefetch(row_ptr, start + BLOCK, V, BLOCK)
        cols = start + tl.arange(0, BLOCK)
        mask = cols < V
        y = _scale(cur, temp, HAS_TEMP)
        kept = mask & (_key(y) >= lo)
        if COUNT:
            cnt += tl.sum(kept.to(tl.int32), axis=0)
        g = tl.where(kept, _race(y, cols, row_key, SALT_COL), float("-inf"))
        best, best_i = _better(g, cols, best, best_i, V)
    return best_i, cnt


@triton.jit
def _pick(vec, idx, j):
    return tl.sum(tl.where(idx == j, vec, 0), axis=0)


@triton.jit
def _spread(lo, hi, idx, NP: tl.constexpr):
    """NP keys from lo to hi inclusive, evenly spaced (int64 arithmetic: the span can exceed 2**31)."""
    span = hi.to(tl.int64) - lo.to(tl.int64)
    return (lo.to(tl.int64) + span * idx.to(tl.int64) // (NP - 1)).to(tl.int32)


@triton.jit
def _row_temp(temp_ptr, b, HAS_TEMP: tl.constexpr):
    """Row b's temperature (1.0 without temperatures)."""
    if HAS_TEMP:
        return tl.load(temp_ptr + b).to(tl.float32)
    return 1.0


@triton.jit
def _row_key(seeds_ptr, pos_ptr, b, SALT_SEED: tl.constexpr, SALT_POS: tl.constexpr):
    s = tl.load(seeds_ptr + b).to(tl.int64)
    p = tl.load(pos_ptr + b).to(tl.int64)
    k = _mix32((s & 0xFFFFFFFF) ^ SALT_SEED)
    k = _mix32(k ^ ((s >> 32) & 0xFFFFFFFF))
    return _mix32(k ^ ((p & 0xFFFFFFFF) ^ SALT_POS))
