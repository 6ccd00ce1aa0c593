"""CacheConfig: which KV-cache dtypes are accepted (vLLM's spellings) and which are refused, naming the option."""
from __future__ import annotations

import shlex

import pytest

from tokenmill.config.args import parse_serve_args
from tokenmill.config.cache import KV_CACHE_DTYPES, CacheConfig

ACCEPTED = ("auto", "bfloat16", "float16", "fp8", "fp8_e4m3", "fp8_e5m2")
# vLLM's other choices (its --kv-cache-dtype list): parsed, then refused as not supported yet.
REFUSED = ("fp8_ds_mla", "fp8_inc", "fp8_per_token_head", "int8_per_token_head", "nvfp4", "turboquant_3bit_nc",
           "turboquant_4bit_nc", "turboquant_k3v4_nc", "turboquant_k8v4")


@pytest.mark.parametrize("dtype", ACCEPTED)
def test_supported_kv_cache_dtypes_are_accepted(dtype):
    assert CacheConfig(kv_cache_dtype=dtype).kv_cache_dtype == dtype
    engine, _ = parse_serve_args(shlex.split(f"--kv-cache-dtype {dtype}"))
    assert engine == {"kv_cache_dtype": dtype}


@pytest.mark.parametrize("dtype", REFUSED)
def test_other_vllm_kv_cache_dtypes_parse_then_fail_clearly(dtype):
    engine, _ = parse_serve_args(shlex.split(f"--kv-cache-dtype {dtype}"))   # a vLLM command line still parses
    assert engine == {"kv_cache_dtype": dtype}
    refused = rf"`kv_cache_dtype='{dtype}'` \(--kv-cache-dtype\) is not supported yet.*fp8_e5m2"
    with pytest.raises(ValueError, match=refused):
        CacheConfig(kv_cache_dtype=dtype)


def test_choices_are_exactly_vllms():
    assert set(KV_CACHE_DTYPES) == set(ACCEPTED) | set(REFUSED)


def test_unknown_kv_cache_dtype_is_a_choices_error(capsys):
    with pytest.raises(ValueError, match="Invalid value 'int4' for `kv_cache_dtype`"):
        CacheConfig(kv_cache_dtype="int4")
    with pytest.raises(SystemExit):
        parse_serve_args(["--kv-cache-dtype", "int4"])
    assert "--kv-cache-dtype" in capsys.readouterr().err


def test_calculate_kv_scales_refused_with_an_fp8_cache():
    for dtype in ("fp8", "fp8_e4m3", "fp8_e5m2"):
        with pytest.raises(ValueError, match=r"`calculate_kv_scales=True` \(--calculate-kv-scales\) is not supported "
                                             r"yet.*k_scale"):
            CacheConfig(kv_cache_dtype=dtype, calculate_kv_scales=True)
    # Without an fp8 cache there are no scales to compute (vLLM computes them and never uses them): accepted.
    assert CacheConfig(kv_cache_dtype="auto", calculate_kv_scales=True).calculate_kv_scales
    engine, _ = parse_serve_args(["--calculate-kv-scales"])
    assert engine == {"calculate_kv_scales": True}
