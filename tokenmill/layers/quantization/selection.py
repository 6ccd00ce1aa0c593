"""Which weight format a model loads in: config.json's `quantization_config` detected, `--quantization` checked
against it, as vLLM does.

- A checkpoint's `quant_method` picks the format; `--quantization` may name the same format (or one of vLLM's
  names for it: awq_marlin for awq, gptq_marlin for gptq, compressed_tensors for compressed-tensors), and naming
  another is an error: the tensors on disk are in the checkpoint's format.
- Without a quantization_config, `--quantization fp8` (or `bitsandbytes`, NF4) quantizes the dense weights at load;
  every other method needs a checkpoint quantized in it.
"""
from __future__ import annotations

ALIASES = {"awq_marlin": "awq", "gptq_marlin": "gptq", "compressed_tensors": "compressed-tensors"}
# Formats whose tensors can be produced from a dense checkpoint at load.
ONLINE = ("fp8", "bitsandbytes")


def canonical(method: str | None) -> str | None:
    if method is None:
        return None
    m = str(method).lower()
    return ALIASES.get(m, m)


def select_method(forced: str | None, checkpoint: str | None, registered: list[str]) -> str | None:
    """The canonical method to load with (None: dense), or a ValueError for a mismatch or an unknown method."""
    forced, checkpoint = canonical(forced), canonical(checkpoint)
    if forced is not None and checkpoint is not None and forced != checkpoint:
        raise ValueError(f"--quantization {forced} does not match the checkpoint, whose config.json declares "
                         f"quantization_config quant_method {checkpoint!r}: its tensors are stored in that format. "
                         f"Drop --quantization or pass {checkpoint}.")
    if forced is not None and checkpoint is None and forced not in ONLINE and forced in registered:
        raise ValueError(f"--quantization {forced} needs a checkpoint quantized with {forced}, but this model's "
                         "config.json has no quantization_config (its weights are dense). Only "
                         f"{', '.join(ONLINE)} quantizes a dense checkpoint at load; or drop --quantization.")
    method = forced or checkpoint
    if method is not None and method not in registered:
        from tokenmill.config.utils import not_supported_yet
        raise not_supported_yet("quantization", method, "This checkpoint's format (config.json's "
                                "quantization_config, or --quantization) has no kernel in tokenmill yet. Supported: "
                                f"{', '.join(registered)}.")
    return method
