"""Integer weights with 16-bit activations: AWQ (GEMM format) and GPTQ checkpoints, 4 or 8 bits, grouped scales.

Checkpoint layouts (K input features, N output features, G = K / group_size groups, pack = 32 / bits):
- AWQ: `qweight` int32 [K, N / 8], the eight 4-bit values of a word in AWQ's column order 0, 2, 4, 6, 1, 3, 5, 7
  (value i of a word, bits 4i .. 4i + 3, is column 8c + order[i]); `qzeros` int32 [G, N / 8] in the same order;
  `scales` [G, N]; w = (q - z) * s.
- GPTQ: `qweight` int32 [K / pack, N] packed along K in order; `qzeros` int32 [G, N / pack] packed along N in order;
  `scales` [G, N]; `g_idx` int32 [K] (each input's group; a permutation of the groups with desc_act). The original
  format (`checkpoint_format: gptq`, GPTQ v1) stores each zero point minus one, so z = stored + 1; `gptq_v2` stores z.
  A symmetric checkpoint's zero point is 2^(bits - 1).
- compressed-tensors pack-quantized (W4A16 / W8A16): `weight_packed` int32 [N, K / pack] packed along K in order,
  each value stored as q + 2^(bits - 1) (the library's signed-to-unsigned offset); `weight_scale` [N, G];
  `weight_zero_point` int32 [N / pack, G] packed along N the same way (asymmetric only; a symmetric zero point is
  2^(bits - 1) in stored units); `weight_shape` [2] (checked).
After loading every format is repacked once into the layout kernels/triton_quant_matmul.int_matmul reads: `qweight`
int32 [K / pack, N] packed along K, `scales` [G, N] in the model dtype, `qzeros` uint8 [G, N] unpacked, and `g_idx`
only where the groups are not in input order. On CUDA the product is that kernel (the weights stay packed); elsewhere
(CPU) the weight is dequantized into the activation dtype per call and multiplied: correct, memory stays 4-bit.
"""
from __future__ import annotations

import torch
from torch import nn

