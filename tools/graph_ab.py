"""A/B of kernel choices inside the whole batch-1 decode graph (runs on the GPU machine).

Why: a product's config measured alone (tools/bench_gemv.py chains the same product 20 times) did not always carry
into the model, where each product follows a short latency-bound kernel. Here every variant re-captures the batch-1
decode graph of one loaded model, with real decode inputs in its buffers, and times it replayed back to back;
variants alternate over several rounds so drift hits them alike. Also reports, for batch-1 decode as served (async
scheduling), how much of each step the host was busy (wall minus the time it waited for the device).

Usage: python3 tools/graph_ab.py qwen3-0.6b|llama-3-8b [--rounds 3] [--only NAME,NAME] [--context TOKENS]
"""
from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import statistics
import time

import torch

from tokenmill import LLM, SamplingParams
from tokenmill.benchmarks.offline_common import shipped_model_dir
from tokenmill.kernels import gemv_config
from tokenmill.kernels.gemv_config import GemvConfig
from tokenmill.sampling_params import RequestOutputKind


def fma(n, k, s=1, w=4, pre=False, a2=False, x=False):
    return GemvConfig(n, k, s, w, 1, use_dot=False, prefetch=pre, acc2d=a2, xprefetch=x)


def dot(n, k, s=1, w=4, st=3, x=False):
    return GemvConfig(n, k, s, w, st, use_dot=True, xprefetch=x)


# name -> (environment, {(M, N, K, prologue): config or None}[, {"module.attr": value} patches])
OPROJ = (1, 4096, 4096, None)         # Llama o_proj
QKVN = (1, 6144, 4096, "rmsnorm")     # Llama qkv with the RMSNorm (+ residual) folded in
GU = (1, 28672, 4096, None)           # Llama gate_up (SiLU-and-mul in its epilogue at batch 1)
GUN = (1, 28672, 4096, "rmsnorm")     # Llama gate_up with the RMSNorm (+ residual) folded in: no norm kernel
DOWN = (1, 4096, 14336, None)         # Llama down_proj


def splits(n):
    """Decode attention with n splits whatever the batch and context (1: stage 1 writes the output, no stage 2)."""
    return {"tokenmill.attention.backends.triton_attn.decode_num_splits": lambda *a, **k: n}


