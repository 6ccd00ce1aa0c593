"""`tokenmill bench step-gaps`: where a batch-1 decode step's time goes between CUDA graph replays (CUDA only).

Runs one request shaped like `tokenmill bench latency --batch-size 1` (default 128 prompt tokens, 256 out) under
torch.profiler and pairs each decode graph's launch on the host with its kernels on the device. Per step it
reports the graph's span on the device, its busy time, the device's idle gap before the next graph starts, the
copies and memsets that ran in that gap, and how far ahead of the device the host launched the next graph
(negative: the host was late and the device idled). The uninstrumented decode ms per token (bench latency's
figure) is printed before and after, so the profiler's own overhead can be judged.

Example: tokenmill bench step-gaps --model llama-3-8b --max-model-len 2048 --trace /tmp/llama.json.gz
"""
from __future__ import annotations

import argparse
import collections
import gzip
import json
import statistics
import sys
import time

import numpy as np

from tokenmill.benchmarks.offline_common import random_token_prompts, require_cuda, split_engine_args, write_json

_DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")


def make_parser(prog: str = "tokenmill bench step-gaps") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="Every engine flag of `tokenmill serve` is accepted too, except "
                                       "--enforce-eager (there would be no graphs to time).")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--skip-steps", type=int, default=8,
                   help="Leave out the first N steps (they overlap the prefill's tail). Default 8.")
    p.add_argument("--num-iters", type=int, default=3, help="Runs per uninstrumented decode figure (median).")
    p.add_argument("--trace", default=None,
                   help="Also write the device and CUDA runtime events as a gzipped Chrome trace here.")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output-json", default=None, help="Write the per-step rows and their summary here.")
    return p


def _graph_kernels_by_marker(kernels: list[dict], n_launches: int) -> list[list[dict]]:
    """Kernels grouped into graph replays when the trace carries no correlation ids: a replay starts at the
    earliest-seen kernel name that runs once per launch (or once per launch but the first two: the prefill may
    replay a different graph). Groups are aligned with the last launches, one group per launch from the end."""
    counts = collections.Counter(e["name"] for e in kernels)
    first_seen: dict[str, int] = {}
    for i, e in enumerate(kernels):
        first_seen.setdefault(e["name"], i)
    markers = [n for n, c in counts.items() if n_launches - 2 <= c <= n_launches]
    if not markers:
        return [[] for _ in range(n_launches)]
    marker = min(markers, key=lambda n: (-counts[n], first_seen[n]))
    starts = [i for i, e in enumerate(kernels) if e["name"] == marker]
    found = [kernels[lo:hi] for lo, hi in zip(starts, starts[1:] + [len(kernels)])]
    return [[] for _ in range(n_launches - len(found))] + found


def analyse(events: list[dict]) -> dict:
    """Per-step rows from a Chrome trace's events (times in us): for each graph launch but the last, `span`
    (its first kernel's start to its last kernel's end), `busy` (summed kernel time), `kernels`, `gap` (device
    idle before the next graph's first kernel), `period`, `lead` (this graph's end minus the end of the host's
    launch call of the next one: > 0 means the host was ahead), `launch_dur` and `gap_ops` (name, duration,
    start after this graph's end, for the copies and memsets and other kernels in the gap)."""
    launches = sorted((e for e in events if e.get("cat") == "cuda_runtime"
                       and e.get("name", "").startswith("cudaGraphLaunch")), key=lambda e: e["ts"])
    by_corr = {e.get("args", {}).get("correlation"): i for i, e in enumerate(launches)}
    device = sorted((e for e in events if e.get("cat") in _DEVICE_CATS), key=lambda e: e["ts"])
    groups: list[list[dict]] = [[] for _ in launches]
    others = []
    for e in device:
        i = by_corr.get(e.get("args", {}).get("correlation"))
        if i is None or e["cat"] != "kernel":
            others.append(e)
        else:
            groups[i].append(e)
    grouping = "correlation"
    if launches and not any(groups):
        kernels = [e for e in others if e["cat"] == "kernel"]
        groups = _graph_kernels_by_marker(kernels, len(launches))
        grouped = {id(e) for g in groups for e in g}
        others = [e for e in others if id(e) not in grouped]
        grouping = "marker kernel"
    spans = [(min(e["ts"] for e in g), max(e["ts"] + e["dur"] for e in g), sum(e["dur"] for e in g), len(g))
             if g else None for g in groups]
    rows = []
    oi = 0
    for i in range(len(launches) - 1):
        a, b = spans[i], spans[i + 1]
        if a is None or b is None:
            continue
        while oi < len(others) and others[oi]["ts"] < a[1]:
            oi += 1
        gap_ops = []
        j = oi
        while j < len(others) and others[j]["ts"] < b[0]:
            gap_ops.append((others[j]["name"][:40], round(others[j]["dur"], 2), round(others[j]["ts"] - a[1], 2)))
            j += 1
        nxt = launches[i + 1]
        rows.append({"span": a[1] - a[0], "busy": a[2], "kernels": a[3], "gap": b[0] - a[1], "period": b[0] - a[0],
                     "lead": a[1] - (nxt["ts"] + nxt["dur"]), "launch_dur": nxt["dur"], "gap_ops": gap_ops})
    return {"rows": rows, "n_launches": len(launches), "grouping": grouping}