from tokenmill.layers.quantization.base import LinearMethod, LinearShape, QuantizationConfig
from tokenmill.layers.quantization.common import layer_matches, refuse, replace_param
from tokenmill.layers.quantization.unquantized import UnquantizedLinearMethod

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def unpack_rows(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 [R / pack, C] packed along rows in order -> int32 [R, C] values in [0, 2^bits)."""
    pack, mask = 32 // bits, (1 << bits) - 1
    shifts = torch.arange(pack, device=packed.device, dtype=torch.int32) * bits
    vals = (packed.unsqueeze(1) >> shifts.view(1, pack, 1)) & mask
    return vals.reshape(packed.shape[0] * pack, packed.shape[1])


def unpack_cols(packed: torch.Tensor, bits: int, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """int32 [R, C / pack] packed along columns (value i of a word is column pack*c + order[i]) -> int32 [R, C]."""
    pack = 32 // bits
    vals = unpack_rows(packed.t().contiguous(), bits).t().reshape(packed.shape[0], packed.shape[1], pack)
    if order is not None:
        vals = vals[..., torch.tensor([order.index(j) for j in range(pack)], device=packed.device)]
    return vals.reshape(packed.shape[0], packed.shape[1] * pack)


def pack_rows(vals: torch.Tensor, bits: int) -> torch.Tensor:
    """int [R, C] in [0, 2^bits) -> int32 [R / pack, C] packed along rows in order (unpack_rows' inverse)."""
    pack = 32 // bits
    v = vals.to(torch.int64).reshape(vals.shape[0] // pack, pack, vals.shape[1])
    shifts = (torch.arange(pack, device=vals.device, dtype=torch.int64) * bits).view(1, pack, 1)
    word = (v << shifts).sum(dim=1)
    return torch.where(word >= 2 ** 31, word - 2 ** 32, word).to(torch.int32)


class WNA16LinearMethod(LinearMethod):
    """One layer's packed integer weights (see the module docstring for the layouts)."""

    def __init__(self, fmt: str, bits: int, group_size: int, sym: bool, act_order: bool, zero_offset: int) -> None:
        self.fmt, self.bits, self.group_size, self.sym = fmt, bits, group_size, sym
        self.act_order, self.zero_offset = act_order, zero_offset

    def _param(self, layer, name, shape, dtype, out_dim, in_dim):
        p = nn.Parameter(torch.zeros(shape, dtype=dtype), requires_grad=False)
        p.output_dim, p.input_dim = out_dim, in_dim
        layer.register_parameter(name, p)

    def create_weights(self, layer: nn.Module, shape: LinearShape, dtype: torch.dtype) -> None:
        n, k, pack = shape.output_size_per_rank, shape.input_size_per_rank, 32 // self.bits
        group = self.group_size if self.group_size > 0 else shape.input_size
        if k % group or k % pack or any(o % pack for o in shape.output_sizes_per_rank):
            raise ValueError(f"{layer.prefix}: {self.fmt} {self.bits}-bit weights with group size {group} need "
                             f"this rank's input ({k}) divisible by the group and by {pack}, and every output slot "
                             f"{list(shape.output_sizes_per_rank)} divisible by {pack}.")
        if self.act_order and layer.sums_over_ranks and layer.tp_size > 1:
            raise ValueError(f"{layer.prefix}: GPTQ desc_act (act-order) weights of a row-parallel layer with "
                             "tensor parallelism are not supported yet.")
        self.groups = k // group
        if self.fmt == "compressed-tensors":
            self._param(layer, "weight_packed", (n, k // pack), torch.int32, 0, 1)
            self._param(layer, "weight_scale", (n, self.groups), dtype, 0, 1)
            if not self.sym:
                self._param(layer, "weight_zero_point", (n // pack, self.groups), torch.int32, 0, 1)
            self._param(layer, "weight_shape", (2,), torch.int64, None, None)
            layer.weight_shape.weight_loader = lambda p, t, shard=None: _check_shape(layer, t)
            return
        if self.fmt == "awq":
            self._param(layer, "qweight", (k, n // pack), torch.int32, 1, 0)
            self._param(layer, "qzeros", (self.groups, n // pack), torch.int32, 1, 0)
        else:
            self._param(layer, "qweight", (k // pack, n), torch.int32, 1, 0)
            self._param(layer, "qzeros", (self.groups, n // pack), torch.int32, 1, 0)
            self._param(layer, "g_idx", (k,), torch.int32, None, 0)
        self._param(layer, "scales", (self.groups, n), dtype, 1, 0)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if self.fmt == "compressed-tensors":
            q = unpack_cols(layer.weight_packed.data, self.bits).t()
            if self.sym:
                z = torch.full((self.groups, q.shape[1]), 1 << (self.bits - 1), dtype=torch.int32, device=q.device)
            else:
                z = unpack_rows(layer.weight_zero_point.data, self.bits).t()
                delattr(layer, "weight_zero_point")
            replace_param(layer, "scales", layer.weight_scale.data.t())
            for name in ("weight_packed", "weight_scale", "weight_shape"):
                delattr(layer, name)
            g_idx = None
        elif self.fmt == "awq":
            q = unpack_cols(layer.qweight.data, self.bits, AWQ_ORDER)
            z = unpack_cols(layer.qzeros.data, self.bits, AWQ_ORDER)
            g_idx = None
        else:
            q = unpack_rows(layer.qweight.data, self.bits)
            z = unpack_cols(layer.qzeros.data, self.bits) + self.zero_offset
            if self.sym:
                z = torch.full_like(z, 1 << (self.bits - 1))
            g_idx = layer.g_idx.data.to(torch.int32)
            k = q.shape[0]
            trivial = torch.arange(k, device=g_idx.device, dtype=torch.int32) // (k // self.groups)
            if not self.act_order or torch.equal(g_idx, trivial):
                g_idx = None
            elif int(g_idx.min()) < 0 or int(g_idx.max()) >= self.groups:
                raise ValueError(f"{layer.prefix}.g_idx: group indices outside 0..{self.groups - 1}.")
            delattr(layer, "g_idx")
        replace_param(layer, "qweight", pack_rows(q, self.bits))
        replace_param(layer, "qzeros", z.clamp(0, (1 << self.bits) - 1).to(torch.uint8).contiguous())
        replace_param(layer, "scales", layer.scales.data.contiguous())
        if g_idx is not None:
            replace_param(layer, "g_idx", g_idx.contiguous())

    def dequantize(self, layer: nn.Module, dtype: torch.dtype) -> torch.Tensor:
        """W^T [K, N] in `dtype`."""
        q = unpack_rows(layer.qweight, self.bits)
        g = getattr(layer, "g_idx", None)
        if g is None:
            g = torch.arange(q.shape[0], device=q.device) // (q.shape[0] // self.groups)
        g = g.long()
        return ((q - layer.qzeros[g].to(torch.int32)).to(torch.float32) * layer.scales[g].float()).to(dtype)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if x.is_cuda:
            from tokenmill.kernels.triton_quant_matmul import int_matmul
            k = layer.qweight.shape[0] * 32 // self.bits
            y = int_matmul(x, layer.qweight, layer.scales, layer.qzeros, self.bits, k // self.groups,
                           getattr(layer, "g_idx", None))
        else:
            y = x @ self.dequantize(layer, x.dtype)
        return y if bias is None else y + bias


def _check_shape(layer: nn.Module, loaded: torch.Tensor) -> None:
    """compressed-tensors' weight_shape: [output rows of this checkpoint tensor, input features]."""
    if loaded.numel() != 2 or int(loaded.reshape(-1)[1]) != layer.shape.input_size:
        raise ValueError(f"{layer.prefix}.weight_shape: {loaded.tolist()} does not describe a weight with "
                         f"{layer.shape.input_size} input features.")


class _WNA16Config(QuantizationConfig):
    """AWQ / GPTQ: every linear layer packed, except the modules `modules_to_not_convert` names."""

    fmt = ""
    BITS = (4, 8)

    def __init__(self, bits: int, group_size: int, sym: bool, act_order: bool, zero_offset: int,
                 ignored: list[str], error: str | None = None) -> None:
        self.bits, self.group_size, self.sym, self.act_order = bits, group_size, sym, act_order
        self.zero_offset, self.ignored, self.error = zero_offset, ignored, error

    def get_linear_method(self, prefix: str) -> LinearMethod:
        if layer_matches(prefix, self.ignored, "modules_to_not_convert"):
            return UnquantizedLinearMethod()
        if self.error is not None:  # refused here, so the message names the first layer the format applies to
            what, value, supported = self.error
            raise refuse(self.fmt, what, value, supported, prefix)
        return WNA16LinearMethod(self.fmt, self.bits, self.group_size, self.sym, self.act_order, self.zero_offset)

    @classmethod
    def _checked(cls, qc: dict, bits, group_size, **kw):
        error = None
        if bits not in cls.BITS:
            error = ("bits", bits, ", ".join(map(str, cls.BITS)))
        elif not (group_size == -1 or (isinstance(group_size, int) and group_size > 0 and group_size % 8 == 0)):
            error = ("group_size", group_size, "-1 or a positive multiple of 8 (32, 64, 128, ...)")
        ignored = list(qc.get("modules_to_not_convert") or [])
        return cls(bits, group_size if group_size is not None else -1, ignored=ignored, error=error, **kw)


class AWQConfig(_WNA16Config):
    """`quant_method: awq`, version gemm, 4 bits."""

    name = fmt = "awq"
    BITS = (4,)

    @classmethod
    def from_config(cls, qc: dict) -> "AWQConfig":
        version = str(qc.get("version", "gemm")).lower()
        if version != "gemm":
            raise refuse("awq", "version", version, "gemm")
        bits = qc.get("bits", qc.get("w_bit"))
        group = qc.get("group_size", qc.get("q_group_size"))
        sym = not qc.get("zero_point", True)
        cfg = cls._checked(qc, bits, group, sym=sym, act_order=False, zero_offset=0)
        if sym and cfg.error is None:
            cfg.error = ("zero_point", False, "true (AWQ's zero points)")
        return cfg


class GPTQConfig(_WNA16Config):
    """`quant_method: gptq`: 4 or 8 bits, symmetric or not, act-order (desc_act) or not."""

    name = fmt = "gptq"

    @classmethod
    def from_config(cls, qc: dict) -> "GPTQConfig":
        fmt = str(qc.get("checkpoint_format", "gptq")).lower()
        if fmt not in ("gptq", "gptq_v2"):
            raise refuse("gptq", "checkpoint_format", fmt, "gptq, gptq_v2")
        return cls._checked(qc, qc.get("bits"), qc.get("group_size", 128), sym=bool(qc.get("sym", True)),
                            act_order=bool(qc.get("desc_act", False)), zero_offset=1 if fmt == "gptq" else 0)
