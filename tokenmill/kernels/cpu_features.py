"""What this CPU computes fast, from its feature flags (Linux /proc/cpuinfo; elsewhere: nothing assumed).

torch runs bf16 and fp16 GEMMs on any x86 CPU, but only with the matching instructions are they faster than fp32:
on a 2-core AVX2 host (no AVX-512) a bf16 product of 500 x 576 by 576 x 3072 took 137 ms against 25.6 ms in fp32
(and at 16 rows fp16 2.7 ms against 0.9); on an AVX-512 BF16 host the bf16 forms were the faster ones. A product of
one row is different: it is bound by the weight's bytes, and converting fp16 to fp32 takes one instruction wherever
the CPU has F16C (every AVX2 CPU), so the default model's 49152 x 576 LM head at one row takes 3.2-3.6 ms from an
fp16 copy against 10.6-10.9 ms in fp32 on the same AVX2 host (2.8 / 12.3 on AVX-512). Layers that keep a
reduced-precision copy for speed ask here.
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
    """fp16 -> fp32 conversion in hardware (F16C; AVX-512 FP16 and AMX FP16 CPUs have it too): a one-row product
    from an fp16 weight then reads half the bytes at no extra cost."""
    return bool(cpu_flags() & {"f16c", "avx512_fp16", "amx_fp16"})


def fast_fp16_matmul() -> bool:
    """fp16 arithmetic in hardware (AVX-512 FP16, AMX FP16): an fp16 product of many rows is faster than fp32 too
    (default model's 49152 x 576 head, 2 cores, AVX-512 FP16: 16 rows 3.8 against 7.1 ms, 64 rows 11.3 / 15.3),
    where with F16C alone only one-row products gain."""
    return bool(cpu_flags() & {"avx512_fp16", "amx_fp16"})
