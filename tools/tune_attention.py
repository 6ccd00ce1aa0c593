"""Sweep Triton attention launch configs on the GPU and print the fastest per shape (with achieved KV bandwidth).
Usage (on the device): python3 tools/tune_attention.py [auto|fp8|fp8_e5m2] [ragged|bs1]
(the KV cache dtype; auto = bf16). ragged: only decode at batch 256 and 128 with context lengths uniform in 101..2044,
the shape of the nano-vllm throughput workload's decode steps. bs1: decode at batch 1 (Qwen3-0.6B and Llama-3-8B
heads), 28 layers' launches chained in a CUDA graph as a decode step runs them, with and without programmatic
dependent launch, for the split counts of max_model_len 2048 and 32k."""
from __future__ import annotations

import itertools
import os
import sys

import torch
from triton.testing import do_bench

from tokenmill.attention.kv_quant import FP8_KV_CACHE_DTYPES
from tokenmill.kernels.triton_decode_attention import decode_attention, decode_config, decode_num_splits
from tokenmill.kernels.triton_prefill_attention import prefill_attention

dev, dt = torch.device("cuda"), torch.bfloat16
KV_ARG = sys.argv[1] if len(sys.argv) > 1 and sys.argv[1] not in ("ragged", "bs1") else "auto"
if KV_ARG not in ("auto", *FP8_KV_CACHE_DTYPES):
    sys.exit(f"unknown KV cache dtype {KV_ARG!r}; use auto, {', '.join(FP8_KV_CACHE_DTYPES)}")
KV_DT = FP8_KV_CACHE_DTYPES.get(KV_ARG, dt)
KV_ELEM = torch.empty((), dtype=KV_DT).element_size()
SCALES = dict(k_scale=torch.ones((), device=dev), v_scale=torch.ones((), device=dev))
HQ, HKV, D, BS = 16, 8, 128, 16


def paged(batch: int, ctx: int):
    nb = batch * (-(-ctx // BS))
    kc = torch.randn(nb, BS, HKV, D, device=dev, dtype=dt).to(KV_DT)
    vc = torch.randn(nb, BS, HKV, D, device=dev, dtype=dt).to(KV_DT)
    bt = torch.randperm(nb, device=dev, dtype=torch.int32).view(batch, -1)
    return kc, vc, bt


def tune_decode(batch: int, ctx: int, ragged: bool = False) -> None:
    kc, vc, bt = paged(batch, ctx)
    q = torch.randn(batch, HQ, D, device=dev, dtype=dt)
    out = torch.empty_like(q)
    qsl = torch.arange(batch + 1, device=dev, dtype=torch.int32)
    if ragged:
        sl = torch.randint(101, ctx + 1, (batch,), device=dev, dtype=torch.int32)
    else:
        sl = torch.full((batch,), ctx, device=dev, dtype=torch.int32)
    kv_bytes = 2 * int(sl.sum()) * HKV * D * KV_ELEM
    default = decode_num_splits(batch, HKV, ctx, dev)
    cfg = decode_config(D, HQ // HKV, dt, KV_ELEM == 1, batch)
    results = []
    splits = sorted({1, 2, default}) if ragged else sorted({1, 2, 4, 8, 16, default})
    for bn, w, st, sp in itertools.product((16, 32, 64, 128), (2, 4, 8), (1, 2, 3), splits):
        try:
            ms = do_bench(lambda: decode_attention(q, kc, vc, out, qsl, sl, bt, D ** -0.5, num_splits=sp,
                                                   block_n=bn, num_warps=w, num_stages=st, **SCALES),
                          warmup=5, rep=20)
        except Exception as e:  # resource limits for some combinations
            continue
        results.append((ms, bn, w, st, sp))
    results.sort()
    base = [r for r in results if (r[1], r[2], r[3], r[4]) == (*cfg, default)]
    print(f"decode B={batch} ctx={'101..' if ragged else ''}{ctx} kv={KV_DT}: default({cfg[0]},{cfg[1]},{cfg[2]},{default}) "
          f"{base[0][0] * 1e3 if base else float('nan'):.1f}us; best:")
    for ms, bn, w, st, sp in results[:6]:
        print(f"   {ms * 1e3:8.1f}us  {kv_bytes / ms / 1e9:6.2f} TB/s  block_n={bn} warps={w} stages={st} splits={sp}")


def tune_prefill(batch: int, qlen: int, ctx: int) -> None:
    kc, vc, bt = paged(batch, ctx)
    t = batch * qlen
    q = torch.randn(t, HQ, D, device=dev, dtype=dt)
    out = torch.empty_like(q)
    qsl = torch.arange(0, t + 1, qlen, device=dev, dtype=torch.int32)
    sl = torch.full((batch,), ctx, device=dev, dtype=torch.int32)
    flops = 4 * batch * HQ * D * (qlen * (ctx - qlen) + qlen * qlen / 2)
    results = []
    for bm, bn, w, st in itertools.product((64, 128), (32, 64, 128), (4, 8), (1, 2, 3)):
        try:
            ms = do_bench(lambda: prefill_attention(q, kc, vc, out, qsl, sl, bt, D ** -0.5, num_tokens=t,
                                                    max_query_len=qlen, block_m=bm, block_n=bn, num_warps=w,
                                                    num_stages=st, **SCALES), warmup=3, rep=10)
        except Exception:
            continue
        results.append((ms, bm, bn, w, st))
    results.sort()
    print(f"prefill B={batch} q={qlen} ctx={ctx} kv={KV_DT}:")
    for ms, bm, bn, w, st in results[:3]:
        print(f"   {ms * 1e3:8.1f}us  {flops / ms / 1e9:6.0f} TFLOP/s  block_m={bm} block_n={bn} warps={w} stages={st}")


def tune_bs1(hq: int, hkv: int) -> None:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from graph_timing import graph_us
    layers = 28
    print(f"decode batch 1, {hq}/{hkv} heads, D={D}: us per layer, {layers} launches chained in a graph")
    for max_len in (2048, 32768):
        splits = decode_num_splits(1, hkv, max_len, dev)
        for ctx in (128, 512, 2048):
            kc, vc, bt = paged(1, ctx)
            q = torch.randn(1, hq, D, device=dev, dtype=dt)
            qsl = torch.tensor([0, 1], device=dev, dtype=torch.int32)
            sl = torch.tensor([ctx], device=dev, dtype=torch.int32)
            outs = [torch.empty_like(q) for _ in range(layers)]
            row = []
            for pdl in ("1", "0"):
                os.environ["TOKENMILL_PDL"] = pdl

                def call(i):
                    return lambda: decode_attention(q, kc, vc, outs[i], qsl, sl, bt, D ** -0.5, num_splits=splits)
                row.append(f"PDL={pdl} {graph_us([call(i) for i in range(layers)]):.2f}")
            os.environ.pop("TOKENMILL_PDL")
            print(f"  max_len {max_len:>5} (splits {splits:>2}) ctx {ctx:>4}: " + "  ".join(row))


if "bs1" in sys.argv[1:]:
    torch.manual_seed(0)
    for hq, hkv in ((16, 8), (32, 8)):
        tune_bs1(hq, hkv)
    sys.exit(0)
if "ragged" in sys.argv[1:]:
    torch.manual_seed(0)
    for b in (256, 128):
        tune_decode(b, 2044, ragged=True)
    sys.exit(0)
for b, c in ((1, 256), (1, 4096), (32, 1024), (256, 256), (256, 1024)):
    tune_decode(b, c)
for b, ql, c in ((14, 562, 562), (4, 2048, 2048)):
    tune_prefill(b, ql, c)
