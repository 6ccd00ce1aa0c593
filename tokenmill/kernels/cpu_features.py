"""What this CPU computes fast, from its feature flags (Linux /proc/cpuinfo; elsewhere: nothing assumed).

torch runs bf16 and fp16 GEMMs on any x86 CPU, but only with the matching instructions are they faster than fp32:
on a 2-core AVX2 host (no AVX-512) a bf16 product of 500 x 576 by 576 x 3072 took 137 ms against 25.6 ms in fp32,
and the default model's 49152 x 576 LM head at one row 26 ms in fp16 against 12.4 ms in fp32; on an AVX-512 BF16
host the bf16 and fp16 forms were the faster ones. Layers that keep a reduced-precision copy for speed ask here.
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


def fast_fp16_gemv() -> bool:
    """fp16 arithmetic in hardware (AVX-512 FP16 or AMX FP16)."""
    return bool(cpu_flags() & {"avx512_fp16", "amx_fp16"})
