"""`tokenmill bench kernels`: measure, on this CUDA device, which decode products the Triton gemv should take instead
of cuBLAS and with which launch config, and write the device's table (the JSON of tokenmill/kernels/configs/).

The products are a model's decode step (--model, repeatable): qkv_proj and gate_up_proj plain and with the RMSNorm
(and residual add) folded in, o_proj, down_proj plain and with the SiLU-and-mul folded in, and the LM head, as one
tensor-parallel rank holds them (--tensor-parallel-size), for the row buckets 1, 2, 4, ... up to --max-rows.
Each is timed as cuBLAS (F.linear after the separate norm or SiLU kernel, as the model runs it unfused) and as a
sweep of gemv configs: tensor-core and FMA tilings at a few K splits, then the best few again with the W / x
prefetches and the per-step K reduction toggled. Every timing is a CUDA-graph replay of back-to-back calls with
rotating weight copies, so each call reads HBM as a decode step does, with programmatic dependent launch as the
model uses it. A product enters the table where the fastest config whose output matches a float64 reference beats
cuBLAS by more than --min-gain.

With --quantization fp8 the products are those the FP8 linear method runs on the gemv at decode: float8 e4m3 weights
with one scale per row, plain products (no prologue; the LM head stays bf16), each against the gemv's untuned
config (triton_gemv.untuned_fp8_config), since cuBLAS has no such product; the entries carry "weight": "fp8".

  tokenmill bench kernels --model qwen3-0.6b --model llama-3-8b               # writes ./NVIDIA_H200.json on an H200
  tokenmill bench kernels --model llama-3-8b --tensor-parallel-size 2 --update --output NVIDIA_H200.json
  tokenmill bench kernels --model llama-3-8b --quantization fp8 --max-rows 1 --update -o NVIDIA_H200.json
  tokenmill bench kernels --check tokenmill/kernels/configs/NVIDIA_H200.json  # every entry against float64

Ship a table by copying it to tokenmill/kernels/configs/ under its file name; the engine loads the file named
after torch.cuda.get_device_name().
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import math
import os
import statistics
import sys
import time
from typing import Callable

import torch
import torch.nn.functional as F

from tokenmill.benchmarks.kernel_products import Product, fp8_products, load_model_config, model_products
from tokenmill.benchmarks.offline_common import require_cuda
from tokenmill.kernels import gemv_config as gc
from tokenmill.kernels.gemv_config import GemvConfig, GemvEntry, GemvTable

PROG = "tokenmill bench kernels"
# Relative error vs float64 above which a config is wrong: bf16 rounding of the output is ~5e-3; the SiLU-and-mul
# epilogue rounds three more times (gate, up, silu(gate)). A wrong tile or split is off by O(1).
TOLERANCE = 2e-2
_EPS = 1e-6
# Tensor-core tilings (block_n, block_k, num_warps, num_stages) and FMA ones (rows <= 2, where they can win).
_DOT = [(32, 128, 4, 3), (32, 256, 4, 3), (64, 64, 4, 4), (64, 128, 4, 3), (64, 128, 4, 5), (64, 256, 4, 3),
        (64, 256, 8, 3), (128, 64, 4, 4), (128, 128, 4, 3), (128, 128, 8, 3), (128, 256, 8, 3), (256, 64, 8, 4)]
# Deep K tiles with one stage: with PDL a program's first tile is read before it waits on the previous kernel, so
# one tile holding its whole share of W overlaps that kernel completely.
_FMA = [(16, 128, 4, 1), (32, 128, 4, 1), (16, 256, 4, 1), (32, 256, 8, 1), (8, 256, 4, 1), (8, 512, 4, 1),
        (16, 512, 4, 1), (32, 512, 8, 1), (4, 1024, 4, 1), (8, 1024, 4, 1), (16, 1024, 8, 1), (4, 2048, 8, 1)]
_SPLITS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)
_REFINE = 8                # configs of the first pass whose variants the second pass times


def row_buckets(max_rows: int) -> list[int]:
    if max_rows < 1 or max_rows > gc.MAX_ROWS or max_rows & (max_rows - 1):
        raise ValueError(f"--max-rows must be a power of two in 1..{gc.MAX_ROWS}, got {max_rows}")
    return [1 << i for i in range(max_rows.bit_length())]


# ------------------------------------------------------------------------------------------------- candidates
def first_pass(m: int, n: int, k: int, sms: int, quick: bool = False) -> list[GemvConfig]:
    """Plain tilings, each at no K split and at the splits closest to 1, 2 and 4 programs per SM."""
    bases = [(b, True) for b in (_DOT[3:6] + _DOT[8:9] if quick else _DOT)]
    if m <= 2 and not quick:
        bases += [(b, False) for b in _FMA if b[1] <= max(k, 128)]
    out = []
    for (bn, bk, warps, stages), dot in bases:
        tiles, steps = -(-n // bn), max(1, k // bk)
        ok = [s for s in _SPLITS if s <= steps]
        splits = {1} | {min(ok, key=lambda s: abs(tiles * s - target)) for target in (sms, 2 * sms, 4 * sms)}
        out += [GemvConfig(bn, bk, s, warps, stages, use_dot=dot) for s in sorted(splits)]
    return out


def second_pass(best: list[GemvConfig]) -> list[GemvConfig]:
    """The variants of the best first-pass configs: two W tiles in flight, x one K step ahead, and (FMA) the
    reduction over K every step."""
    seen, out = set(best), []
    for cfg in best:
        for pre in (False, True):
            for xpre in (False, True):
                for acc2d in ((False, True) if not cfg.use_dot else (False,)):
                    v = dataclasses.replace(cfg, prefetch=pre, xprefetch=xpre, acc2d=acc2d)
                    if v not in seen:
                        seen.add(v)
                        out.append(v)
    return out


# ------------------------------------------------------------------------------------------------------ cases
def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out = out.double()
    if not torch.isfinite(out).all():
        return math.inf
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


class Case:
    """One product at one row count on `device`: random inputs, rotating weight copies (shared by the product's
    cases; (weight, row scales or None) pairs), and the calls timed: cuBLAS after the separate prologue kernel (an
    fp8 weight: the gemv's untuned config), or the gemv with a config."""

    def __init__(self, product: Product, m: int, weights: list[tuple[torch.Tensor, torch.Tensor | None]],
                 seed: int = 0):
        from tokenmill.layers.activation import SiluAndMul
        from tokenmill.layers.layernorm import RMSNorm
        self.product, self.m, self.weights = product, m, weights
        w = weights[0][0]
        dev, dt, k = w.device, torch.bfloat16 if product.weight else w.dtype, product.k
        g = torch.Generator(device=dev).manual_seed(seed * 7919 + m)
        k_in = 2 * k if product.prologue == "silu_mul" else k
        self.x = torch.randn(m, k_in, generator=g, device=dev).to(dt)
        self.residual = self.norm = None
        if product.prologue == "rmsnorm":
            self.residual = torch.randn(m, k, generator=g, device=dev).to(dt)
            self.norm = RMSNorm(k, _EPS).to(dev)
            self.norm.weight.data = (1 + 0.1 * torch.randn(k, generator=g, device=dev)).to(dt)
        self._silu = SiluAndMul()

    def call(self, i: int, cfg: GemvConfig | None, epilogue: str | None = None) -> Callable[[], torch.Tensor]:
        """The i-th call (weight copy i mod copies): the gemv with `cfg`, or cuBLAS for None."""
        from tokenmill.kernels.triton_gemv import gemv, untuned_fp8_config
        (w, scale), x, pro = self.weights[i % len(self.weights)], self.x, self.product.prologue
        if scale is not None:
            if cfg is None:
                cfg = untuned_fp8_config(self.m, self.product.n, self.product.k, x.device)
            return lambda: gemv(x, w, weight_scale=scale, config=cfg)
        if cfg is None:
            if pro == "silu_mul":
                return lambda: F.linear(self._silu(x), w)
            if pro == "rmsnorm":
                return lambda: F.linear(self.norm(x, self.residual)[0], w)
            return lambda: F.linear(x, w)
        if pro == "silu_mul":
            return lambda: gemv(x, w, act="silu_mul", config=cfg)
        if pro == "rmsnorm":
            return lambda: gemv(x, w, norm_weight=self.norm.weight, eps=_EPS, residual=self.residual, config=cfg,
                                epilogue=epilogue)[0]
        return lambda: gemv(x, w, config=cfg, epilogue=epilogue)

    def error(self, cfg: GemvConfig, epilogue: str | None = None) -> float:
        """Relative error of the gemv with `cfg` against float64 (the residual sum rounded as torch rounds it)."""
        k, x = self.product.k, self.x.double()
        if self.product.prologue == "silu_mul":
            x = F.silu(x[:, :k]) * x[:, k:]
        elif self.product.prologue == "rmsnorm":
            h = (self.x + self.residual).double()
            x = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + _EPS) * self.norm.weight.double()
        w, scale = self.weights[0]
        ref = F.linear(x, w.double() if scale is None else w.double() * scale.double()[:, None])
        if epilogue == "silu_mul":
            half = ref.shape[-1] // 2
            ref = F.silu(ref[:, :half]) * ref[:, half:]
        return _rel_err(self.call(0, cfg, epilogue)(), ref)