VARIANTS = {
    "qwen3-0.6b": {
        "base": ({}, {}),
        **{f"splits{n}": ({}, {}, splits(n)) for n in (4, 16, 32)},
        # The table's batch-1 entries with the x prefetch added, where a program takes more than one K step
        # (session 14)
        "gun-x": ({}, {(1, 6144, 1024, "rmsnorm"): fma(8, 512, a2=True, x=True)}),
        "down-x": ({}, {(1, 1024, 3072, "silu_mul"): fma(4, 2048, w=8, pre=True, x=True)}),
        "lm-x": ({}, {(1, 151936, 1024, None): fma(16, 256, pre=True, a2=True, x=True)}),
    },
    "llama-3-8b": {
        "base": ({}, {}),
        "qkvn-f16x256w8pa": ({}, {QKVN: fma(16, 256, w=8, pre=True, a2=True)}),
        "qkvn-f16x512pa": ({}, {QKVN: fma(16, 512, pre=True, a2=True)}),
        "qkvn-f32x256w8pa": ({}, {QKVN: fma(32, 256, w=8, pre=True, a2=True)}),
        "o-f16x512w8pa": ({}, {OPROJ: fma(16, 512, w=8, pre=True, a2=True)}),
        "o-f8x512w8pa": ({}, {OPROJ: fma(8, 512, w=8, pre=True, a2=True)}),
        "o-f16x256w8pa": ({}, {OPROJ: fma(16, 256, w=8, pre=True, a2=True)}),
        "gu-d64x256st4": ({}, {GU: dot(64, 256, st=4)}),
        "gu-d64x128st4": ({}, {GU: dot(64, 128, st=4)}),
        "gu-d128x128w8": ({}, {GU: dot(128, 128, w=8)}),
        "gu-d32x256": ({}, {GU: dot(32, 256)}),
        "gu-d64x256w8": ({}, {GU: dot(64, 256, w=8)}),
        "gu-f16x512w8pa": ({}, {GU: fma(16, 512, w=8, pre=True, a2=True)}),
        # Session 11 measured gate_up + norm at dot 64 x 64 (xprefetch) +1.6%; these are at the session-12 config.
        "gun-d128x128w8x": ({}, {GUN: dot(128, 128, w=8, x=True)}),
        "gun-d128x128w8x-st4": ({}, {GUN: dot(128, 128, w=8, st=4, x=True)}),
        "gun-d64x128w4x": ({}, {GUN: dot(64, 128, x=True)}),
        "qkvn-f16x512w8pax": ({}, {QKVN: fma(16, 512, w=8, pre=True, a2=True, x=True)}),   # the table's since s14
        "qkvn-f16x512w8pa": ({}, {QKVN: fma(16, 512, w=8, pre=True, a2=True)}),            # the table's before s14
        # The x prefetch added to the table's entries (session 14; o-x and gu-x won and are the table's now)
        "o-x": ({}, {OPROJ: fma(8, 512, pre=True, a2=True, x=True)}),
        "gu-x": ({}, {GU: dot(128, 128, w=8, x=True)}),
        "down-x": ({}, {DOWN: dot(64, 256, s=4, x=True)}),
        "lm-x": ({}, {(1, 128256, 4096, None): dot(64, 128, x=True)}),
        "o-old": ({}, {OPROJ: fma(8, 512, pre=True, a2=True)}),         # the table's before s14
        "gu-old": ({}, {GU: dot(128, 128, w=8)}),                        # the table's before s14
        "down-f16x512w8pa": ({}, {DOWN: fma(16, 512, w=8, pre=True, a2=True)}),
        "down-d64x256s4st4": ({}, {DOWN: dot(64, 256, s=4, st=4)}),
        "down-d64x256s4w8": ({}, {DOWN: dot(64, 256, s=4, w=8)}),
    },
}


