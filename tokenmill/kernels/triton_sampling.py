"""The exponential-race draw of the sampler as two Triton kernels.

`race_argmax(logits, seeds, positions)` returns argmax_j(logits[b, j] - log(-log(u[b, j]))) where u is the
counter-based uniform of tokenmill.kernels.sampling_rng: the same integer hash (recomputed in registers, nothing
[B, V]-sized is materialised besides the logits read) and the same float32 steps with libdevice's log, so the
tokens equal the torch implementation's. Stage 1 runs a program per (row, chunk of the vocabulary) and keeps the
chunk's best value and index; stage 2 picks each row's best chunk (ties go to the lower index, as torch.argmax does).
Splitting the vocabulary matters at small batch: one program per row (what a fused torch.compile reduction does)
takes ~85 us for one 152k-vocab row on an H200; here the row is spread over ~75 programs.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenmill import envs
from tokenmill.kernels import sampling_rng as rng
from tokenmill.kernels.pdl import launch_kwargs, pdl_wait

_BLOCK = 2048

if envs.TRITON_INTERPRET:  # the CPU interpreter has no libdevice; numpy's log is exact enough
    @triton.jit
    def _log(x):
        return tl.log(x)
else:
    from triton.language.extra import libdevice

    @triton.jit
    def _log(x):
        # libdevice's logf, the function torch's CUDA log calls: tl.log may use the approximate lg2 instruction.
        return libdevice.log(x)


@triton.jit
def _mix32(x):
    x = x ^ (x >> 15)
    x = (x * 0x2C1B3C6D) & 0xFFFFFFFF
    x = x ^ (x >> 12)
    x = (x * 0x297A2D39) & 0xFFFFFFFF
    return x ^ (x >> 15)


@triton.jit
def _mix32_u32(x):
    """_mix32 on uint32 values: the same bits (the products wrap mod 2**32 by themselves), in native 32-bit
    arithmetic instead of emulated 64-bit multiplies - the per-column hash is most of a race pass's work."""
    x = x ^ (x >> 15)
    x = x * 0x2C1B3C6D
    x = x ^ (x >> 12)
    x = x * 0x297A2D39
    return x ^ (x >> 15)


@triton.jit
def _uniform(row_key, cols, SALT_COL: tl.constexpr):
    """Each column's uniform in (0, 1) for a row key in [0, 2**32): sampling_rng's hash and float steps."""
    x = _mix32_u32(row_key.to(tl.uint32) ^ _mix32_u32(cols.to(tl.uint32) ^ SALT_COL))
    return (x >> 9).to(tl.float32) * (2.0 ** -23) + (2.0 ** -24)


@triton.jit
def _race_stage1(logits_ptr, stride_b, seeds_ptr, pos_ptr, temp_ptr, best_val_ptr, best_idx_ptr, flag_ptr, V,
                 n_chunks, SALT_SEED: tl.constexpr, SALT_POS: tl.constexpr, SALT_COL: tl.constexpr,
                 BLOCK: tl.constexpr, HAS_TEMP: tl.constexpr, HAS_FLAG: tl.constexpr = False,
                 PDL: tl.constexpr = False):
    pdl_wait(PDL)
    if HAS_FLAG:
        if tl.load(flag_ptr) == 0:
            return
    b = tl.program_id(0)
    c = tl.program_id(1)
    s = tl.load(seeds_ptr + b).to(tl.int64)
    p = tl.load(pos_ptr + b).to(tl.int64)
    lo = s & 0xFFFFFFFF
    hi = (s >> 32) & 0xFFFFFFFF
    k = _mix32(lo ^ SALT_SEED)
    k = _mix32(k ^ hi)
    row_key = _mix32(k ^ ((p & 0xFFFFFFFF) ^ SALT_POS))
    cols = c * BLOCK + tl.arange(0, BLOCK)
    mask = cols < V
    u = _uniform(row_key, cols, SALT_COL)
    lg = tl.load(logits_ptr + b.to(tl.int64) * stride_b + cols, mask=mask, other=float("-inf")).to(tl.float32)
    if HAS_TEMP:  # IEEE division, as torch's logits.div_(temperature) in fp32
        lg = tl.math.div_rn(lg, tl.load(temp_ptr + b).to(tl.float32))
    val = lg - _log(-_log(u))
    val = tl.where(mask, val, float("-inf"))
    best = tl.max(val, axis=0)
    # First index holding the maximum (torch.argmax's tie rule).
    idx = tl.min(tl.where(val == best, cols, V + BLOCK), axis=0)
    tl.store(best_val_ptr + b * n_chunks + c, best)
    tl.store(best_idx_ptr + b * n_chunks + c, idx)


