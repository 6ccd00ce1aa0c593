"""Timing of decode-sized kernels the way a decode step runs them: captured back to back in one CUDA graph (launch
overhead excluded, programmatic dependent launch as configured), median of several replays. Used by
tools/bench_gemv.py on the GPU machine."""
from __future__ import annotations

import statistics

import torch


def graph_us(calls, replays: int = 7) -> float:
    """Median time per call (us) of a captured graph that runs `calls` (zero-argument callables) in order."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):              # warm-up: compile, allocate, create split-K / merge counters
        for c in calls[:2]:
            c()
    torch.cuda.current_stream().wait_stream(s)
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
