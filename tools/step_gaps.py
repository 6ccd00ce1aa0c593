"""Where a batch-1 decode step's time goes between CUDA graph replays (GPU machine).

Runs the `tokenmill bench latency` shape (one request, 128 prompt tokens, 256 out, dummy weights) under
torch.profiler and pairs each decode graph's launch on the host with its kernels on the device. Per step it reports
the graph's span on the device, the idle time before the next graph starts, the copies that ran in that gap, and
how far ahead of the device the host launched the next graph (negative: the host was late and the device idled).
Also prints the uninstrumented decode ms per token (as bench latency computes it) and the graph replayed back to
back, so the profile's overhead can be judged.

Usage: python3 tools/step_gaps.py MODEL [--trace PATH.json.gz] [engine kwargs as key=value ...]
"""
from __future__ import annotations

import gzip
import json
import statistics
import sys
import time

import numpy as np
import torch
from torch.profiler import ProfilerActivity, profile

from tokenmill import LLM, SamplingParams
from tokenmill.benchmarks.offline_common import shipped_model_dir


def _kwargs(items: list[str]) -> dict:
    out = {}
    for it in items:
        k, v = it.split("=", 1)
        try:
            out[k] = json.loads(v)
        except ValueError:
            out[k] = v
    return out


def decode_ms(llm: LLM, inputs: list, iters: int = 3) -> float:
    def run(n: int) -> float:
        sp = SamplingParams(temperature=1.0, max_tokens=n, ignore_eos=True, detokenize=False)
        llm.reset_prefix_cache()
        t = time.perf_counter()
        llm.generate(inputs, sp, use_tqdm=False)
        return time.perf_counter() - t
    full = statistics.median(run(256) for _ in range(iters))
    first = statistics.median(run(1) for _ in range(iters))
    return 1000 * (full - first) / 255