@triton.jit
def _race_stage2(best_val_ptr, best_idx_ptr, out_ptr, flag_ptr, n_chunks, host_ptr, host_slot_ptr, host_stride,
                 CHUNKS_P2: tl.constexpr, HAS_FLAG: tl.constexpr = False, HAS_HOST: tl.constexpr = False,
                 PDL: tl.constexpr = False):
    pdl_wait(PDL)
    if HAS_FLAG:
        if tl.load(flag_ptr) == 0:
            return
    b = tl.program_id(0)
    c = tl.arange(0, CHUNKS_P2)
    m = c < n_chunks
    v = tl.load(best_val_ptr + b * n_chunks + c, mask=m, other=float("-inf"))
    i = tl.load(best_idx_ptr + b * n_chunks + c, mask=m, other=2147483647)
    best = tl.max(v, axis=0)
    tok = tl.min(tl.where(v == best, i, 2147483647), axis=0)
    tl.store(out_ptr + b, tok.to(tl.int64))
    if HAS_HOST:  # also straight into pinned host memory: no copy op after the graph (triton_step_inputs.py)
        tl.store(host_ptr + tl.load(host_slot_ptr) * host_stride + b, tok.to(tl.int64), cache_modifier=".wt")


def race_argmax(logits: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor,
                temperature: torch.Tensor | None = None, out: torch.Tensor | None = None,
                flag: torch.Tensor | None = None, host_out: torch.Tensor | None = None,
                host_slot: torch.Tensor | None = None) -> torch.Tensor:
    """[B] int64 sampled ids; logits [B, V] (any float dtype, last dim contiguous), seeds/positions [B] int64,
    temperature [B] (optional): the logits are upcast to fp32 and divided by it first. out: a [B] int64 tensor to
    write into. flag: an int32 device scalar; when it holds 0 the kernels do nothing (out keeps its contents), so
    a CUDA graph can carry the draw and skip it on steps that sample otherwise. host_out ([S, >= B] int64, pinned
    host memory) with host_slot (an int64 device scalar s): the ids are also written to host_out[s, :B]."""
    b, v = logits.shape
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    n_chunks = triton.cdiv(v, _BLOCK)
    best_val = torch.empty((b, n_chunks), dtype=torch.float32, device=logits.device)
    best_idx = torch.empty((b, n_chunks), dtype=torch.int32, device=logits.device)
    if out is None:
        out = torch.empty(b, dtype=torch.int64, device=logits.device)
    assert out.shape == (b,) and out.dtype == torch.int64
    if b == 0:
        return out
    has_temp, has_flag = temperature is not None, flag is not None
    pdl = launch_kwargs(logits.device, "sampling")
    _race_stage1[(b, n_chunks)](logits, logits.stride(0), seeds, positions, temperature if has_temp else seeds,
                                best_val, best_idx, flag if has_flag else seeds, v, n_chunks,
                                SALT_SEED=rng._SALT_SEED, SALT_POS=rng._SALT_POS, SALT_COL=rng._SALT_COL,
                                BLOCK=_BLOCK, HAS_TEMP=has_temp, HAS_FLAG=has_flag, num_warps=8, **pdl)
    has_host = host_out is not None
    if has_host:
        assert host_slot is not None and host_out.dtype == torch.int64 and host_out.shape[1] >= b
    _race_stage2[(b,)](best_val, best_idx, out, flag if has_flag else seeds, n_chunks,
                       host_out if has_host else out, host_slot if has_host else out,
                       host_out.stride(0) if has_host else 0,
                       CHUNKS_P2=triton.next_power_of_2(n_chunks), HAS_FLAG=has_flag, HAS_HOST=has_host,
                       num_warps=4, **pdl)
    return out
