"""Decode-kernel micro-benchmark for the GPU machine: Triton skinny GEMM vs cuBLAS, the fused q/k-norm + RoPE + KV
store vs the unfused launches, and a launch-config sweep for the GEMM whose best entries print as a TUNED table.

Usage (on the device, from the repo root): python3 tools/bench_gemv.py [--budget SECONDS] [--no-sweep] [--quick]

Every timing replays a CUDA graph of 20 back-to-back calls (launch overhead excluded, as in the decode graph) and
reports the median replay / 20. Weights rotate over enough copies (>= 256 MB together) that each call reads HBM,
not L2, as in a real decode step where every layer has its own weights. GB/s counts the bytes a call must move
(weights + activations in and out) over its time.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time
import types

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# --smoke: the whole script on the CPU through Triton's interpreter with tiny shapes (checks the script, not speed).
SMOKE = "--smoke" in sys.argv
DEEP = "--deep" in sys.argv
if SMOKE:
    os.environ["TRITON_INTERPRET"] = "1"
# Import only the kernel modules: the package's __init__ needs msgspec, which the bare device image may lack.
if "tokenmill" not in sys.modules:
    _pkg = types.ModuleType("tokenmill")
    _pkg.__path__ = [os.path.join(ROOT, "tokenmill")]
    sys.modules["tokenmill"] = _pkg

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from graph_timing import graph_us as _graph_us  # noqa: E402

from tokenmill.kernels.gemv_config import GemvConfig, default_config  # noqa: E402
from tokenmill.kernels.triton_gemv import _num_sms, gemv, launch_plan  # noqa: E402
from tokenmill.kernels.triton_kv_store import store_kv  # noqa: E402
from tokenmill.kernels.triton_norm_rope_act import rms_norm, rotary_embedding, silu_and_mul  # noqa: E402
from tokenmill.kernels.triton_qk_norm_rope_store import qk_norm_rope_store  # noqa: E402

DEV = torch.device("cpu" if SMOKE else "cuda")
DT = torch.bfloat16
CALLS = 3 if SMOKE else 20
MS = (1, 3) if SMOKE else (1, 2, 4, 8)
# (label, K, N, prologue): prologue None | "silu" (x is [M, 2K]) | "norm" (RMSNorm of x + residual, fused add).
SHAPES = [
    ("q3.qkv", 1024, 4096, None), ("q3.qkv+norm", 1024, 4096, "norm"), ("q3.o", 2048, 1024, None),
    ("q3.gate_up", 1024, 6144, None), ("q3.gate_up+norm", 1024, 6144, "norm"), ("q3.down+silu", 3072, 1024, "silu"),
    ("q3.lm_head", 1024, 151936, None),
    ("l3.qkv", 4096, 6144, None), ("l3.o", 4096, 4096, None), ("l3.gate_up", 4096, 28672, None),
    ("l3.down", 14336, 4096, None), ("l3.down+silu", 14336, 4096, "silu"), ("l3.lm_head", 4096, 128256, None),
]
# --shapes picks sets: "default" (above), "llama8b" (Llama-3-8B's fused-prologue products), "llama8b-tp2" (one rank's
# share of Llama-3-8B at tensor_parallel_size 2: qkv/gate_up column shards, o/down row shards, half the vocabulary).
SHAPE_SETS = {
    "default": SHAPES,
    "llama8b": [("l3.qkv+norm", 4096, 6144, "norm"), ("l3.gate_up+norm", 4096, 28672, "norm")],
    "llama8b-tp2": [
        ("l3tp2.qkv", 4096, 3072, None), ("l3tp2.qkv+norm", 4096, 3072, "norm"), ("l3tp2.o", 2048, 4096, None),
        ("l3tp2.gate_up", 4096, 14336, None), ("l3tp2.gate_up+norm", 4096, 14336, "norm"),
        ("l3tp2.down", 7168, 4096, None), ("l3tp2.down+silu", 7168, 4096, "silu"),
        ("l3tp2.lm_head", 4096, 64128, None)],
    # Llama-3-8B's batch-1 products with and without their prologues (a prologue can also stay a separate kernel).
    "l3bs1": [("l3.qkv", 4096, 6144, None), ("l3.qkv+norm", 4096, 6144, "norm"), ("l3.o", 4096, 4096, None),
              ("l3.gate_up", 4096, 28672, None), ("l3.gate_up+norm", 4096, 28672, "norm"),
              ("l3.down", 14336, 4096, None), ("l3.down+silu", 14336, 4096, "silu")],
    # Every product a batch-1 decode step of Qwen3-0.6B / Llama-3-8B runs (with the prologues it can fuse).
    "bs1": [("q3.qkv+norm", 1024, 4096, "norm"), ("q3.o", 2048, 1024, None), ("q3.gate_up+norm", 1024, 6144, "norm"),
            ("q3.down+silu", 3072, 1024, "silu"), ("q3.lm_head", 1024, 151936, None),
            ("l3.qkv+norm", 4096, 6144, "norm"), ("l3.o", 4096, 4096, None), ("l3.gate_up+norm", 4096, 28672, "norm"),
            ("l3.down+silu", 14336, 4096, "silu"), ("l3.lm_head", 4096, 128256, None)],
}
DOT_BASES = [(32, 128, 4, 3), (32, 256, 4, 3), (64, 64, 4, 4), (64, 128, 4, 3), (64, 128, 4, 5), (64, 256, 4, 3),
             (64, 256, 8, 3), (128, 64, 4, 4), (128, 128, 4, 3), (128, 128, 8, 4), (128, 256, 8, 3), (256, 64, 8, 4)]
FMA_BASES = [(16, 128, 4, 1), (32, 128, 4, 1), (16, 256, 4, 1), (32, 256, 8, 1)]
# Deeper K tiles: with programmatic dependent launch a program's first weight tile is read before the wait on the
# previous kernel, so one tile holding a program's whole share of W overlaps that kernel completely (--deep).
DEEP_BASES = [((16, 512, 4, 1), False), ((16, 1024, 8, 1), False), ((8, 1024, 4, 1), False),
              ((32, 512, 8, 1), False), ((32, 512, 4, 2), True), ((64, 512, 8, 2), True)]
# Two W tiles in flight per program, both first ones read before the PDL wait (GemvConfig.prefetch; --prefetch).
PREFETCH_BASES = [((8, 512, 4, 1), False), ((8, 1024, 4, 1), False), ((16, 512, 4, 1), False),
                  ((16, 512, 8, 1), False), ((4, 1024, 4, 1), False), ((8, 1024, 8, 1), False),
                  ((16, 256, 4, 1), False), ((4, 2048, 8, 1), False), ((32, 256, 4, 1), True),
                  ((64, 256, 4, 1), True), ((64, 128, 4, 1), True), ((64, 512, 8, 1), True)]
PREFETCH = "--prefetch" in sys.argv
# FMA configs that reduce over K every step (GemvConfig.acc2d): fewer registers, so more programs per SM (--acc2d).
ACC2D_BASES = [((8, 512, 4, 1), True), ((16, 256, 4, 1), True), ((8, 1024, 4, 1), True), ((16, 512, 4, 1), True),
               ((32, 256, 4, 1), True), ((16, 512, 8, 1), True), ((32, 512, 8, 1), True), ((4, 1024, 4, 1), True),
               ((8, 256, 4, 1), True), ((8, 512, 4, 1), False), ((16, 256, 4, 1), False), ((8, 1024, 4, 1), False)]
ACC2D = "--acc2d" in sys.argv
SPLITS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)
if SMOKE:
    SHAPES = [("s.plain", 256, 96, None), ("s.norm", 128, 80, "norm"), ("s.silu", 96, 64, "silu")]
    DOT_BASES, FMA_BASES = DOT_BASES[3:5], FMA_BASES[:1]


# ------------------------------------------------------------------------------------------------------- timing
def graph_us(calls) -> float:
    """Median time per call (us) of a captured graph that runs `calls` back to back."""
    if SMOKE:
        t = time.perf_counter()
        for c in calls:
            c()
        return (time.perf_counter() - t) * 1e6 / len(calls)
    return _graph_us(calls)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    if out.isnan().any():
        return float("nan")
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


# ----------------------------------------------------------------------------------------------------- problems
class Problem:
    """One (shape, M): rotating weight copies, inputs, and the torch (unfused) and gemv call builders."""

    def __init__(self, label, k, n, pro, m, weights):
        self.label, self.k, self.n, self.pro, self.m, self.w = label, k, n, pro, m, weights
        k_in = 2 * k if pro == "silu" else k
        g = torch.Generator(device=DEV).manual_seed(m * 7919 + n)
        self.x = torch.randn(m, k_in, device=DEV, dtype=DT, generator=g)
        self.r = torch.randn(m, k, device=DEV, dtype=DT, generator=g) if pro == "norm" else None
        self.nw = (1 + 0.1 * torch.randn(k, device=DEV, generator=g)).to(DT) if pro == "norm" else None
        self.bytes = n * k * 2 + m * (k_in + n) * 2 + (2 * m * k * 2 if pro == "norm" else 0)

    def torch_call(self, i):
        w, x = self.w[i % len(self.w)], self.x
        if self.pro == "silu":
            return lambda: F.linear(silu_and_mul(x), w)
        if self.pro == "norm":
            return lambda: F.linear(rms_norm(x, self.nw, 1e-6, self.r)[0], w)
        return lambda: F.linear(x, w)

    def gemv_call(self, i, cfg):
        w, x = self.w[i % len(self.w)], self.x
        if self.pro == "silu":
            return lambda: gemv(x, w, act="silu_mul", config=cfg)
        if self.pro == "norm":
            return lambda: gemv(x, w, norm_weight=self.nw, eps=1e-6, residual=self.r, config=cfg)[0]
        return lambda: gemv(x, w, config=cfg)

    def time(self, make) -> float:
        return graph_us([make(i) for i in range(CALLS)])

    def reference(self) -> torch.Tensor:
        """fp32 product of the exact prologue (the residual sum rounded to bf16, as torch and the kernel do)."""
        x, k = self.x.float(), self.k
        if self.pro == "silu":
            x = F.silu(x[:, :k]) * x[:, k:]
        elif self.pro == "norm":
            h = (self.x + self.r).float()
            x = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * self.nw.float()
        return F.linear(x, self.w[0].float())

    def check(self, cfg, ref) -> tuple[float, float]:
        """(gemv error, torch error) vs the fp32 reference."""
        return rel_err(self.gemv_call(0, cfg)(), ref), rel_err(self.torch_call(0)(), ref)


def weight_copies(k, n):
    nbytes = n * k * 2
    copies = max(1, min(CALLS, math.ceil(256e6 / nbytes)))
    return [torch.randn(n, k, device=DEV, dtype=DT) * k ** -0.5 for _ in range(copies)]


# ----------------------------------------------------------------------------------------------- sweep configs
def candidates(m, n, k, quick: bool):
    sms = 132 if SMOKE else _num_sms(torch.cuda.current_device())
    bases = [(b, True) for b in ((DOT_BASES[3:6] + DOT_BASES[8:9] or DOT_BASES) if quick else DOT_BASES)]
    if m <= 2 and not quick:
        bases += [(b, False) for b in FMA_BASES]
    bases = [(b, dot, False, False) for b, dot in bases]
    if DEEP:
        bases += [(b, dot, False, False) for b, dot in DEEP_BASES if b[1] <= k]
    if PREFETCH:
        bases += [(b, dot, True, False) for b, dot in PREFETCH_BASES if b[1] <= k]
    if ACC2D:
        bases += [(b, False, pre, True) for b, pre in ACC2D_BASES if b[1] <= k]
    out = []
    for (bn, bk, warps, stages), dot, pre, acc2d in bases:
        steps = max(1, k // bk)
        tiles = -(-n // bn)
        splits = {1}
        for target in (sms, 2 * sms, 4 * sms):
            ok = [s for s in SPLITS if s <= steps]
            splits.add(min(ok, key=lambda s: abs(tiles * s - target)))
        for s in sorted(splits):
            out.append(GemvConfig(block_n=bn, block_k=bk, split_k=s, num_warps=warps, num_stages=stages,
                                  use_dot=dot, prefetch=pre, acc2d=acc2d))
    return out


def _compile_job(job):
    """Worker: compile one kernel variant into Triton's on-disk cache (the same specialisation the timing uses: N
    does not key a compile, and every N here is a multiple of 16)."""
    k, pro, m, cfg = job
    try:
        n = 256
        x = torch.randn(m, 2 * k if pro == "silu" else k, device=DEV, dtype=DT)
        w = torch.randn(n, k, device=DEV, dtype=DT)
        if pro == "silu":
            gemv(x, w, act="silu_mul", config=cfg)
        elif pro == "norm":
            gemv(x, w, norm_weight=torch.ones(k, device=DEV, dtype=DT), residual=torch.randn_like(x), config=cfg)
        else:
            gemv(x, w, config=cfg)
        if not SMOKE:
            torch.cuda.synchronize()
        return None
    except Exception as e:  # reported, then the main process skips that config
        return f"{cfg}: {type(e).__name__}: {str(e)[:200]}"


def precompile(jobs) -> None:
    """Compile every variant in parallel processes first; the timing process then loads them from the disk cache."""
    seen, uniq = set(), []
    for k, pro, m, cfg in jobs:
        block_m, _, split, k_per_split = launch_plan(m, 256, k, cfg)
        key = (k % cfg.block_k == 0, k % 16 == 0, pro, block_m, cfg.block_n, cfg.block_k, cfg.num_warps,
               cfg.num_stages, cfg.use_dot, split > 1, cfg.prefetch, cfg.acc2d)
        if key not in seen:
            seen.add(key)
            uniq.append((k, pro, m, cfg))
    t = time.time()
    workers = max(1, min(len(uniq), (os.cpu_count() or 2) - 1, 15))
    try:
        import multiprocessing as mp
        with mp.get_context("spawn").Pool(workers) as pool:
            errors = [e for e in pool.map(_compile_job, uniq, chunksize=1) if e]
    except Exception as e:
        print(f"# parallel precompile failed ({type(e).__name__}: {e}); compiling lazily")
        return
    print(f"# precompiled {len(uniq)} kernel variants in {time.time() - t:.0f}s with {workers} processes"
          + (f"; {len(errors)} failed, e.g. {errors[0]}" if errors else ""))


# ------------------------------------------------------------------------------------------------------- rope
def bench_rope() -> None:
    print("\n== fused q/k-norm + RoPE + KV store vs unfused (rms_norm q, rms_norm k, rotary, v copy, store_kv)")
    print(f"{'model':<8}{'T':>5}{'unfused us':>12}{'fused us':>10}{'speedup':>9}{'q err':>10}{'cache err':>11}")
    for name, hq, hkv, d, norm in (("qwen3", 16, 8, 128, True), ("llama3", 32, 8, 128, False)):
        for t in (1, 256):
            bs, nb, max_pos = 16, 64, 4096
            qkv = torch.randn(t, (hq + 2 * hkv) * d, device=DEV, dtype=DT)
            pos = torch.randint(0, max_pos, (t,), device=DEV)
            slots = torch.randperm(nb * bs, device=DEV)[:t]
            inv = 1.0 / (1e6 ** (torch.arange(0, d, 2, device=DEV).float() / d))
            fr = torch.arange(max_pos, device=DEV).float()[:, None] * inv[None, :]
            cos, sin = fr.cos(), fr.sin()
            qw = (1 + 0.1 * torch.randn(d, device=DEV)).to(DT) if norm else None
            kw = (1 + 0.1 * torch.randn(d, device=DEV)).to(DT) if norm else None
            c1 = torch.randn(2, nb, bs, hkv, d, device=DEV, dtype=DT)
            c2 = c1.clone()
            qs, ks = hq * d, hkv * d

            def unfused():
                q, k, v = qkv.split([qs, ks, ks], dim=-1)
                if norm:
                    q = rms_norm(q.reshape(t, hq, d), qw, 1e-6).reshape(t, qs)
                    k = rms_norm(k.reshape(t, hkv, d), kw, 1e-6).reshape(t, ks)
                q, k = rotary_embedding(pos, q, k, cos, sin, d, d, True)
                store_kv(k.view(t, hkv, d), v.contiguous().view(t, hkv, d), c1, slots)
                return q

            def fused():
                return qk_norm_rope_store(qkv, pos, slots, c2, cos, sin, num_heads=hq, num_kv_heads=hkv,
                                          head_dim=d, q_norm_weight=qw, k_norm_weight=kw, eps=1e-6)

            q_new = fused().clone()          # first: the unfused rotary rotates slices of qkv in place
            q_ref = unfused()
            q_err, c_err = rel_err(q_new, q_ref), rel_err(c2, c1)
            tu = graph_us([unfused] * CALLS)
            tf = graph_us([fused] * CALLS)
            print(f"{name:<8}{t:>5}{tu:>12.2f}{tf:>10.2f}{tu / tf:>8.2f}x{q_err:>10.1e}{c_err:>11.1e}")


# ------------------------------------------------------------------------------------------------------- main
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budget", type=float, default=60.0, help="seconds for the config sweep")
    ap.add_argument("--no-sweep", action="store_true")
    ap.add_argument("--quick", action="store_true", help="fewer sweep configs")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (Triton interpreter)")
    ap.add_argument("--shapes", default="default", help=f"comma-separated sets of {sorted(SHAPE_SETS)}")
    ap.add_argument("--ms", default=None, help="comma-separated row counts M (default 1,2,4,8)")
    ap.add_argument("--no-rope", action="store_true", help="skip the fused q/k-norm + RoPE benchmark")
    ap.add_argument("--deep", action="store_true", help="also sweep K tiles of 512 and 1024 (for PDL)")
    ap.add_argument("--prefetch", action="store_true", help="also sweep configs with two W tiles in flight")
    ap.add_argument("--acc2d", action="store_true", help="also sweep FMA configs that reduce over K every step")
    args = ap.parse_args()
    global SHAPES, MS
    if not SMOKE:
        SHAPES = [s for name in args.shapes.split(",") for s in SHAPE_SETS[name]]
        MS = tuple(int(m) for m in args.ms.split(",")) if args.ms else MS
    torch.manual_seed(0)
    t0 = time.time()
    name, sms = ("CPU smoke run", 132) if SMOKE else (torch.cuda.get_device_name(), _num_sms(0))
    print(f"# {name}, {sms} SMs, torch {torch.__version__}, triton {__import__('triton').__version__}")
    jobs = []
    for _, k, n, pro in SHAPES:
        for m in MS:
            jobs.append((k, pro, m, default_config(m, n, k, sms)))
            if not args.no_sweep:
                jobs += [(k, pro, m, c) for c in candidates(m, n, k, args.quick)]
    precompile(jobs)
    if not SMOKE:   # the bandwidth ceiling to read GB/s against: a 1 GiB device-to-device copy (read + write)
        a = torch.empty(1 << 29, dtype=torch.int16, device=DEV).random_()
        b = torch.empty_like(a)
        b.copy_(a)
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
        ev[0].record()
        for _ in range(10):
            b.copy_(a)
        ev[1].record()
        ev[1].synchronize()
        print(f"# copy bandwidth {2 * a.numel() * 2 * 10 / ev[0].elapsed_time(ev[1]) / 1e6:.0f} GB/s (read + write)")
        del a, b

    print("\n== GEMM: cuBLAS F.linear (with the unfused prologue kernel for +silu/+norm) vs triton gemv (default "
          "config); us per call in a graph, GB/s = bytes moved / time")
    print(f"{'shape':<16}{'K->N':>13}{'M':>3}{'torch us':>10}{'GB/s':>7}{'gemv us':>9}{'GB/s':>7}{'x':>6}"
          f"{'err':>9}{'err trch':>9}  default config   (err: vs an fp32 reference)")
    best_rows = []
    for label, k, n, pro in SHAPES:
        weights = weight_copies(k, n)
        for m in MS:
            p = Problem(label, k, n, pro, m, weights)
            cfg = default_config(m, n, k, sms)
            tt = p.time(p.torch_call)
            tg = p.time(lambda i: p.gemv_call(i, cfg))
            p.ref = p.reference()
            err, err_t = p.check(cfg, p.ref)
            print(f"{label:<16}{f'{k}->{n}':>13}{m:>3}{tt:>10.2f}{p.bytes / tt / 1e3:>7.0f}{tg:>9.2f}"
                  f"{p.bytes / tg / 1e3:>7.0f}{tt / tg:>6.2f}{err:>9.1e}{err_t:>9.1e}  {_fmt(cfg)}")
            best_rows.append([p, tt, tg, cfg])
    if not args.no_rope:
        bench_rope()
    if args.no_sweep:
        return
    print(f"\n== sweep (budget {args.budget:.0f}s): best config per shape and M")
    print(f"{'shape':<16}{'M':>3}{'torch us':>10}{'default':>9}{'best us':>9}{'GB/s':>7}{'err':>9}  best config "
          f"(next best)")
    sweep_deadline = time.time() + args.budget
    tuned = {}
    for row in best_rows:
        p, tt, tg, dcfg = row
        if time.time() > sweep_deadline:
            print(f"{p.label:<16}{p.m:>3}  (budget spent)")
            continue
        results = []
        for c in candidates(p.m, p.n, p.k, args.quick):
            try:
                results.append((p.time(lambda i: p.gemv_call(i, c)), c))
            except Exception as e:
                print(f"#   {_fmt(c)} failed: {type(e).__name__}: {str(e)[:120]}")
        if not results:
            continue
        results.sort(key=lambda r: r[0])
        (tb, cb), nxt = results[0], results[1:6]
        err = p.check(cb, p.ref)[0]
        print(f"{p.label:<16}{p.m:>3}{tt:>10.2f}{tg:>9.2f}{tb:>9.2f}{p.bytes / tb / 1e3:>7.0f}{err:>9.1e}  "
              f"{_fmt(cb)}" + "".join(f"  ({_fmt(c)} {t:.2f})" for t, c in nxt))
        if tb < tg * 0.97 and err < 2e-2:
            tuned[(1 << (p.m - 1).bit_length(), p.n, p.k)] = cb
    print("\n# paste into tokenmill/kernels/gemv_config.py (TUNED) where the sweep beat the default by > 3% "
          "(a +norm row overrides its plain shape: that is how the model calls it):")
    print("TUNED = {")
    for key, c in tuned.items():
        print(f"    {key}: GemvConfig({c.block_n}, {c.block_k}, {c.split_k}, {c.num_warps}, {c.num_stages}, "
              f"use_dot={c.use_dot}{', prefetch=True' if c.prefetch else ''}{', acc2d=True' if c.acc2d else ''}),")
    print("}")
    print(f"# total {time.time() - t0:.0f}s")


def _fmt(c: GemvConfig) -> str:
    return (f"{'dot' if c.use_dot else 'fma'} n{c.block_n} k{c.block_k} s{c.split_k} w{c.num_warps} st{c.num_stages}"
            + (" pre" if c.prefetch else "") + (" a2" if c.acc2d else ""))


if __name__ == "__main__":
    main()
