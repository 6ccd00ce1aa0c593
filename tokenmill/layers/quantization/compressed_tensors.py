"""compressed-tensors checkpoints (llm-compressor's output, `quant_method: compressed-tensors`).

The config holds `config_groups`, each a quantization scheme (`weights`, `input_activations`) for the modules its
`targets` name ("Linear" = every linear layer, `re:<regex>`, or module names), plus an `ignore` list. Each linear
layer takes the scheme of the first group that targets it. Supported schemes:
- FP8 weights (`type: float`, 8 bits, symmetric, strategy `tensor` or `channel`), with FP8 activations that are
  static per tensor (`input_scale`), dynamic per token or per tensor (computed per call, per token here), or none;
  format `float-quantized` / `naive-quantized`. They run as fp8.py's Fp8LinearMethod (tensors `weight`,
  `weight_scale`, `input_scale`).
- Integer weights of 4 or 8 bits with 16-bit activations (W4A16 / W8A16, format `pack-quantized`), strategy `group`
  or `channel`, symmetric or with zero points, no act-order: wna16.py's method.
Anything else (int8 activations, sparse compression, 2:4, block or tensor-group strategies, ...) is refused at start-up
naming the scheme, the first layer it applies to and what is supported.
"""
from __future__ import annotations

from tokenmill.layers.quantization.base import LinearMethod, QuantizationConfig
from tokenmill.layers.quantization.common import layer_matches, refuse
from tokenmill.layers.quantization.unquantized import UnquantizedLinearMethod

METHOD = "compressed-tensors"
SUPPORTED = ("FP8 weights (tensor / channel) with static-tensor, dynamic-token or no FP8 activations "
             "(float-quantized, naive-quantized); 4- or 8-bit integer weights, group or channel strategy, with "
             "16-bit activations (pack-quantized)")


def _targets(prefix: str, targets: list[str]) -> bool:
    if "Linear" in targets:
        return True
    plain = [t for t in targets if t != "Linear"]
    return layer_matches(prefix, plain, "config_groups targets")


class CompressedTensorsConfig(QuantizationConfig):
    """Per-layer schemes of a compressed-tensors checkpoint (see the module docstring)."""

    name = METHOD

    def __init__(self, groups: list[dict], ignore: list[str], fmt: str) -> None:
        self.groups, self.ignore, self.format = groups, ignore, fmt

    @classmethod
    def from_config(cls, qc: dict) -> "CompressedTensorsConfig":
        if qc.get("sparsity_config"):
            raise refuse(METHOD, "sparsity_config", qc["sparsity_config"].get("format", "sparse"),
                         "dense (no sparsity_config)")
        if qc.get("transform_config"):
            raise refuse(METHOD, "transform_config", "(rotations)", "none")
        groups = [dict(g, _name=name) for name, g in (qc.get("config_groups") or {}).items()]
        if not groups:
            raise ValueError("quantization 'compressed-tensors': quantization_config has no config_groups.")
        return cls(groups, list(qc.get("ignore") or []), str(qc.get("format", "dense")))

    def get_linear_method(self, prefix: str) -> LinearMethod:
        if layer_matches(prefix, self.ignore, "ignore"):
            return UnquantizedLinearMethod()
        for g in self.groups:
            if _targets(prefix, list(g.get("targets") or [])):
                return self._method(g, prefix)
        return UnquantizedLinearMethod()

    def _method(self, g: dict, prefix: str) -> LinearMethod:
        w, a = g.get("weights") or {}, g.get("input_activations")
        fmt = str(g.get("format") or self.format)
        if not w:
            raise refuse(METHOD, f"{g['_name']} without weights", g, SUPPORTED, prefix)
        wtype, bits, strategy = w.get("type", "int"), w.get("num_bits"), w.get("strategy", "tensor")
        if g.get("output_activations"):
            raise refuse(METHOD, "output_activations", g["output_activations"], SUPPORTED, prefix)
        if wtype == "float":
            return self._fp8(w, a, fmt, prefix)
        if wtype == "int" and a is None:
            return _int_weights_method(w, fmt, prefix)
        what = f"{bits}-bit {wtype} weights with {a.get('num_bits')}-bit {a.get('type')} activations" if a else \
            f"{bits}-bit {wtype} weights, strategy {strategy}"
        raise refuse(METHOD, "scheme", what, SUPPORTED, prefix)

    def _fp8(self, w: dict, a: dict | None, fmt: str, prefix: str) -> LinearMethod:
        from tokenmill.layers.quantization.fp8 import Fp8LinearMethod, Fp8Scheme
        if w.get("num_bits") != 8 or not w.get("symmetric", True):
            raise refuse(METHOD, "float weights", f"{w.get('num_bits')} bits, symmetric={w.get('symmetric')}",
                         SUPPORTED, prefix)
        if w.get("strategy") not in ("tensor", "channel") or w.get("dynamic"):
            raise refuse(METHOD, "FP8 weight strategy", w.get("strategy"), "tensor, channel", prefix)
        if fmt not in ("float-quantized", "naive-quantized"):
            raise refuse(METHOD, "format for FP8 weights", fmt, "float-quantized, naive-quantized", prefix)
        act = None
        if a is not None:
            if a.get("type") != "float" or a.get("num_bits") != 8:
                raise refuse(METHOD, "activations", f"{a.get('num_bits')}-bit {a.get('type')}", "8-bit float",
                             prefix)
            dynamic, strategy = bool(a.get("dynamic")), a.get("strategy", "tensor")
            if dynamic and strategy in ("token", "tensor"):
                act = "dynamic"
            elif not dynamic and strategy == "tensor":
                act = "static"
            else:
                raise refuse(METHOD, "activation strategy", f"{strategy} (dynamic={dynamic})",
                             "static tensor, dynamic token, dynamic tensor", prefix)
        return Fp8LinearMethod(Fp8Scheme(w["strategy"], act))


def _int_weights_method(w: dict, fmt: str, prefix: str) -> LinearMethod:
    """The method for compressed-tensors integer weights `w` (a config group's `weights`) with 16-bit activations."""
    from tokenmill.layers.quantization.wna16 import WNA16LinearMethod
    bits, strategy, group = w.get("num_bits"), w.get("strategy"), w.get("group_size")
    if fmt != "pack-quantized":
        raise refuse(METHOD, "format for integer weights", fmt, "pack-quantized", prefix)
    if bits not in (4, 8):
        raise refuse(METHOD, "num_bits", bits, "4, 8", prefix)
    if strategy not in ("group", "channel"):
        raise refuse(METHOD, "integer weight strategy", strategy, "group, channel", prefix)
    if w.get("actorder"):
        raise refuse(METHOD, "actorder", w["actorder"], f"none (act-order not supported yet); {SUPPORTED}", prefix)
    if strategy == "channel":
        group = -1
    elif not (isinstance(group, int) and group > 0 and group % 8 == 0):
        raise refuse(METHOD, "group_size", group, "a positive multiple of 8 (32, 64, 128, ...)", prefix)
    return WNA16LinearMethod("compressed-tensors", bits, group, bool(w.get("symmetric", True)), False, 0)