def analyse(events: list[dict]) -> dict:
    """Per-step figures from a chrome trace's events (all times in us)."""
    launches = sorted((e for e in events if e.get("cat") == "cuda_runtime" and e["name"] == "cudaGraphLaunch"),
                      key=lambda e: e["ts"])
    corr = {e["args"]["correlation"]: i for i, e in enumerate(launches)}
    gpu = sorted((e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")),
                 key=lambda e: e["ts"])
    spans: list[list[float]] = [[float("inf"), 0.0, 0.0, 0] for _ in launches]  # start, end, busy, kernels
    others = []
    for e in gpu:
        i = corr.get(e.get("args", {}).get("correlation"))
        if i is None or e.get("cat") != "kernel":
            others.append(e)
            continue
        s = spans[i]
        s[0] = min(s[0], e["ts"])
        s[1] = max(s[1], e["ts"] + e["dur"])
        s[2] += e["dur"]
        s[3] += 1
    if not any(s[3] for s in spans):
        # Kernels not tagged with their graph launch's correlation id: split the stream at the graph's first
        # kernel (the placeholder fill) instead, pairing the k-th run of it with the k-th launch.
        kern = [e for e in others if e.get("cat") == "kernel"]
        starts = [i for i, e in enumerate(kern) if "fill_placeholders" in e["name"]]
        for g, (lo, hi) in enumerate(zip(starts, starts[1:] + [len(kern)])):
            if g >= len(spans):
                break
            for e in kern[lo:hi]:
                s = spans[g]
                s[0], s[1] = min(s[0], e["ts"]), max(s[1], e["ts"] + e["dur"])
                s[2] += e["dur"]
                s[3] += 1
        others = [e for e in others if e.get("cat") != "kernel"]
        print("note: graph kernels carried no launch correlation; grouped by the placeholder-fill kernel")
    rows = []
    oi = 0
    for i in range(len(launches) - 1):
        a, b = spans[i], spans[i + 1]
        if not a[3] or not b[3]:
            continue
        while oi < len(others) and others[oi]["ts"] < a[1]:
            oi += 1
        gap_ops = []
        j = oi
        while j < len(others) and others[j]["ts"] < b[0]:
            gap_ops.append(others[j])
            j += 1
        lead = a[1] - (launches[i + 1]["ts"] + launches[i + 1]["dur"])  # > 0: launched before the device idled
        rows.append({"span": a[1] - a[0], "busy": a[2], "kernels": a[3], "gap": b[0] - a[1],
                     "period": b[0] - a[0], "lead": lead, "launch_dur": launches[i + 1]["dur"],
                     "gap_ops": [(o["name"][:40], round(o["dur"], 2), round(o["ts"] - a[1], 2)) for o in gap_ops]})
    return {"rows": rows, "n_launches": len(launches)}


def summary(rows: list[dict]) -> None:
    def st(key):
        v = np.array([r[key] for r in rows])
        return f"median {np.median(v):8.2f}  mean {v.mean():8.2f}  p10 {np.percentile(v, 10):8.2f}  " \
               f"p90 {np.percentile(v, 90):8.2f}"
    print(f"{len(rows)} decode steps (us):")
    for k in ("period", "span", "busy", "gap", "lead", "launch_dur"):
        print(f"  {k:10s} {st(k)}")
    late = [r for r in rows if r["lead"] < 0]
    print(f"  host late (next graph launched after the device finished this one): {len(late)} of {len(rows)} "
          f"steps, {sum(-r['lead'] for r in late) / max(len(rows), 1):.2f} us per step on average")
    kinds: dict[str, list[float]] = {}
    for r in rows:
        for name, dur, _ in r["gap_ops"]:
            kinds.setdefault(name, []).append(dur)
    for name, durs in sorted(kinds.items(), key=lambda kv: -sum(kv[1])):
        print(f"  in the gaps: {name:40s} x{len(durs):4d}  median {statistics.median(durs):6.2f} us")
    print("  five typical gaps (op, dur, start after the graph's end):")
    med_gap = np.median([r["gap"] for r in rows])
    for r in sorted(rows, key=lambda r: abs(r["gap"] - med_gap))[:5]:
        print(f"    gap {r['gap']:6.2f}: {r['gap_ops']}")


def main() -> None:
    args = sys.argv[1:]
    model = args.pop(0)
    trace = None
    if "--trace" in args:
        i = args.index("--trace")
        trace = args[i + 1]
        del args[i:i + 2]
    kw = dict(load_format="dummy", skip_tokenizer_init=True, max_model_len=2048, seed=0)
    kw.update(_kwargs(args))
    llm = LLM(shipped_model_dir(model), **kw)
    rng = np.random.default_rng(0)
    vocab = llm.llm_engine.config.model_config.vocab_size
    inputs = [{"prompt_token_ids": rng.integers(0, vocab, 128).tolist()}]
    sp = SamplingParams(temperature=1.0, max_tokens=256, ignore_eos=True, detokenize=False)
    llm.generate(inputs, sp, use_tqdm=False)
    print(f"uninstrumented decode: {decode_ms(llm, inputs):.4f} ms per token", flush=True)
    llm.reset_prefix_cache()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        llm.generate(inputs, sp, use_tqdm=False)
    torch.cuda.synchronize()
    path = "/tmp/step_gaps_trace.json"
    prof.export_chrome_trace(path)
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    if trace:  # the device and runtime events only (the CPU ops make it several times larger)
        keep = ("kernel", "gpu_memcpy", "gpu_memset", "cuda_runtime", "cuda_driver")
        with gzip.open(trace, "wt") as f:
            json.dump({"traceEvents": [e for e in events if e.get("cat") in keep]}, f)
    res = analyse(events)
    print(f"{res['n_launches']} graph launches in the profiled generate")
    summary(res["rows"][8:])   # the first steps include the prefill's tail
    print(f"uninstrumented decode again: {decode_ms(llm, inputs):.4f} ms per token", flush=True)


if __name__ == "__main__":
    main()
