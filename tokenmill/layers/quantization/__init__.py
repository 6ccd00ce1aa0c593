"""Weight formats behind the linear layers' method seam: a registry of QuantizationConfig classes, imported lazily.

A format is one module here with a `QuantizationConfig` subclass (built from the checkpoint's
`quantization_config` dict by `from_config`) and its `LinearMethod`s; registering it is one line in `_METHODS`.
"""
from __future__ import annotations

import importlib

from tokenmill.layers.quantization.base import LinearMethod, LinearShape, QuantizationConfig

__all__ = ["LinearMethod", "LinearShape", "QuantizationConfig", "get_quant_config", "registered_methods"]

# method name (config.json's quant_method or --quantization) -> (module, QuantizationConfig class)
_METHODS: dict[str, tuple[str, str]] = {
    "fp8": ("tokenmill.layers.quantization.fp8", "Fp8Config"),
    "compressed-tensors": ("tokenmill.layers.quantization.compressed_tensors", "CompressedTensorsConfig"),
    "awq": ("tokenmill.layers.quantization.wna16", "AWQConfig"),
    "gptq": ("tokenmill.layers.quantization.wna16", "GPTQConfig"),
    "bitsandbytes": ("tokenmill.layers.quantization.bnb", "BnbConfig"),
}


def registered_methods() -> list[str]:
    return sorted(_METHODS)


def _checkpoint_method(hf_config) -> tuple[str | None, dict]:
    qc = getattr(hf_config, "quantization_config", None)
    if qc is None:
        return None, {}
    qc = qc if isinstance(qc, dict) else qc.to_dict()
    return str(qc.get("quant_method", "unknown")).lower(), qc


def get_quant_config(model_config) -> QuantizationConfig | None:
    """The weight format the model loads in, or None for dense weights in the model dtype.

    GGUF files are dequantized by the reader and load densely. A checkpoint whose config.json declares a
    `quantization_config` must name a registered method, else loading stops here with that method's name rather
    than failing later on a tensor the dense layers do not have."""
    if getattr(model_config, "is_gguf", False):
        return None
    method, qc = _checkpoint_method(model_config.hf_config)
    forced = model_config.quantization
    from tokenmill.layers.quantization.selection import select_method
    method = select_method(None if forced == "gguf" else forced, method, registered_methods())
    if method is None:
        return None
    module, name = _METHODS[method]
    return getattr(importlib.import_module(module), name).from_config(qc)
