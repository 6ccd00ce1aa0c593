"""Counter-based, stateless random numbers for sampling.

Contract: `uniform(seeds, positions, V, device)[b, j]` is a pure function of (seeds[b], positions[b], j). There is
no generator state, so a request's draw at output position p is the same whatever else is in the batch, in whatever
order, and after preemption / recompute. All the hashing is plain torch int64 arithmetic that cannot overflow
(32-bit lanes times 31-bit odd constants, masked back to 32 bits), so the bits are exact and identical on CPU and
CUDA; the only float step is one exact int -> float32 conversion.

Design: a 32-bit row key is derived once per row from (seed low 32 bits, seed high 32 bits, position) by chaining
a 32-bit mixing finalizer (xorshift-multiply, "prospector"-style constants that happen to be < 2**31). A 32-bit
column key is the same finalizer applied to the column index (cached per (V, device)). Element (b, j) is
mix(row_key[b] ^ col_key[j]). Because mix is a bijection, the V values of one row are all distinct.

Cost note: eagerly, the [B, V] part is ~15 elementwise int64 passes (H200, B=256, V=152k: ~2.8 ms for noise +
argmax). On CUDA the sampler uses tokenmill.kernels.triton_sampling instead, which computes the very same integers
in registers (bit-identical tokens, checked by the tests).
"""
from __future__ import annotations

import torch

_M32 = 0xFFFFFFFF
# Odd multipliers below 2**31: a value < 2**32 times one of these is < 2**63, so int64 multiply is exact.
_C1 = 0x2C1B3C6D
_C2 = 0x297A2D39
# Distinct salts so that the seed-low, seed-high, position and column inputs live in different "domains".
_SALT_SEED = 0x6A09E667
_SALT_POS = 0x3C6EF372
_SALT_COL = 0x510E527F

_col_key_cache: dict[tuple[int, str], torch.Tensor] = {}


def mix32(x: torch.Tensor) -> torch.Tensor:
    """Bijective 32-bit finalizer on an int64 tensor holding values in [0, 2**32). Returns a new tensor."""
    x = x ^ (x >> 15)
    x = (x * _C1) & _M32
    x = x ^ (x >> 12)
    x = (x * _C2) & _M32
    return x ^ (x >> 15)


def _mix32_(x: torch.Tensor) -> torch.Tensor:
    """In-place `mix32` for the big [B, V] tensor (saves allocations)."""
    x.bitwise_xor_(x >> 15)
    x.mul_(_C1).bitwise_and_(_M32)
    x.bitwise_xor_(x >> 12)
    x.mul_(_C2).bitwise_and_(_M32)
    x.bitwise_xor_(x >> 15)
    return x


def row_keys(seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """[B] int64 keys in [0, 2**32) from (seed, position). Any int64 seed (negative too) is accepted."""
    s = seeds.to(torch.int64)
    lo = s & _M32
    hi = (s >> 32) & _M32  # arithmetic shift; the mask makes the sign irrelevant
    k = mix32(lo ^ _SALT_SEED)
    k = mix32(k ^ hi)
    return mix32(k ^ ((positions.to(torch.int64) & _M32) ^ _SALT_POS))


def col_keys(vocab_size: int, device: torch.device | str) -> torch.Tensor:
    """[V] int64 column keys in [0, 2**32), cached (they never change)."""
    device = torch.device(device)
    key = (vocab_size, str(device))
    t = _col_key_cache.get(key)
    if t is None:
        t = mix32(torch.arange(vocab_size, dtype=torch.int64, device=device) ^ _SALT_COL)
        _col_key_cache[key] = t
    return t


def random_bits(seeds: torch.Tensor, positions: torch.Tensor, vocab_size: int,
                device: torch.device | str) -> torch.Tensor:
    """[B, V] int64 values in [0, 2**32): the exact, backend-independent hash output."""
    rk = row_keys(seeds.to(device), positions.to(device))
    x = rk[:, None] ^ col_keys(vocab_size, device)[None, :]
    return _mix32_(x)


def uniform(seeds: torch.Tensor, positions: torch.Tensor, vocab_size: int,
            device: torch.device | str) -> torch.Tensor:
    """[B, V] float32 uniforms strictly inside (0, 1), a pure function of (seed, position, column).

    Uses the top 23 hash bits k: u = k * 2**-23 + 2**-24 = (2k + 1) / 2**24, which has at most 24 significant bits,
    so both float32 steps are exact: u never hits 0 or 1 and is bit-identical everywhere.
    """
    x = random_bits(seeds, positions, vocab_size, device)
    return x.bitwise_right_shift_(9).to(torch.float32).mul_(2.0 ** -23).add_(2.0 ** -24)


def log_exponential(seeds: torch.Tensor, positions: torch.Tensor, vocab_size: int,
           device: torch.device | str) -> torch.Tensor:
    """[B, V] float32 log(q) with q = -log(u) ~ Exp(1); argmax(logits - log_exponential(...)) samples softmax(logits).

    (Exponential race: argmax(p / q) == argmax(log p - log q), done in the log domain so that tiny probabilities
    do not underflow and no softmax is needed.)
    """
    u = uniform(seeds, positions, vocab_size, device)
    return u.log_().neg_().log_()


def race_argmax(logits: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """argmax(logits - log_exponential(...)) written out-of-place, for torch.compile to fuse into one pass."""
    x = mix32(row_keys(seeds, positions)[:, None] ^ col_keys(logits.shape[-1], logits.device)[None, :])
    u = (x >> 9).to(torch.float32) * (2.0 ** -23) + (2.0 ** -24)
    return (logits - u.log().neg().log()).argmax(dim=-1)