def _owner(path: str):
    """(object, attribute name) of "package.module[.Class].attr": the longest importable module prefix, then
    attribute lookups."""
    parts = path.split(".")
    for i in range(len(parts) - 1, 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for name in parts[i:-1]:
            obj = getattr(obj, name)
        return obj, parts[-1]
    raise ValueError(f"no importable module in {path!r}")


@contextlib.contextmanager
def applied(env: dict, table: dict, patches: dict | None = None):
    patches = patches or {}
    targets = {}
    for path, value in patches.items():
        m, attr = _owner(path)
        targets[path] = (m, attr, getattr(m, attr))
        setattr(m, attr, value)
    old_env = {k: os.environ.get(k) for k in env}
    old_tab = {k: gemv_config.MEASURED_FASTER.get(k) for k in table}
    os.environ.update(env)
    for k, cfg in table.items():
        if cfg is None:
            gemv_config.MEASURED_FASTER.pop(k, None)
        else:
            gemv_config.MEASURED_FASTER[k] = (cfg, 0.0, 0.0)
    try:
        yield
    finally:
        for k, v in old_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        for k, v in old_tab.items():
            if v is None:
                gemv_config.MEASURED_FASTER.pop(k, None)
            else:
                gemv_config.MEASURED_FASTER[k] = v
        for m, attr, value in targets.values():
            setattr(m, attr, value)


def time_graph(cg, reps: int) -> float:
    from tokenmill.worker.cuda_graph import GraphKey
    cg._forward(GraphKey(1, 1))          # eager warm-up: compiles new variants outside the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        cg._forward(GraphKey(1, 1))
    for _ in range(20):
        g.replay()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(reps):
        g.replay()
    torch.cuda.synchronize()
    cg.sync_host_io()                    # these replays advanced the device's host-IO counter
    return 1000 * (time.perf_counter() - t) / reps


def host_busy(eng, core, steps: int) -> tuple[float, float]:
    """(wall ms, device-wait ms) per async batch-1 decode step."""
    waited = [0.0]
    orig = torch.cuda.Event.synchronize

    def sync(ev):
        t = time.perf_counter()
        orig(ev)
        waited[0] += time.perf_counter() - t
    torch.cuda.Event.synchronize = sync
    try:
        core.async_scheduling = True
        for _ in range(8):
            eng.step()
        waited[0] = 0.0
        t = time.perf_counter()
        for _ in range(steps):
            eng.step()
        wall = time.perf_counter() - t
    finally:
        torch.cuda.Event.synchronize = orig
    return 1000 * wall / steps, 1000 * waited[0] / steps


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=0, help="graph replays per timing (0: ~1.5 s worth)")
    ap.add_argument("--only", default="", help="comma-separated variant names (base is always run)")
    ap.add_argument("--context", default="1266",
                    help="tokens in the request's context when the graphs are timed, or a comma list (each >= 180, "
                         "timed in increasing order in one process; the batch-1 latency targets decode at 128-384)")
    ap.add_argument("--host-seconds", type=float, default=0.0,
                    help="only run async batch-1 decode for this long (a window for py-spy), then exit")
    args = ap.parse_args()
    variants = VARIANTS[args.model]
    if args.only:
        keep = {"base", *args.only.split(",")}
        variants = {k: v for k, v in variants.items() if k in keep}
    llm = LLM(shipped_model_dir(args.model), load_format="dummy", skip_tokenizer_init=True, max_model_len=2048,
              cudagraph_capture_sizes=[1])
    eng = llm.llm_engine
    core = eng.engine_core
    cg = core.executor.worker.runner.cuda_graphs
    sp = SamplingParams(temperature=1.0, max_tokens=100000, ignore_eos=True, detokenize=False,
                        output_kind=RequestOutputKind.FINAL_ONLY)
    eng.add_request("r", {"prompt_token_ids": list(range(100, 228))}, sp)
    contexts = sorted(int(c) for c in args.context.split(","))
    warm = min(130, contexts[0] - 128 - 28)
    host_steps = max(20, contexts[0] - 128 - warm - 8)
    for _ in range(warm):                # the bench's shape: 128 prompt tokens, then decode
        eng.step()
    if args.host_seconds:
        # Stay inside max_model_len (2048): past it the request ends and the remaining steps are empty.
        steps = min(int(args.host_seconds * 1000 / host_busy(eng, core, 100)[0]), 1600)
        wall, wait = host_busy(eng, core, steps)
        print(f"{steps} async batch-1 steps: wall {wall:.3f} ms, waiting on the device {wait:.3f} ms")
        return
    wall, wait = host_busy(eng, core, host_steps)
    print(f"async batch-1 step: wall {wall:.3f} ms, waiting on the device {wait:.3f} ms, host busy "
          f"{wall - wait:.3f} ms")
    core.async_scheduling = False
    eng.step()
    ctx = 128 + warm + 8 + host_steps + 1        # the request's context now, give or take a token
    for c in contexts:
        for _ in range(c - ctx):
            eng.step()
        ctx = max(ctx, c)
        torch.cuda.synchronize()
        time_variants(args, cg, variants, c)


def time_variants(args, cg, variants: dict, context: int) -> None:
    reps = args.reps or max(50, int(1500 / max(0.1, time_graph(cg, 20))))
    results: dict[str, list[float]] = {k: [] for k in variants}
    for r in range(args.rounds):
        for name, variant in variants.items():
            with applied(*variant):
                results[name].append(time_graph(cg, reps))
        print(f"round {r}: " + ", ".join(f"{k} {v[-1]:.4f}" for k, v in results.items()), flush=True)
    base = statistics.median(results["base"])
    print(f"{args.model}: batch-1 decode graph at a context of ~{context} tokens, ms per replay (median of "
          f"{args.rounds} rounds x {reps} replays)")
    for name, ts in results.items():
        med = statistics.median(ts)
        print(f"  {name:22s} {med:.4f}  ({100 * (med / base - 1):+.2f}%)  [{', '.join(f'{t:.4f}' for t in ts)}]")


if __name__ == "__main__":
    main()
