"""GGUF weights kept quantized on the CPU: 4-bit blocks repacked for torch's int4 matmul, the rest dequantized.

A GGUF file's linear weights come as blocks (llama.cpp's ggml types). Q4_0, Q4_1 and Q4_K store, per group of 32
inputs, 4-bit codes q and an affine map w = s * q + m: Q4_0 has s = d, m = -8 d; Q4_1 s = d, m = min; Q4_K (super
blocks of 256 = 8 groups) s = d * sc_j, m = -dmin * mn_j with 6-bit sc_j, mn_j. That is exactly the layout of
torch's CPU int4 weight-only matmul (kernels/cpu_int4pack.py: W = (q - 8) * scale + zero, group 32;
layers/quantization/gguf_blocks.py decodes the blocks) with scale = s and zero = m + 8 s, so these layers run on the
file's own codes; the only change is the rounding of s and zero to bf16 (a relative 2^-9 of each scale, well inside
the 4-bit codes' own error). The matmul takes bf16 activations. Products of many rows run on a dense copy of the
same weights instead (DENSE_MIN_ROWS): bf16 where the CPU has bf16 instructions, else fp32 (kernels/cpu_features.py).

Other types (Q5_*, Q6_K, Q8_0, F16, F32) load dequantized into the model dtype: torch has no CPU kernel for their
block layouts (its int8 matmul wants one scale per output row, which would re-quantize Q8_0's per-block scales).

The loader reads the raw blocks of the tensors this config claims (`raw_names`) instead of dequantizing them, and
the layer's parameter `qweight` ([rows, bytes per row] uint8, a row being K / block inputs blocks) loads through the
layers' usual stacked-slot and tensor-parallel rules; `process_weights_after_loading` decodes and repacks it.
"""
from __future__ import annotations

import torch
from torch import nn

from tokenmill.kernels import cpu_int4pack
from tokenmill.kernels.cpu_features import cpu_flags, fast_bf16_matmul, fast_fp16_matmul, fbgemm_fp16_rows
from tokenmill.layers.quantization.base import LinearMethod, LinearShape
from tokenmill.layers.quantization.common import replace_param
from tokenmill.layers.quantization.gguf_blocks import BLOCK_TYPES, decode_blocks
from tokenmill.layers.quantization.gguf_gpu import GGUFBlockConfig

# The ggml types kept quantized here (the others load dequantized)
INT4_TYPES = ("Q4_0", "Q4_1", "Q4_K")
# From this many rows on a product runs on a dense copy of the same weights instead: torch's int4 kernel costs
# about the same per row at any row count (it is compute-bound past one row), a dense GEMM does not. Measured with
# the weights of all 30 layers cycled (cold in the caches, as in a step), 2 cores, AVX2, a step's 120 products:
# 8 rows 27 ms int4 / 40 dense, 16 rows 52 / 48, 32 rows 116 / 72, 64 rows 199 / 113 (engine steps of 16 rows: 113
# ms int4, 103 dense). On an AVX-512 BF16 host (one layer, warm): 8 rows 421 us int4 / 468 bf16, 16 rows 815 / 573.
# The copy holds exactly the int4 kernel's weights (its bf16 scales and zeros applied), rounded once to bf16 where
# the CPU has bf16 instructions, else kept in fp32.
DENSE_MIN_ROWS = 16
# Without bf16 instructions the copy is FBGEMM's packed fp16 weight (cpu_features.fbgemm_fp16_rows: fp32
# activations, sums and output; a relative 2^-11 of each weight), which reads half the fp32 copy's bytes. All 30
# layers' products cycled, 2 cores, AVX2, ms a step: 8 rows int4 27.3 / fp16 29.5 (fp32 copy 55.0), 12 rows 36.4 /
# 33.1 (85.6), 16 rows 46.3 / 38.0 (74.9), 32 rows 95.5 / 59.4 (101.6), 500 rows fp16 675 against fp32 1,174. From
# 12 rows, `tokenmill serve` with 16 chat clients on the same 2 cores measured slower than from 16.
DENSE_MIN_ROWS_FP16 = 16
# With fp16 arithmetic the LM head's products of up to this many rows run on a plain fp16 copy
# (GGUFCpuConfig.process_model_after_loading).
HALF_HEAD_MAX_ROWS = 64
# With AMX the bf16 copy overtakes the int4 kernel sooner. Default model's decode steps, 2 cores: 8 rows 29.8 ms
# int4 / 37.7 bf16, 10 rows 38.6 bf16, 12 rows 40.2 / 35.0.
DENSE_MIN_ROWS_AMX = 12
# Up to this many rows the dense product runs as W x^T: torch's CPU GEMM packs its right operand per call, and
# packing the activations instead of the weights made a step's products 1.6x faster at 8-32 rows (x W^T: 80 ms at
# 16 rows, 115 at 32); from ~190 rows both forms take the same time.
WT_MAX_ROWS = 160
_INT4_MM = torch.ops.aten._weight_int4pack_mm_for_cpu.default if cpu_int4pack.available() else None


