"""CPU feature flags decide which reduced-precision copies pay (kernels/cpu_features.py)."""
from __future__ import annotations

from tokenmill.kernels import cpu_features


def test_flags_decide_the_fast_forms(monkeypatch):
    for flags, want in ((("sse4_2",), (False, False, False)), (("avx2", "fma", "f16c"), (False, True, False)),
                        (("avx512f", "avx512_bf16"), (True, False, False)),
                        (("avx512_bf16", "amx_bf16", "f16c", "avx512_fp16"), (True, True, True)),
                        (("amx_bf16", "amx_fp16"), (True, True, True))):
        monkeypatch.setattr(cpu_features, "cpu_flags", lambda flags=flags: frozenset(flags))
        assert (cpu_features.fast_bf16_matmul(), cpu_features.fast_fp16_gemv(),
                cpu_features.fast_fp16_matmul()) == want, flags


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
