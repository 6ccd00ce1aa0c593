"""CPU feature flags decide which reduced-precision copies pay (kernels/cpu_features.py)."""
from __future__ import annotations

from tokenmill.kernels import cpu_features


def test_flags_decide_the_fast_forms(monkeypatch):
    for flags, bf16, fp16 in ((("sse4_2",), False, False), (("avx2", "fma", "f16c"), False, True),
                              (("avx512f", "avx512_bf16"), True, False),
                              (("amx_bf16", "amx_fp16", "avx512_fp16"), True, True)):
        monkeypatch.setattr(cpu_features, "cpu_flags", lambda flags=flags: frozenset(flags))
        assert (cpu_features.fast_bf16_matmul(), cpu_features.fast_fp16_gemv()) == (bf16, fp16)


def test_flags_of_this_machine_are_read():
    cpu_features.cpu_flags.cache_clear()
    flags = cpu_features.cpu_flags()
    assert isinstance(flags, frozenset)
    try:
        text = open("/proc/cpuinfo").read()
    except OSError:
        return
    if "flags" in text:
        assert flags and all(f in text for f in list(flags)[:5])
