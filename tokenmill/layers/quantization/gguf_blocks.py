"""ggml's block types as affine groups: each decodes to unsigned codes q, and per group of inputs a scale s and an
offset m with w = s * q + m (llama.cpp's dequantization, rewritten from its layouts).

| type | inputs / block | bytes | group | code bits | per group |
|---|---|---|---|---|---|
| Q4_0 | 32 | 18 | 32 | 4 | d, m = -8 d |
| Q4_1 | 32 | 20 | 32 | 4 | d, min |
| Q5_0 | 32 | 22 | 32 | 5 | d, m = -16 d |
| Q5_1 | 32 | 24 | 32 | 5 | d, min |
| Q8_0 | 32 | 34 | 32 | 8 | d, m = -128 d (codes stored as int8 + 128) |
| Q4_K | 256 | 144 | 32 | 4 | d * sc_j, -dmin * mn_j (6-bit sc, mn) |
| Q5_K | 256 | 176 | 32 | 5 | as Q4_K |
| Q6_K | 256 | 210 | 16 | 6 | d * sc_j, -32 d * sc_j (int8 sc) |

A weight [N, K] arrives as raw [N, K / inputs * bytes] uint8 (a row's blocks in order).
"""
from __future__ import annotations

from typing import NamedTuple

import torch


class BlockType(NamedTuple):
    inputs: int   # per block
    nbytes: int   # per block
    group: int    # inputs per (scale, offset)
    bits: int     # code width


BLOCK_TYPES: dict[str, BlockType] = {
    "Q4_0": BlockType(32, 18, 32, 4), "Q4_1": BlockType(32, 20, 32, 4), "Q5_0": BlockType(32, 22, 32, 5),
    "Q5_1": BlockType(32, 24, 32, 5), "Q8_0": BlockType(32, 34, 32, 8), "Q4_K": BlockType(256, 144, 32, 4),
    "Q5_K": BlockType(256, 176, 32, 5), "Q6_K": BlockType(256, 210, 16, 6)}


def _f16(raw: torch.Tensor) -> torch.Tensor:
    """[..., 2] uint8 little-endian halves -> [...] float32."""
    return raw.contiguous().view(torch.float16).squeeze(-1).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[..., 16 * c] packed bytes -> [..., 2, 16 * c] codes: per run, the low nibbles first, then the high ones
    (ggml's order for the 32-input blocks and each 64-input chunk of the K types)."""
    return torch.stack([qs & 0xF, qs >> 4], dim=-2)


def _bits_of(qh: torch.Tensor, count: int) -> torch.Tensor:
    """[..., count / 8] bytes -> [..., count] bits, bit i of byte i // 8 at i."""
    shifts = torch.arange(8, device=qh.device, dtype=torch.uint8)
    return ((qh.unsqueeze(-1) >> shifts) & 1).reshape(*qh.shape[:-1], count)


def _k_scales(sc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The 12 bytes of eight 6-bit (scale, min) pairs of a Q4_K / Q5_K block -> ([..., 8], [..., 8]) float32."""
    sc = sc.to(torch.int32)
    lo_sc, lo_mn = sc[..., 0:4] & 63, sc[..., 4:8] & 63
    hi_sc = (sc[..., 8:12] & 0xF) | ((sc[..., 0:4] >> 6) << 4)
    hi_mn = (sc[..., 8:12] >> 4) | ((sc[..., 4:8] >> 6) << 4)
    return torch.cat([lo_sc, hi_sc], dim=-1).float(), torch.cat([lo_mn, hi_mn], dim=-1).float()


def decode_blocks(raw: torch.Tensor, type_name: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """raw [N, K / inputs * bytes] uint8 -> (codes [N, K] uint8, s [N, K / group], m [N, K / group] float32)."""
    t = BLOCK_TYPES[type_name]
    n = raw.shape[0]
    b = raw.reshape(n, -1, t.nbytes)
    nb = b.shape[1]
    if type_name in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"):
        d = _f16(b[..., 0:2])
        if type_name == "Q8_0":
            codes = (b[..., 2:34].view(torch.int8).to(torch.int16) + 128).to(torch.uint8)
            return codes.reshape(n, nb * 32), d, -128.0 * d
        has_min = type_name.endswith("1")
        m = _f16(b[..., 2:4]) if has_min else None
        at = 4 if has_min else 2
        if type_name.startswith("Q4"):
            codes = _nibbles(b[..., at:at + 16]).reshape(n, nb, 32)
            return codes.reshape(n, nb * 32), d, m if has_min else -8.0 * d
        high = _bits_of(b[..., at:at + 4], 32)                     # bit j: input j's fifth bit
        codes = _nibbles(b[..., at + 4:at + 20]).reshape(n, nb, 32) | (high << 4)
        return codes.reshape(n, nb * 32), d, m if has_min else -16.0 * d
    if type_name in ("Q4_K", "Q5_K"):
        d, dmin = _f16(b[..., 0:2]).unsqueeze(-1), _f16(b[..., 2:4]).unsqueeze(-1)
        scales, mins = _k_scales(b[..., 4:16])
        if type_name == "Q4_K":
            codes = _nibbles(b[..., 16:144].reshape(n, nb, 4, 32))            # [n, nb, chunk, 2, 32]
        else:
            codes = _nibbles(b[..., 48:176].reshape(n, nb, 4, 32))
            # qh bit 2c (low nibbles of chunk c) and 2c + 1 (its high nibbles) of byte l: input l's fifth bit
            high = _bits_of(b[..., 16:48], 256).reshape(n, nb, 32, 8).transpose(-1, -2).reshape(n, nb, 4, 2, 32)
            codes = codes | (high << 4)
        return codes.reshape(n, nb * 256), (d * scales).reshape(n, nb * 8), (-dmin * mins).reshape(n, nb * 8)
    # Q6_K: ql[128], qh[64], scales int8[16], d; two halves of 128 inputs, each from 64 ql and 32 qh bytes
    ql = b[..., 0:128].reshape(n, nb, 2, 64)
    qh = b[..., 128:192].reshape(n, nb, 2, 32)
    sc = b[..., 192:208].view(torch.int8).float()
    d = _f16(b[..., 208:210]).unsqueeze(-1)
    low = torch.stack([ql[..., 0:32] & 0xF, ql[..., 32:64] & 0xF, ql[..., 0:32] >> 4, ql[..., 32:64] >> 4], dim=-2)
    high = torch.stack([(qh >> s) & 3 for s in (0, 2, 4, 6)], dim=-2)   # [n, nb, half, 4, 32]
    codes = (low | (high << 4)).reshape(n, nb * 256)
    s = (d * sc).reshape(n, nb * 16)
    return codes, s, -32.0 * s


def dequantize_blocks(raw: torch.Tensor, type_name: str) -> torch.Tensor:
    """The weight [N, K] float32 (the tests' oracle is the gguf package's own dequantizer)."""
    codes, s, m = decode_blocks(raw, type_name)
    g = BLOCK_TYPES[type_name].group
    n, k = codes.shape
    w = codes.float().reshape(n, k // g, g) * s.unsqueeze(-1) + m.unsqueeze(-1)
    return w.reshape(n, k)
