"""What this CPU computes fast, from its feature flags (Linux /proc/cpuinfo; elsewhere: nothing assumed).

torch runs bf16 GEMMs on any x86 CPU, but only with the matching instructions are they faster than fp32: on a 2-core
AVX2 host (no AVX-512) a bf16 product of 500 x 576 by 576 x 3072 took 137 ms against 25.6 ms in fp32; on an AVX-512
BF16 host the bf16 forms were the faster ones. A product of a few rows is different: it is bound by the weight's
bytes, and FBGEMM's fp16-weight linear (x86, AVX2 + F16C) reads half of them while keeping the activations, the
accumulation and the output in fp32; with AVX-512 FP16 a plain fp16 product is faster than fp32 at many rows too.
Layers that keep a reduced-precision copy for speed ask here.
"""
from __future__ import annotations

import functools


@functools.lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def fast_bf16_matmul() -> bool:
    """bf16 GEMMs in hardware (AVX-512 BF16 or AMX)."""
    return bool(cpu_flags() & {"avx512_bf16", "amx_bf16"})


def fast_fp16_matmul() -> bool:
    """fp16 arithmetic in hardware (AVX-512 FP16, AMX FP16): an fp16 product of many rows is faster than fp32 too
    (default model's 49152 x 576 head, 2 cores, AVX-512 FP16: 16 rows 3.8 against 7.1 ms, 64 rows 11.3 / 15.3)."""
    return bool(cpu_flags() & {"avx512_fp16", "amx_fp16"})


@functools.lru_cache(maxsize=1)
def fbgemm_fp16_rows() -> int:
    """How many rows torch's FBGEMM fp16-weight linear (`quantized.linear_prepack_fp16` / `linear_dynamic_fp16`:
    fp32 activations, sums and output over a packed fp16 copy of the weight) takes in one pass over the weight: its
    kernels cover 14 rows with AVX-512, 6 with AVX2 (a product of more rows reads the weight again). 0 where it is
    not built in or does not run (x86 builds need AVX2 and F16C); checked by running it once on a small product."""
    flags = cpu_flags()
    if not {"avx2", "f16c"} <= flags:
        return 0
    import torch
    try:
        w = torch.arange(12, dtype=torch.float32).reshape(3, 4) / 8
        y = torch.ops.quantized.linear_dynamic_fp16(torch.ones(2, 4), torch.ops.quantized.linear_prepack_fp16(w, None))
    except (AttributeError, RuntimeError, NotImplementedError):
        return 0
    if y.dtype != torch.float32 or not torch.equal(y, w.sum(1).expand(2, 3)):
        return 0
    return 14 if "avx512f" in flags else 6