def weight_copies(product: Product, device, dtype=torch.bfloat16, calls: int = 20
                  ) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """Enough copies of W (256 MB or more together, at most `calls`) that no call finds its weight in L2, each with
    its row scales (fp8: the largest magnitude of a row at e4m3's 448) or None."""
    nbytes = product.n * product.k * (1 if product.weight == "fp8" else torch.finfo(dtype).bits // 8)
    copies = max(1, min(calls, math.ceil(256e6 / nbytes)))
    out = []
    for _ in range(copies):
        w = torch.randn(product.n, product.k, device=device) * product.k ** -0.5
        if product.weight == "fp8":
            scale = (w.abs().amax(1) / 448.0).clamp_min(1e-12)
            out.append(((w / scale[:, None]).to(torch.float8_e4m3fn), scale.float().contiguous()))
        else:
            out.append((w.to(dtype), None))
    return out


# ----------------------------------------------------------------------------------------------------- timing
def graph_us(calls: list[Callable[[], object]], replays: int = 7) -> float:
    """Median time per call (us) of one CUDA graph that runs `calls` back to back."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):             # warm-up outside the capture: compiles, split-K counters
        for c in calls[:2]:
            c()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for c in calls:
            c()
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    del g
    return statistics.median(times) * 1e3 / len(calls)


def _compile_job(job) -> str | None:
    """Pool worker: compile one kernel variant into Triton's disk cache, at the product's own shape."""
    m, n, k, pro, wt, cfg = job
    try:
        case = Case(Product("compile", n, k, pro, wt), m,
                    [(torch.zeros(n, k, device="cuda").to(torch.float8_e4m3fn if wt else torch.bfloat16),
                      torch.ones(n, device="cuda") if wt else None)])
        case.call(0, GemvConfig(**cfg))()
        torch.cuda.synchronize()
        return None
    except Exception as e:  # reported; the timing pass then skips that config too
        return f"{cfg}: {type(e).__name__}: {str(e)[:160]}"


def precompile(jobs: list[tuple[int, Product, GemvConfig]], out=print) -> None:
    """Compile every variant in parallel processes first; the timing process then loads them from the cache."""
    from tokenmill.kernels.triton_gemv import launch_plan
    seen, uniq = set(), []
    for m, p, cfg in jobs:
        key = (m, p.k, p.prologue, p.weight, cfg, launch_plan(m, p.n, p.k, cfg)[2] > 1)
        if key not in seen:
            seen.add(key)
            uniq.append((m, p.n, p.k, p.prologue, p.weight, dataclasses.asdict(cfg)))
    if not uniq:
        return
    import multiprocessing
    t = time.time()
    workers = max(1, min(len(uniq), (os.cpu_count() or 2) - 1, 16))
    with multiprocessing.get_context("spawn").Pool(workers) as pool:
        errors = [e for e in pool.map(_compile_job, uniq, chunksize=1) if e]
    out(f"# compiled {len(uniq)} kernel variants in {time.time() - t:.0f} s with {workers} processes"
        + (f"; {len(errors)} failed, e.g. {errors[0]}" if errors else ""))


# ------------------------------------------------------------------------------------------------------ sweep
def _fmt(cfg: GemvConfig | None) -> str:
    if cfg is None:
        return "-"
    flags = "".join(f" {f}" for f in ("prefetch", "acc2d", "xprefetch") if getattr(cfg, f))
    return (f"{'dot' if cfg.use_dot else 'fma'} n{cfg.block_n} k{cfg.block_k} split{cfg.split_k} "
            f"w{cfg.num_warps} st{cfg.num_stages}{flags}")


def pick(timed: list[tuple[float, GemvConfig]], cublas_us: float, min_gain: float,
         accurate: Callable[[GemvConfig], bool], tries: int = 5) -> tuple[float, GemvConfig] | None:
    """The fastest of the `tries` fastest configs that is accurate, if it beats cuBLAS by more than min_gain."""
    for us, cfg in sorted(timed, key=lambda r: r[0])[:tries]:
        if us >= cublas_us * (1 - min_gain):
            return None
        if accurate(cfg):
            return us, cfg
    return None


def measure(products: list[Product], rows: list[int], device: torch.device, *, quick: bool = False,
            min_gain: float = 0.03, calls: int = 20, budget_s: float = 0.0, out=print,
            time_case: Callable[[Case, GemvConfig | None], float] | None = None,
            candidates: Callable[[int, Product], list[GemvConfig]] | None = None
            ) -> tuple[dict[gc.Key, GemvEntry], set[gc.Key]]:
    """(the entries that beat cuBLAS, every key measured). `time_case` and `candidates` default to the CUDA-graph
    timing and the two-pass sweep; once the budget (0 = none) is spent, the products not yet timed and the second
    pass are skipped."""
    sms = gc.sm_count(device)
    if time_case is None:
        def time_case(case, cfg):
            return graph_us([case.call(i, cfg) for i in range(calls)])
    if candidates is None:
        def candidates(m, p):
            return first_pass(m, p.n, p.k, sms, quick)
    on_cuda = device.type == "cuda"
    if on_cuda:
        precompile([(m, p, c) for p in products for m in rows for c in candidates(m, p)], out)
    deadline = time.time() + budget_s if budget_s > 0 else math.inf
    base = "untuned us" if any(p.weight for p in products) else "cuBLAS us"
    out(f"{'product':<20}{'N':>8}{'K':>7}{'rows':>5}{base:>11}{'gemv us':>9}{'gain':>7}  config")
    entries, measured, pending = {}, set(), []
    for p in products:
        if time.time() > deadline:
            out(f"{p.name:<20}{p.n:>8}{p.k:>7}  (budget spent: not measured)")
            continue
        weights = weight_copies(p, device, calls=calls if on_cuda else 1)
        for m in rows:
            case = Case(p, m, weights)
            timed = []
            for cfg in candidates(m, p):
                try:
                    timed.append((time_case(case, cfg), cfg))
                except Exception as e:  # a config this device cannot launch (shared memory, registers)
                    out(f"#   {p.name} rows {m}: {_fmt(cfg)} failed: {type(e).__name__}: {str(e)[:120]}")
            cublas_us = time_case(case, None)
            pending.append((p, m, case, cublas_us, timed))
            best_us = min((us for us, _ in timed), default=math.nan)
            out(f"#   {p.name} rows {m}: cuBLAS {cublas_us:.2f} us, best of {len(timed)} configs {best_us:.2f} us")
    if pending and not quick and time.time() <= deadline:
        best = {(p, m): [c for _, c in sorted(timed, key=lambda r: r[0])[:_REFINE]] for p, m, _, _, timed in pending}
        if on_cuda:
            precompile([(m, p, c) for (p, m), cfgs in best.items() for c in second_pass(cfgs)], out)
        for p, m, case, _, timed in pending:
            for cfg in second_pass(best[(p, m)]):
                try:
                    timed.append((time_case(case, cfg), cfg))
                except Exception as e:
                    out(f"#   {p.name} rows {m}: {_fmt(cfg)} failed: {type(e).__name__}: {str(e)[:120]}")
    for p, m, case, cublas_us, timed in pending:
        key = (m, *p.key_tail)
        measured.add(key)
        won = pick(timed, cublas_us, min_gain, lambda c: case.error(c) < TOLERANCE)
        fastest = min(timed, key=lambda r: r[0]) if timed else (math.nan, None)
        us, cfg = won or fastest
        gain = 1 - us / cublas_us if timed else math.nan
        out(f"{p.name:<20}{p.n:>8}{p.k:>7}{m:>5}{cublas_us:>11.2f}{us:>9.2f}{gain:>7.1%}  "
            f"{'-> table ' if won else ''}{_fmt(cfg)}")
        if won:
            entries[key] = GemvEntry(cfg, round(cublas_us, 2), round(us, 2))
    return entries, measured


def merge_entries(old: dict[gc.Key, GemvEntry], entries: dict[gc.Key, GemvEntry], measured: set[gc.Key]
                  ) -> dict[gc.Key, GemvEntry]:
    """An existing table's entries updated by a run: what the run measured is replaced (or dropped where the gemv
    lost), the rest is kept."""
    return {**{key: e for key, e in old.items() if key not in measured}, **entries}


# ------------------------------------------------------------------------------------------------------ check
def check_table(table: GemvTable, device: torch.device, out=print) -> int:
    """Every entry against float64 at its own shape (and, without the SiLU prologue and for even N, with the
    SiLU-and-mul epilogue too); the number of failures."""
    failures = 0
    for (m, n, k, pro, wt), e in sorted(table.entries.items(), key=str):
        p = Product(f"{n}x{k}", n, k, pro, wt)
        case = Case(p, m, weight_copies(p, device, calls=1))
        for epilogue in (None, "silu_mul") if pro != "silu_mul" and n % 2 == 0 and not wt else (None,):
            err = case.error(e.config, epilogue)
            bad = not err < (3 * TOLERANCE if epilogue else TOLERANCE)
            failures += bad
            out(f"{'FAIL' if bad else 'ok  '} rows {m:>2} N {n:>7} K {k:>6} {pro or wt or 'plain':<8}"
                f"{' +silu epilogue' if epilogue else '':<15} err {err:.1e}  {_fmt(e.config)}")
    return failures


# ------------------------------------------------------------------------------------------------------- main
def make_parser(prog: str = PROG) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", action="append", default=[],
                   help="A shipped shape (qwen3-0.6b, llama-3-8b), a model directory or a config.json; repeatable.")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                   help="Measure one rank's shards of the products (default 1).")
    p.add_argument("--max-rows", type=int, default=8,
                   help="Largest row bucket (a power of two, at most 16): buckets 1, 2, 4, ... up to it. Default 8.")
    p.add_argument("--output", "-o", default=None,
                   help="Where to write the table. Default: the device's file name in the current directory.")
    p.add_argument("--update", action="store_true",
                   help="Keep the entries of an existing --output file for the products not measured now.")
    p.add_argument("--min-gain", type=float, default=0.03,
                   help="How much faster than cuBLAS a product's best config must be to enter the table (default "
                        "0.03, 3%%).")
    p.add_argument("--quantization", "-q", choices=("fp8",), default=None,
                   help="Measure the decode products of the FP8 linear method instead (fp8 weights with a scale per "
                        "row, plain products, against the gemv's untuned config); entries carry \"weight\": "
                        "\"fp8\".")
    p.add_argument("--quick", action="store_true", help="Fewer configs: a few tensor-core tilings, no second pass.")
    p.add_argument("--budget", type=float, default=0.0,
                   help="Seconds after which products not yet timed are skipped (default 0: no limit).")
    p.add_argument("--check", nargs="?", const="", default=None, metavar="TABLE",
                   help="Instead of measuring, run every entry of TABLE (default: this device's shipped table) "
                        "against float64; exit status 1 if any is wrong.")
    return p


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = make_parser()
    args = parser.parse_args(argv)
    if args.check is not None:
        given = [flag for flag, dest in (("--model", "model"), ("--tensor-parallel-size", "tensor_parallel_size"),
                                         ("--max-rows", "max_rows"), ("--output", "output"), ("--update", "update"),
                                         ("--min-gain", "min_gain"), ("--quick", "quick"), ("--budget", "budget"),
                                         ("--quantization", "quantization"))
                 if getattr(args, dest) != parser.get_default(dest)]
        if given:
            parser.error(f"--check runs a table's entries; it takes none of {', '.join(given)}")
        return args
    if not args.model:
        parser.error("give --model (a shipped shape such as qwen3-0.6b or llama-3-8b, or a model directory)")
    if args.tensor_parallel_size < 1:
        parser.error(f"--tensor-parallel-size must be >= 1, got {args.tensor_parallel_size}")
    if not 0 <= args.min_gain < 1:
        parser.error(f"--min-gain must be in [0, 1), got {args.min_gain}")
    if args.budget < 0:
        parser.error(f"--budget must be >= 0, got {args.budget}")
    try:
        args.rows = row_buckets(args.max_rows)
        products = [pr for m in args.model for pr in model_products(load_model_config(m), args.tensor_parallel_size)]
    except ValueError as e:
        parser.error(str(e))
    if args.quantization == "fp8":
        products = fp8_products(products)
    seen = set()                      # one product per shape: two models may share one
    args.products = [pr for pr in products if pr.key_tail not in seen and not seen.add(pr.key_tail)]
    return args


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    require_cuda(PROG)
    device = torch.device("cuda", torch.cuda.current_device())
    name = torch.cuda.get_device_name(device)
    torch.manual_seed(0)
    if args.check is not None:
        path = args.check or os.path.join(gc.CONFIG_DIR, gc.device_file_name(name))
        if not os.path.isfile(path):
            raise SystemExit(f"{PROG}: --check: no table at {path}")
        failures = check_table(gc.read_table(path), device)
        print(f"{path}: {'all entries match float64' if not failures else f'{failures} wrong'}")
        return 1 if failures else 0
    output = args.output or gc.device_file_name(name)
    old, before = {}, None
    if args.update and os.path.isfile(output):
        previous = gc.read_table(output)
        if previous.device not in (None, name):
            raise SystemExit(f"{PROG}: --update: {output} holds the table of {previous.device}, this is {name}")
        old, before = previous.entries, previous.measured
    print(f"# {name}, {gc.sm_count(device)} SMs, torch {torch.__version__}, triton "
          f"{__import__('triton').__version__}; rows {args.rows}")
    t0 = time.time()
    entries, measured = measure(args.products, args.rows, device, quick=args.quick, min_gain=args.min_gain,
                                budget_s=args.budget)
    merged = merge_entries(old, entries, measured)
    kept = len(merged) - len(entries)
    cmd = " ".join([PROG] + list(sys.argv[1:] if argv is None else argv))
    table = GemvTable(merged, device=name, measured=(
        f"`{cmd}` on {datetime.date.today()} ({name}, torch {torch.__version__}, triton "
        f"{__import__('triton').__version__}): each product timed as a CUDA-graph replay of 20 back-to-back calls "
        f"with rotating weights; cublas_us is F.linear after the separate norm or SiLU-and-mul kernel (an fp8 "
        f"entry's: the gemv's untuned config); an entry beat it by more than {args.min_gain:.0%}."
        + (f" The {kept} entries kept from before: {before}" if kept and before else "")))
    gc.write_table(output, table)
    print(f"wrote {output}: {len(entries)} measured entries" + (f", {kept} kept" if kept else "")
          + f" ({time.time() - t0:.0f} s)")
    return 0
