"""Batch-1 decode attention variants inside a layer-like chain (GPU machine): qkv gemv -> attention -> o_proj gemv,
repeated per layer and captured in one CUDA graph (PDL as configured), timed per layer.

Variants: `sep` qk_norm_rope_store + decode_attention (the unfused path); `fused` decode_attention_qkv. Prints each
variant's us per layer and the registers / spills of the attention kernels it compiled.
Usage: python3 tools/bench_decode_fused.py [qwen3|llama] [--ctx N] [--splits S] [--layers L]"""
from __future__ import annotations

import sys

import torch

from tokenmill.kernels import triton_decode_attention as tda
from tokenmill.kernels import triton_decode_attention_qkv as tdq
from tokenmill.kernels.triton_gemv import gemv, prefer_gemv
from tokenmill.kernels.triton_qk_norm_rope_store import qk_norm_rope_store
from tokenmill.layers.rotary import RotaryEmbedding

args = sys.argv[1:]
shape = args[0] if args and not args[0].startswith("--") else "qwen3"


def opt(name: str, default: int) -> int:
    return int(args[args.index(name) + 1]) if name in args else default


hidden, hq, hkv, d, norm = (1024, 16, 8, 128, True) if shape == "qwen3" else (4096, 32, 8, 128, False)
ctx, splits, layers = opt("--ctx", 300), opt("--splits", 8), opt("--layers", 28)
dev, dt, bs = torch.device("cuda"), torch.bfloat16, 16
torch.manual_seed(0)
width = (hq + 2 * hkv) * d
nblocks = ctx // bs + 4
caches = [torch.randn(2, nblocks, bs, hkv, d, device=dev, dtype=dt) for _ in range(layers)]
w_qkv = [torch.randn(width, hidden, device=dev, dtype=dt) * 0.02 for _ in range(layers)]
w_o = [torch.randn(hidden, hq * d, device=dev, dtype=dt) * 0.02 for _ in range(layers)]
cfg_qkv, cfg_o = prefer_gemv(1, width, hidden), prefer_gemv(1, hidden, hq * d)
qsl = torch.tensor([0, 1], dtype=torch.int32, device=dev)
seq_lens = torch.tensor([ctx], dtype=torch.int32, device=dev)
table = torch.randperm(nblocks, device=dev, dtype=torch.int32)[None, :]
positions = torch.tensor([ctx - 1], device=dev)
slot = int(table[0, (ctx - 1) // bs]) * bs + (ctx - 1) % bs
slots = torch.tensor([slot], device=dev)
inv_freq = 1.0 / (1e6 ** (torch.arange(0, d, 2).float() / d))
rope = RotaryEmbedding(inv_freq, d, d, 4096, scaling=1.0).to(dev)
qw = torch.ones(d, device=dev, dtype=dt) if norm else None
kw = torch.ones(d, device=dev, dtype=dt) if norm else None
spec = tdq.QkvRope(positions, slots, rope.cos_cache, rope.sin_cache, d, True, qw, kw, 1e-6)
x0 = torch.randn(1, hidden, device=dev, dtype=dt)


def forward(variant: str) -> torch.Tensor:
    x = x0
    for i in range(layers):
        qkv = gemv(x, w_qkv[i], config=cfg_qkv)
        out = torch.empty((1, hq, d), device=dev, dtype=dt)
        kc, vc = caches[i][0], caches[i][1]
        if variant == "fused":
            tdq.decode_attention_qkv(qkv, spec, kc, vc, out, qsl, seq_lens, table, d ** -0.5, num_splits=splits)
        else:
            q = qk_norm_rope_store(qkv, positions, slots, caches[i], rope.cos_cache, rope.sin_cache, num_heads=hq,
                                   num_kv_heads=hkv, head_dim=d, q_norm_weight=qw, k_norm_weight=kw)
            tda.decode_attention(q.view(1, hq, d), kc, vc, out, qsl, seq_lens, table, d ** -0.5,
                                 num_splits=splits)
        x = gemv(out.view(1, hq * d), w_o[i], config=cfg_o)
    return x


def timed(variant: str) -> float:
    forward(variant)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        forward(variant)
    for _ in range(20):
        g.replay()
    torch.cuda.synchronize()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    reps = 200
    start.record()
    for _ in range(reps):
        g.replay()
    stop.record()
    torch.cuda.synchronize()
    return 1000 * start.elapsed_time(stop) / reps / layers


print(f"{shape}: hidden {hidden}, heads {hq}/{hkv}, ctx {ctx}, splits {splits}, {layers} layers")
for variant in ("sep", "fused", "sep", "fused"):
    print(f"{variant:6s} {timed(variant):7.2f} us per layer")
for kern in (tda._decode_stage1_kernel, tdq._decode_qkv_kernel, tda._decode_stage2_kernel):
    try:
        for entry in kern.device_caches.values():
            for ck in entry[0].values():
                print(f"{kern.fn.__name__}: regs {ck.n_regs} spills {ck.n_spills}")
    except Exception as exc:  # introspection differs between Triton versions
        print(f"{kern.fn.__name__}: no compile info ({exc!r})")
