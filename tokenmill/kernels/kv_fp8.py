"""The fp8 KV-cache number format: which dtypes, how values are scaled, stored and read back.

Each attention layer owns two float32 device scalars, k_scale and v_scale (1.0 unless the checkpoint supplies them,
as in vLLM; attention/kv_quant.py loads them). A cached value is stored as fp8(clamp(x / scale, -max, max)) and read
back as float(fp8) * scale, so a scale maps the tensor's range onto the fp8 range. The scales stay on the device:
kernels read them through pointers, which keeps the launches free of host syncs and safe to capture in CUDA graphs.
The Triton store and attention kernels and the torch reference backend all follow this module.
"""
from __future__ import annotations

import functools

import torch

# kv_cache_dtype values that select an fp8 cache (vLLM's names; "fp8" means e4m3).
FP8_KV_CACHE_DTYPES: dict[str, torch.dtype] = {
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}
_FP8_DTYPES = frozenset(FP8_KV_CACHE_DTYPES.values())


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in _FP8_DTYPES


def fp8_max(dtype: torch.dtype) -> float:
    """Largest finite value of the fp8 dtype (448 for e4m3fn, 57344 for e5m2): stores clamp to it, because a cast
    of anything larger gives NaN (e4m3fn) or inf (e5m2)."""
    return float(torch.finfo(dtype).max)


def quantize(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """fp8(clamp(x / scale)), divided in float32 (the Triton store kernel does the same, IEEE-rounded)."""
    m = fp8_max(dtype)
    return (x.float() / scale).clamp_(-m, m).to(dtype)


def dequantize(x: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """Cached values as `dtype`: float(fp8) * scale for an fp8 cache, a plain cast otherwise."""
    if not is_fp8(x.dtype):
        return x.to(dtype)
    return (x.float() * scale).to(dtype)


def require_scales(k_scale: torch.Tensor | None, v_scale: torch.Tensor | None) -> None:
    if k_scale is None or v_scale is None:
        raise ValueError("An fp8 KV cache needs k_scale and v_scale tensors (the Attention layer owns them).")


@functools.lru_cache(maxsize=8)
def check_triton_fp8_support(dtype: torch.dtype, device_index: int) -> None:
    """Triton converts to e4m3 in hardware only from compute capability 8.9 (Ada, Hopper) on; e5m2 works earlier."""
    if dtype != torch.float8_e4m3fn:
        return
    cap = torch.cuda.get_device_capability(device_index)
    if cap < (8, 9):
        raise ValueError(f"kv_cache_dtype=fp8 (e4m3) needs a GPU of compute capability 8.9 or newer for the Triton "
                         f"attention kernels; this GPU is {cap[0]}.{cap[1]}. Use kv_cache_dtype=fp8_e5m2 or auto.")