class GGUFInt4LinearMethod(LinearMethod):
    """A layer whose checkpoint tensors are all of one 4-bit ggml type: raw blocks in, torch's int4 matmul out.

    Contract: `qweight` [out, in / block * bytes] uint8 holds the file's blocks (stacked slots one after another);
    after loading it is replaced by `packed` and `scales_zeros` (kernels/cpu_int4pack.py) and by a dense copy of the
    same weights for products of `gguf_dense_min_rows` rows or more: `dense` in bf16 where the CPU has bf16
    instructions (cpu_features.fast_bf16_matmul; from DENSE_MIN_ROWS, DENSE_MIN_ROWS_AMX with AMX), else the
    attribute `gguf_dense_fp16`, FBGEMM's packed fp16 weight (from DENSE_MIN_ROWS_FP16), else `dense` in fp32. `apply`
    rounds x to bf16 for every form (the int4 kernel's input) and returns the model dtype."""

    def __init__(self, type_name: str) -> None:
        self.type_name = type_name
        self.block, self.nbytes = BLOCK_TYPES[type_name][:2]

    def create_weights(self, layer: nn.Module, shape: LinearShape, dtype: torch.dtype) -> None:
        k = shape.input_size_per_rank
        if k % self.block:
            raise ValueError(f"{getattr(layer, 'prefix', '')}: {k} inputs per rank are not whole {self.type_name} "
                             f"blocks of {self.block}")
        w = nn.Parameter(torch.empty(shape.output_size_per_rank, k // self.block * self.nbytes, dtype=torch.uint8),
                         requires_grad=False)
        w.output_dim, w.input_dim = 0, 1
        layer.register_parameter("qweight", w)
        layer.gguf_out_dtype = dtype

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        codes, s, m = decode_blocks(layer.qweight.data, self.type_name)
        packed, sz = cpu_int4pack.pack(codes, s, m + 8.0 * s)
        n = layer.gguf_out_features = codes.shape[0]
        delattr(layer, "qweight")
        replace_param(layer, "packed", packed)
        replace_param(layer, "scales_zeros", sz)
        # The int4 kernel's own weights ((q - 8) * scale + zero, with its bf16 scales and zeros).
        scale = sz[:, :n, 0].t().float().repeat_interleave(cpu_int4pack.GROUP_SIZE, 1)
        zero = sz[:, :n, 1].t().float().repeat_interleave(cpu_int4pack.GROUP_SIZE, 1)
        w = ((codes.float() - 8.0) * scale + zero).contiguous()
        layer.gguf_dense_fp16 = None
        if fast_bf16_matmul():
            replace_param(layer, "dense", w.to(torch.bfloat16))
            layer.gguf_dense_min_rows = DENSE_MIN_ROWS_AMX if "amx_bf16" in cpu_flags() else DENSE_MIN_ROWS
        elif fbgemm_fp16_rows():
            layer.gguf_dense_fp16 = torch.ops.quantized.linear_prepack_fp16(w, None)
            layer.gguf_dense_min_rows = DENSE_MIN_ROWS_FP16
        else:
            replace_param(layer, "dense", w)
            layer.gguf_dense_min_rows = DENSE_MIN_ROWS

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        # Attribute reads go straight to the parameter dict: nn.Module.__getattr__ costs about a microsecond a
        # name, and a one-row step runs 120 of these products on a 2-core CPU bound by such overhead.
        params = layer._parameters
        x2 = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
        if x2.shape[0] >= layer.__dict__["gguf_dense_min_rows"]:
            # x is rounded to bf16 first as the int4 kernel takes it, so both forms compute from the same input.
            xq = x2.to(torch.bfloat16)
            packed_fp16 = layer.__dict__["gguf_dense_fp16"]
            if packed_fp16 is not None:
                y = torch.ops.quantized.linear_dynamic_fp16(xq.float(), packed_fp16)
                y = y.to(layer.__dict__["gguf_out_dtype"])
            else:
                dense = params["dense"]
                xq = xq.to(dense.dtype)
                if xq.shape[0] <= WT_MAX_ROWS:
                    y = _contiguous_as(torch.mm(dense, xq.t()).t(), layer.__dict__["gguf_out_dtype"])
                else:
                    y = torch.nn.functional.linear(xq, dense).to(layer.__dict__["gguf_out_dtype"])
        else:
            y = _INT4_MM(x2.to(torch.bfloat16).contiguous(), params["packed"], cpu_int4pack.GROUP_SIZE,
                         params["scales_zeros"])
            n = layer.__dict__["gguf_out_features"]
            y = _contiguous_as(y if y.shape[1] == n else y[:, :n], layer.__dict__["gguf_out_dtype"])
        if bias is not None:
            y = y + bias
        return y if x.dim() == 2 else y.reshape(*x.shape[:-1], y.shape[-1])


def _contiguous_as(y: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """y (a transposed or sliced view) as a contiguous tensor of `dtype`, in one copy (converting and laying out
    in the same pass: at 16 rows two copies cost ~30 us more per product)."""
    if y.dtype == dtype:
        return y.contiguous()
    return y.to(dtype, memory_format=torch.contiguous_format)


class GGUFCpuConfig(GGUFBlockConfig):
    """A GGUF file on the CPU: layers whose checkpoint tensors are all one 4-bit type run GGUFInt4LinearMethod, the
    others run dense (GGUFBlockConfig's contract otherwise)."""

    name = "gguf-cpu"

    def kept_method(self, type_name: str | None) -> LinearMethod | None:
        return GGUFInt4LinearMethod(type_name) if type_name in INT4_TYPES and cpu_int4pack.available() else None

    def process_model_after_loading(self, model: nn.Module) -> None:
        """The LM head's products of a few rows read an fp16 copy of its weight: those products are bound by the
        weight's bytes, and fp16 halves them (a relative 2^-11 of each weight). Products that FBGEMM's fp16-weight
        linear takes in one pass over the weight (kernels.cpu_features.fbgemm_fp16_rows: 14 rows with AVX-512) go
        through it, which keeps the activations, the sums and the logits fp32 (teacher-forced logprobs against the
        dense fp32 path: mean 0.0177, as with the fp32 head; a plain fp16 product: 0.0185). Default model's 49152 x
        576 head in engine steps, 2 cores, AMX host: 1 / 4 / 8 / 14 rows 3.1 / 3.6 / 4.1 / 4.6 ms against 4.5 / 4.9
        / 5.3 / 5.8 for the plain fp16 product; at 15 rows FBGEMM makes a second pass over the weight (8.1 ms against
        6.0). On CPUs with fp16 arithmetic the plain fp16 product then serves up to HALF_HEAD_MAX_ROWS rows (16 / 32
        rows 6.1 / 8.2 ms)."""
        head = getattr(model, "lm_head", None)
        if head is None or not hasattr(head, "enable_fp16_copies") or head.weight.dtype != torch.float32:
            return
        packed = fbgemm_fp16_rows()
        half = HALF_HEAD_MAX_ROWS if fast_fp16_matmul() else 0
        if packed or half:
            head.enable_fp16_copies(packed_rows=packed, half_rows=half)
