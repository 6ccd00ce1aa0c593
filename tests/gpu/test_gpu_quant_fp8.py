"""FP8 linear layers on CUDA, each product path against dequantize-then-matmul (run with `pytest -m gpu` on the
device): the decode GEMV (up to 16 rows), the weight-streaming tile kernel (17-63 rows and block-wise scales, with
128 x 128 blocks on one scale per tile) and torch._scaled_mm (64 rows and more, activations quantized per token)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.gpu


def _online(n: int, k: int):
    from tokenmill.layers.linear import RowParallelLinear
    from tokenmill.layers.quantization.fp8 import Fp8Config
    torch.manual_seed(n + k)
    row = RowParallelLinear(k, n, quant_config=Fp8Config.online(), prefix="model.layers.0.mlp.down_proj")
    row.weight.weight_loader(row.weight, torch.randn(n, k) * k ** -0.5)
    row.process_weights_after_loading()
    return row.cuda()


@pytest.mark.parametrize("rows", [1, 4, 16, 40])
def test_weight_streaming_paths_match_the_dequantized_product(rows):
    row = _online(1024, 2048)
    x = torch.randn(rows, 2048, device="cuda", dtype=torch.bfloat16)
    ref = F.linear(x.float(), row.weight.float() * row.weight_scale[:, None])
    torch.testing.assert_close(row(x).float(), ref, rtol=2e-2, atol=2e-2)


def test_scaled_mm_path_quantizes_activations_per_token():
    from tokenmill.layers.quantization.fp8 import FP8
    row = _online(1024, 2048)
    x = torch.randn(80, 2048, device="cuda", dtype=torch.bfloat16)
    xs = x.float().abs().amax(1, keepdim=True) / 448
    xq = (x.float() / xs).clamp(-448, 448).to(FP8).float() * xs
    ref = F.linear(xq, row.weight.float() * row.weight_scale[:, None])
    torch.testing.assert_close(row(x).float(), ref, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("rows", [1, 24])
def test_block_scales_of_published_checkpoints(rows):
    from tokenmill.kernels.triton_quant_matmul import fp8_matmul
    from tokenmill.layers.quantization.fp8 import FP8
    torch.manual_seed(rows)
    n, k = 640, 1024
    w = (torch.randn(n, k, device="cuda") * 60).clamp(-448, 448).to(FP8)
    s = torch.rand(n // 128, k // 128, device="cuda") * 1e-3 + 1e-4
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    full = s.repeat_interleave(128, 0).repeat_interleave(128, 1)
    ref = F.linear(x.float(), w.float() * full)
    torch.testing.assert_close(fp8_matmul(x, w, s, (128, 128)).float(), ref, rtol=2e-2, atol=2e-2)
