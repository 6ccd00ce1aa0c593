"""FP8 (e4m3) weights: `quant_method: fp8` checkpoints (per-tensor or 128x128 block-wise scales), the FP8 schemes of
compressed-tensors (built by compressed_tensors.py), and online quantization of a dense checkpoint (`--quantization
fp8` without a quantization_config).

Storage after loading (what `apply` reads):
- `weight`: float8_e4m3fn [N, K] (this rank's rows, the stacked slots one after another);
- `weight_scale`: float32 [N], one scale per output row, for per-tensor, per-channel and online weights. A stacked
  layer of a per-tensor checkpoint holds one scale per slot (q, k, v or gate, up); after loading each slot's scale is
  written out to its rows, so no weight is requantized and every slot keeps its exact scale;
- or `weight_scale_inv`: float32 [N / block_n, K / block_k] for block-wise checkpoints (the name they publish; it
  multiplies, despite the name);
- `input_scale`: float32 [1] for a static activation scheme. The slots of a stacked layer share one input, so they
  share one scale: the largest of theirs (no activation is clipped; the others lose a little resolution).
Online quantization keeps one scale per output row (amax / 448), finer than vLLM's one scale per tensor.

The products: on CUDA, more than `SCALED_MM_MIN_ROWS` rows with row scales quantize the activations (the checkpoint's
static scale, else one dynamic scale per token) and run torch._scaled_mm; up to 16 rows run the decode GEMV of
kernels/triton_gemv.py on the fp8 weight (row scales in its epilogue, block scales on each K step's product); the
rows between, and block-wise products of more rows, run the Triton kernel of kernels/triton_quant_matmul.py, which
dequantizes the weight in registers and keeps the activations in the model dtype (more precise than the scheme
asks: the decode path is weight-bound). Elsewhere (CPU) the product is the scheme's definition: activations
rounded through fp8 as the scheme quantizes them (the static scale, else per token), the weight dequantized into the
activation dtype per call (kept in 1 byte per value), then F.linear - what compressed-tensors' own reference forward
computes. Block-wise checkpoints run weights-only on every
device (their authors' 1 x 128 activation groups are not emulated). GPUs older than sm_89 (no fp8 arithmetic)
convert the weight per call and run F.linear.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.layers.quantization.base import LinearMethod, LinearShape, QuantizationConfig
from tokenmill.layers.quantization.common import layer_matches, per_slot_param, refuse, replace_param
from tokenmill.layers.quantization.unquantized import UnquantizedLinearMethod

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max
# Below this many rows the weight-streaming Triton kernel beats quantizing the activations for torch._scaled_mm
# (the H200 measurement: _scaled_mm is slower than bf16 at 1-64 rows on the 8B projections).
SCALED_MM_MIN_ROWS = 64


@dataclass(frozen=True)
class Fp8Scheme:
    """weight: "tensor" (one scale per checkpoint tensor), "channel" (one per output row), "block" (one per
    block_n x block_k block) or "online" (dense checkpoint, quantized at load per row). activation: "static" (the
    checkpoint's input_scale), "dynamic" (per token, computed per call) or None (weights only)."""
    weight: str
    activation: str | None = "dynamic"
    block: tuple[int, int] | None = None


def quantize_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 values, float32 scale per row) with w ~= values * scale[:, None]."""
    scale = (w.float().abs().amax(dim=-1) / FP8_MAX).clamp_min(torch.finfo(torch.float32).tiny)
    return (w.float() / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def dequantize(layer: nn.Module, dtype: torch.dtype) -> torch.Tensor:
    """The layer's weight [N, K] in `dtype`, as the checkpoint's scales define it."""
    w = layer.weight.to(torch.float32)
    if hasattr(layer, "weight_scale_inv"):
        bn, bk = layer.quant_method.scheme.block
        s = layer.weight_scale_inv.repeat_interleave(bn, 0)[:w.shape[0]].repeat_interleave(bk, 1)[:, :w.shape[1]]
        return (w * s).to(dtype)
    return (w * layer.weight_scale[:, None]).to(dtype)


def quantize_activation(x: torch.Tensor, input_scale: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 x [M, K], float32 scale [M, 1]): the static `input_scale` for every row, else one per row (token)."""
    x2 = x.reshape(-1, x.shape[-1]).float()
    if input_scale is not None:
        xs = input_scale.reshape(1, 1).expand(x2.shape[0], 1).float().contiguous()
    else:
        xs = (x2.abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp_min(1e-12)
    return (x2 / xs).clamp(-FP8_MAX, FP8_MAX).to(FP8), xs


def scaled_mm(x: torch.Tensor, weight: torch.Tensor, row_scale: torch.Tensor,
              input_scale: torch.Tensor | None) -> torch.Tensor:
    """W8A8: x quantized to fp8 (quantize_activation), times fp8 `weight` [N, K] with one scale per row, through
    torch._scaled_mm (row-wise scales; on CUDA its output is bf16, cast to x's dtype)."""
    xq, xs = quantize_activation(x, input_scale)
    out_dtype = torch.bfloat16 if x.is_cuda else x.dtype
    y = torch._scaled_mm(xq, weight.t(), scale_a=xs, scale_b=row_scale.reshape(1, -1).float(), out_dtype=out_dtype)
    return y.to(x.dtype).reshape(*x.shape[:-1], weight.shape[0])


class Fp8LinearMethod(LinearMethod):
    """FP8 weights of one layer in the storage the module docstring describes."""

    def __init__(self, scheme: Fp8Scheme) -> None:
        self.scheme = scheme

    def create_weights(self, layer: nn.Module, shape: LinearShape, dtype: torch.dtype) -> None:
        s = self.scheme
        n, k = shape.output_size_per_rank, shape.input_size_per_rank
        w = nn.Parameter(torch.empty(n, k, dtype=dtype if s.weight == "online" else FP8), requires_grad=False)
        w.output_dim, w.input_dim = 0, 1
        layer.register_parameter("weight", w)
        if s.weight == "tensor":
            per_slot_param(layer, "weight_scale")
        elif s.weight == "channel":
            ws = nn.Parameter(torch.zeros(n, 1, dtype=torch.float32), requires_grad=False)
            ws.output_dim = 0
            layer.register_parameter("weight_scale", ws)
        elif s.weight == "block":
            bn, bk = s.block
            if any(o % bn for o in shape.output_sizes_per_rank) or k % bk:
                raise ValueError(f"{layer.prefix}: fp8 weight_block_size {list(s.block)} does not divide this rank's "
                                 f"output slots {list(shape.output_sizes_per_rank)} / input {k} (each must be a "
                                 "multiple of the block; with tensor parallelism, per rank).")
            ws = nn.Parameter(torch.zeros(n // bn, k // bk, dtype=torch.float32), requires_grad=False)
            ws.output_dim, ws.input_dim = 0, 1
            layer.register_parameter("weight_scale_inv", ws)
        if s.activation == "static" and s.weight != "online":
            per_slot_param(layer, "input_scale")

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        s = self.scheme
        if s.weight == "online":
            q, scale = quantize_rows(layer.weight.data)
            replace_param(layer, "weight", q)
            replace_param(layer, "weight_scale", scale)
        elif s.weight == "tensor":
            sizes = list(layer.shape.output_sizes_per_rank)  # one per slot, in slot order
            per_slot = layer.weight_scale.data
            rows = torch.repeat_interleave(per_slot, torch.tensor(sizes, device=per_slot.device))
            replace_param(layer, "weight_scale", rows.float().contiguous())
        elif s.weight == "channel":
            replace_param(layer, "weight_scale", layer.weight_scale.data.reshape(-1).float().contiguous())
        if hasattr(layer, "input_scale"):
            replace_param(layer, "input_scale", layer.input_scale.data.amax().reshape(1).float())

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if x.is_cuda:
            y = self._apply_cuda(layer, x)
        else:
            if self.scheme.activation is not None and self.scheme.weight != "block":
                xq, xs = quantize_activation(x, getattr(layer, "input_scale", None))
                x = (xq.float() * xs).to(x.dtype).reshape(x.shape)
            y = F.linear(x, dequantize(layer, x.dtype))
        return y if bias is None else y + bias

    def _apply_cuda(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        if torch.cuda.get_device_capability(x.device) < (8, 9):
            # No fp8 arithmetic before Ada / Hopper (Triton's e4m3 and torch._scaled_mm need sm_89): convert the
            # weight per call instead, still stored in 1 byte per value.
            return F.linear(x, dequantize(layer, x.dtype))
        from tokenmill.kernels.triton_gemv import MAX_M, gemv
        from tokenmill.kernels.triton_quant_matmul import fp8_matmul
        n, k = layer.weight.shape
        rows = x.numel() // x.shape[-1]
        if self.scheme.weight == "block":
            block = self.scheme.block
            if rows <= MAX_M and x.dtype in (torch.bfloat16, torch.float16) and block[1] % 16 == 0:
                return gemv(x, layer.weight, weight_scale=layer.weight_scale_inv, block=block)
            return fp8_matmul(x, layer.weight, layer.weight_scale_inv, block)
        if (rows >= SCALED_MM_MIN_ROWS and self.scheme.activation is not None and n % 16 == 0 and k % 16 == 0):
            return scaled_mm(x, layer.weight, layer.weight_scale, getattr(layer, "input_scale", None))
        if rows <= MAX_M and x.dtype in (torch.bfloat16, torch.float16):
            # Decode: the tuned weight-streaming GEMV, reading 1 byte per weight (split-K, deep K tiles).
            return gemv(x, layer.weight, weight_scale=layer.weight_scale)
        return fp8_matmul(x, layer.weight, layer.weight_scale)


class Fp8Config(QuantizationConfig):
    """`quant_method: fp8` (config.json) or online `--quantization fp8`: every linear layer in FP8 except those the
    config's `ignored_layers` / `modules_to_not_convert` name."""

    name = "fp8"

    def __init__(self, scheme: Fp8Scheme, ignored: list[str] | None = None) -> None:
        self.scheme, self.ignored = scheme, list(ignored or [])

    @classmethod
    def online(cls) -> "Fp8Config":
        return cls(Fp8Scheme("online", "dynamic"))

    @classmethod
    def from_config(cls, qc: dict) -> "Fp8Config":
        if not qc:
            return cls.online()
        fmt = str(qc.get("fmt", "e4m3")).lower()
        if fmt != "e4m3":
            raise refuse("fp8", "fmt", fmt, "e4m3")
        act = str(qc.get("activation_scheme", "dynamic")).lower()
        if act not in ("static", "dynamic"):
            raise refuse("fp8", "activation_scheme", act, "static, dynamic")
        block = qc.get("weight_block_size")
        ignored = list(qc.get("ignored_layers") or []) + list(qc.get("modules_to_not_convert") or [])
        if block is None:
            return cls(Fp8Scheme("tensor", act), ignored)
        if len(block) != 2 or not all(isinstance(b, int) and b > 0 for b in block):
            raise refuse("fp8", "weight_block_size", block, "two positive integers such as [128, 128]")
        if act == "static":
            raise refuse("fp8", "activation_scheme with weight_block_size", act, "dynamic")
        return cls(Fp8Scheme("block", "dynamic", (block[0], block[1])), ignored)

    def get_linear_method(self, prefix: str) -> LinearMethod:
        if layer_matches(prefix, self.ignored, "ignored_layers"):
            return UnquantizedLinearMethod()
        return Fp8LinearMethod(self.scheme)