def summarize_rows(rows: list[dict]) -> dict:
    """Median / mean / p10 / p90 of each per-step figure, host-late steps, and the ops seen in the gaps."""
    stats = {}
    for k in ("period", "span", "busy", "gap", "lead", "launch_dur"):
        v = np.array([r[k] for r in rows], dtype=float)
        stats[k] = {"median": float(np.median(v)), "mean": float(v.mean()), "p10": float(np.percentile(v, 10)),
                    "p90": float(np.percentile(v, 90))}
    late = [r for r in rows if r["lead"] < 0]
    ops: dict[str, list[float]] = {}
    for r in rows:
        for name, dur, _ in r["gap_ops"]:
            ops.setdefault(name, []).append(dur)
    return {"steps": len(rows), "stats": stats, "host_late_steps": len(late),
            "host_late_us_per_step": sum(-r["lead"] for r in late) / max(len(rows), 1),
            "gap_ops": {n: {"count": len(d), "median_us": statistics.median(d)}
                        for n, d in sorted(ops.items(), key=lambda kv: -sum(kv[1]))}}


def format_summary(s: dict) -> str:
    lines = [f"{s['steps']} decode steps (us):"]
    for k, st in s["stats"].items():
        lines.append(f"  {k:10s} median {st['median']:9.2f}  mean {st['mean']:9.2f}  p10 {st['p10']:9.2f}  "
                     f"p90 {st['p90']:9.2f}")
    lines.append(f"  host late (next graph launched after the device finished this one): {s['host_late_steps']} of "
                 f"{s['steps']} steps, {s['host_late_us_per_step']:.2f} us per step on average")
    for name, o in s["gap_ops"].items():
        lines.append(f"  in the gaps: {name:40s} x{o['count']:5d}  median {o['median_us']:7.2f} us")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    parser = make_parser()
    args, engine_kwargs = split_engine_args(sys.argv[1:] if argv is None else argv, parser)
    if engine_kwargs.get("enforce_eager"):
        parser.error("--enforce-eager runs no CUDA graphs; step-gaps times the gaps between graph replays")
    if args.output_len < args.skip_steps + 3:
        parser.error(f"--output-len {args.output_len} leaves no steps after --skip-steps {args.skip_steps}")
    require_cuda(parser.prog)
    import torch
    from torch.profiler import ProfilerActivity, profile

    from tokenmill import LLM, SamplingParams
    engine_kwargs.setdefault("seed", args.seed)
    llm = LLM(**engine_kwargs)
    vocab = llm.llm_engine.config.model_config.vocab_size
    prompts, _ = random_token_prompts(1, args.input_len, args.output_len, 0.0, vocab, args.seed)
    inputs = [{"prompt_token_ids": prompts[0]}]

    def run(n: int) -> float:
        sp = SamplingParams(temperature=1.0, max_tokens=n, ignore_eos=True, detokenize=False)
        llm.reset_prefix_cache()  # every run pays its prefill, as in bench latency
        t = time.perf_counter()
        llm.generate(inputs, sp, use_tqdm=False)
        return time.perf_counter() - t

    def decode_ms() -> float:
        full = statistics.median(run(args.output_len) for _ in range(args.num_iters))
        first = statistics.median(run(1) for _ in range(args.num_iters))
        return 1000 * (full - first) / (args.output_len - 1)

    run(args.output_len)  # warm-up
    before = decode_ms()
    print(f"uninstrumented decode: {before:.4f} ms per token", flush=True)
    llm.reset_prefix_cache()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        llm.generate(inputs, SamplingParams(temperature=1.0, max_tokens=args.output_len, ignore_eos=True,
                                            detokenize=False), use_tqdm=False)
        torch.cuda.synchronize()
    import tempfile
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        with open(f.name) as g:
            events = json.load(g)["traceEvents"]
    if args.trace:  # the device and runtime events only (the CPU ops make it several times larger)
        keep = _DEVICE_CATS + ("cuda_runtime", "cuda_driver")
        with gzip.open(args.trace, "wt") as f:
            json.dump({"traceEvents": [e for e in events if e.get("cat") in keep]}, f)
    res = analyse(events)
    rows = res["rows"][args.skip_steps:]
    if not rows:
        print(f"{parser.prog}: no decode graph replays found in the profile ({res['n_launches']} graph launches)",
              file=sys.stderr)
        return {"rows": [], "n_launches": res["n_launches"]}
    summary = summarize_rows(rows)
    print(f"{res['n_launches']} graph launches in the profiled generate (kernels grouped by {res['grouping']})")
    print(format_summary(summary))
    after = decode_ms()
    print(f"uninstrumented decode again: {after:.4f} ms per token", flush=True)
    result = {"decode_ms_before": before, "decode_ms_after": after, "n_launches": res["n_launches"],
              "summary": summary, "rows": rows}
    write_json(args.output_json, result)
    return result


if __name__ == "__main__":
    main()
