"""Does programmatic dependent launch (PDL) pay for chains of small decode kernels? Runs on the GPU machine.

Two chains, each captured in a CUDA graph and replayed, with and without PDL:
  * tiny: 256 dependent elementwise kernels (x += 1 on 4 KB): the bare per-kernel gap;
  * gemv: 112 dependent weight-streaming products y = W_i x (4096 x 1024 bf16, 8 MB each, a different W per call,
    like a decode step's layers); with PDL the weight tile loads may be issued before the wait on x.
Usage: python3 tools/probe_pdl.py"""
from __future__ import annotations

import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from graph_timing import graph_us as _graph_us  # noqa: E402

REPS = 20

try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # older triton
    gdc_wait = gdc_launch_dependents = None


@triton.jit
def _add_one(x_ptr, n, PDL: tl.constexpr, BLOCK: tl.constexpr):
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=m) + 1.0, mask=m)


@triton.jit
def _gemv(x_ptr, w_ptr, y_ptr, N, K: tl.constexpr, PDL: tl.constexpr, PREFETCH: tl.constexpr,
          BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid = tl.program_id(0)
    rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    w_ptrs = w_ptr + rn[:, None] * K + rk[None, :]
    if PDL:
        if PREFETCH:
            w0 = tl.load(w_ptrs)          # weights are never written: safe to read before the wait
        gdc_wait()
        gdc_launch_dependents()
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if PDL and PREFETCH and k0 == 0:
            w = w0
        else:
            w = tl.load(w_ptrs + k0)
        x = tl.load(x_ptr + k0 + rk).to(tl.float32)
        acc += tl.sum(w.to(tl.float32) * x[None, :], 1)
    tl.store(y_ptr + rn, acc.to(y_ptr.dtype.element_ty))


def graph_us(fn, reps: int = REPS) -> float:
    """us per replay of one captured call of fn (tools/graph_timing.py: median over the replays)."""
    return _graph_us([fn], replays=reps)


def main() -> None:
    print(f"triton {triton.__version__}, gdc available: {gdc_wait is not None}")
    if gdc_wait is None:
        return
    x = torch.zeros(1024, device="cuda")
    for pdl in (False, True):
        x.zero_()

        def tiny():
            for _ in range(256):
                _add_one[(1,)](x, 1024, PDL=pdl, BLOCK=1024, launch_pdl=pdl)
        t = graph_us(tiny)
        print(f"tiny chain PDL={pdl}: {t / 256:.2f} us per kernel, value check {x[0].item():.0f} "
              f"(expect {256 * (REPS + 2):.0f}: a warm-up call, the first replay and the timed ones)")
    n, k, layers = 4096, 1024, 112
    ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.03 for _ in range(layers)]
    x0 = torch.randn(k, device="cuda", dtype=torch.bfloat16)
    ys = [torch.empty(n, device="cuda", dtype=torch.bfloat16) for _ in range(layers)]
    ref = None
    for pdl, pre in ((False, False), (True, False), (True, True)):
        def chain():
            x = x0
            for i in range(layers):
                _gemv[(n // 64,)](x, ws[i], ys[i], n, K=k, PDL=pdl, PREFETCH=pre, BLOCK_N=64, BLOCK_K=256,
                                  num_warps=4, launch_pdl=pdl)
                x = ys[i][:k]
        t = graph_us(chain)
        out = ys[-1].float().clone()
        ref = out if ref is None else ref
        print(f"gemv chain PDL={pdl} prefetch={pre}: {t / layers:.2f} us per 8 MB product "
              f"({n * k * 2 / (t / layers) / 1e3:.0f} GB/s), max diff vs first {(out - ref).abs().max().item():.2e}")


if __name__ == "__main__":
    main()
