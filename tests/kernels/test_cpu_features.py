"""CPU feature flags decide which reduced-precision copies pay (kernels/cpu_features.py)."""
from __future__ import annotations

from tokenmill.kernels import cpu_features


def test_flags_decide_the_fast_forms(monkeypatch):
    import torch
    fbgemm = "fbgemm" in torch.backends.quantized.supported_engines   # x86 builds of torch have it
    for flags, want in ((("sse4_2",), (False, False, 0)), (("avx2", "fma", "f16c"), (False, False, 6 * fbgemm)),
                        (("avx512f", "avx512_bf16"), (True, False, 0)),
                        (("avx512f", "avx2", "amx_bf16", "f16c", "avx512_fp16"), (True, True, 14 * fbgemm)),
                        (("amx_bf16", "amx_fp16"), (True, True, 0))):
        monkeypatch.setattr(cpu_features, "cpu_flags", lambda flags=flags: frozenset(flags))
        cpu_features.fbgemm_fp16_rows.cache_clear()
        assert (cpu_features.fast_bf16_matmul(), cpu_features.fast_fp16_matmul(),
                cpu_features.fbgemm_fp16_rows()) == want, flags
    cpu_features.fbgemm_fp16_rows.cache_clear()


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
