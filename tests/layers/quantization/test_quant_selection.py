"""Which format a model loads in: the checkpoint's quant_method, --quantization with vLLM's aliases, and the
mismatches refused with what to do instead."""
from __future__ import annotations

import pytest

from tokenmill.layers.quantization import registered_methods
from tokenmill.layers.quantization.selection import select_method


@pytest.mark.parametrize("forced, checkpoint, want", [
    (None, None, None), (None, "fp8", "fp8"), ("fp8", None, "fp8"), ("FP8", "fp8", "fp8"),
    ("awq_marlin", "awq", "awq"), ("gptq_marlin", "gptq", "gptq"), (None, "GPTQ", "gptq"),
    ("compressed_tensors", "compressed-tensors", "compressed-tensors"),
])
def test_aliases_and_detection(forced, checkpoint, want):
    assert select_method(forced, checkpoint, registered_methods()) == want


def test_mismatches_and_unknown_methods():
    reg = registered_methods()
    with pytest.raises(ValueError, match="--quantization gptq does not match .*'awq'.*pass awq"):
        select_method("gptq", "awq", reg)
    with pytest.raises(ValueError, match="--quantization awq needs a checkpoint quantized with awq.*Only fp8"):
        select_method("awq_marlin", None, reg)
    with pytest.raises(ValueError, match="quantization='hqq'.*not supported yet.*Supported: awq, bitsandbytes, "
                                         "compressed-tensors, fp8, gptq"):
        select_method(None, "hqq", reg)


def test_model_config_refuses_methods_without_a_kernel_listing_the_accepted_names():
    from tokenmill.config.model import ModelConfig
    with pytest.raises(ValueError, match="quantization='hqq'.*Supported: gguf, fp8, compressed-tensors"):
        ModelConfig(quantization="hqq")
