"""`bench serve` metrics: the per-request record, vLLM's aggregate result keys and result block, plus the
structured-vs-free split.

Contract: `compute_metrics` turns finished requests into vLLM's flat result keys (latencies in ms);
`format_report` prints vLLM's block line for line; `split_metrics` / `format_split_report` give the same latency
statistics for the requests that carried an output constraint and for those that did not, and the ratio of their
median TPOTs (the number that says what a constraint costs per token).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass
class RequestOutput:
    """One request's measurement as `bench serve` records it: times in seconds from the request's start
    (`ttft`, `latency`) or absolute perf_counter values (`start_time`, `chunk_times`); `itl` holds the gaps
    between content chunks."""
    success: bool = False
    prompt_len: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    start_time: float = 0.0
    itl: list[float] = field(default_factory=list)
    chunk_times: list[float] = field(default_factory=list)
    generated_text: str = ""
    error: str = ""

METRIC_HEADERS = {"ttft": ("TTFT", "Time to First Token"),
                  "tpot": ("TPOT", "Time per Output Token (excl. 1st token)"),
                  "itl": ("ITL", "Inter-token Latency"),
                  "e2el": ("E2EL", "End-to-end Latency")}


def compute_metrics(outputs: list[RequestOutput], duration: float, t0: float,
                    percentiles: list[float]) -> dict[str, Any]:
    """Aggregate metrics with vLLM's result keys (latencies in ms; `pXX_` per requested percentile).

    Peak output throughput is the most content chunks landing in one 1-second bucket; peak concurrent
    requests is the exact maximum overlap of request lifetimes (vLLM counts per-second buckets instead,
    which can exceed --max-concurrency).
    """
    ok = [o for o in outputs if o.success]
    total_in = sum(o.prompt_len for o in ok)
    total_out = sum(o.output_tokens for o in ok)
    series = {"ttft": [o.ttft for o in ok],
              "tpot": [(o.latency - o.ttft) / (o.output_tokens - 1) for o in ok if o.output_tokens > 1],
              "itl": [x for o in ok for x in o.itl],
              "e2el": [o.latency for o in ok]}
    buckets: dict[int, int] = {}
    for o in ok:
        for t in o.chunk_times:
            buckets[int(t - t0)] = buckets.get(int(t - t0), 0) + 1
    events = sorted([(o.start_time, 1) for o in outputs] + [(o.start_time + o.latency, -1) for o in outputs],
                    key=lambda e: (e[0], e[1]))  # at equal times, an end (-1) sorts before a start
    live = peak = 0
    for _, d in events:
        live += d
        peak = max(peak, live)
    dur = max(duration, 1e-9)
    m: dict[str, Any] = {
        "duration": duration, "completed": len(ok), "failed": len(outputs) - len(ok),
        "total_input_tokens": total_in, "total_output_tokens": total_out,
        "request_throughput": len(ok) / dur, "output_throughput": total_out / dur,
        "total_token_throughput": (total_in + total_out) / dur,
        "max_output_tokens_per_s": float(max(buckets.values(), default=0)),
        "max_concurrent_requests": float(peak),
    }
    for name, values in series.items():
        arr = np.asarray(values, dtype=np.float64) * 1000.0
        empty = arr.size == 0  # all failed: report zeros like vLLM rather than NaN
        m[f"mean_{name}_ms"] = 0.0 if empty else float(arr.mean())
        m[f"median_{name}_ms"] = 0.0 if empty else float(np.median(arr))
        m[f"std_{name}_ms"] = 0.0 if empty else float(arr.std())
        for p in percentiles:
            m[f"p{_pword(p)}_{name}_ms"] = 0.0 if empty else float(np.percentile(arr, p))
    return m


def _pword(p: float) -> str:
    return str(int(p)) if int(p) == p else str(p)


def format_report(m: dict[str, Any], max_concurrency: int | None, rate: float,
                  metrics: list[str], percentiles: list[float]) -> str:
    """The result block, line for line as `vllm bench serve` prints it."""
    row = "{:<40} {:<10}".format
    rowf = "{:<40} {:<10.2f}".format
    lines = ["{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="="),
             row("Successful requests:", m["completed"]), row("Failed requests:", m["failed"])]
    if max_concurrency is not None:
        lines.append(row("Maximum request concurrency:", max_concurrency))
    if rate != float("inf"):
        lines.append(rowf("Request rate configured (RPS):", rate))
    lines += [rowf("Benchmark duration (s):", m["duration"]),
              row("Total input tokens:", m["total_input_tokens"]),
              row("Total generated tokens:", m["total_output_tokens"]),
              rowf("Request throughput (req/s):", m["request_throughput"]),
              rowf("Output token throughput (tok/s):", m["output_throughput"]),
              rowf("Peak output token throughput (tok/s):", m["max_output_tokens_per_s"]),
              rowf("Peak concurrent requests:", m["max_concurrent_requests"]),
              rowf("Total token throughput (tok/s):", m["total_token_throughput"])]
    lines += _latency_lines(m, metrics, percentiles)
    lines.append("=" * 50)
    return "\n".join(lines)


def _latency_lines(m: dict[str, Any], metrics: list[str], percentiles: list[float]) -> list[str]:
    rowf = "{:<40} {:<10.2f}".format
    lines = []
    for key, (name, header) in METRIC_HEADERS.items():
        if key not in metrics:
            continue
        lines.append("{s:{c}^{n}}".format(s=header, n=50, c="-"))
        lines.append(rowf(f"Mean {name} (ms):", m[f"mean_{key}_ms"]))
        lines.append(rowf(f"Median {name} (ms):", m[f"median_{key}_ms"]))
        for p in percentiles:
            lines.append(rowf(f"P{_pword(p)} {name} (ms):", m[f"p{_pword(p)}_{key}_ms"]))
    return lines


def split_metrics(outputs: list[RequestOutput], structured: list[bool], valid: list[bool | None], duration: float,
                  t0: float, percentiles: list[float]) -> dict[str, Any]:
    """Metrics of the constrained and the free requests of one run, each with `compute_metrics`' keys.

    `structured[i]` says whether request i carried a constraint and `valid[i]` whether its answer obeyed it (None
    for free requests). Throughputs in each group are that group's tokens over the whole run's duration.
    `structured_free_tpot_ratio` is structured median TPOT / free median TPOT, None when a group has no TPOT.
    """
    groups: dict[str, Any] = {}
    for name, want in (("structured", True), ("free", False)):
        picked = [o for o, s in zip(outputs, structured) if s == want]
        groups[name] = compute_metrics(picked, duration, t0, percentiles)
        groups[name]["num_requests"] = len(picked)
    checked = [v for o, s, v in zip(outputs, structured, valid) if s and o.success]
    groups["structured"]["valid_outputs"] = sum(1 for v in checked if v)
    groups["structured"]["valid_output_rate"] = 100.0 * sum(1 for v in checked if v) / len(checked) \
        if checked else 0.0
    s_tpot, f_tpot = groups["structured"]["median_tpot_ms"], groups["free"]["median_tpot_ms"]
    ratio = s_tpot / f_tpot if s_tpot > 0 and f_tpot > 0 else None
    return {"structured": groups["structured"], "free": groups["free"], "structured_free_tpot_ratio": ratio}


def format_split_report(split: dict[str, Any], kind: str, metrics: list[str], percentiles: list[float]) -> str:
    """The structured and free blocks printed after vLLM's block, and the median TPOT ratio."""
    row = "{:<40} {:<10}".format
    rowf = "{:<40} {:<10.2f}".format
    lines = []
    for name, title in (("structured", f" Structured requests ({kind}) "), ("free", " Free requests ")):
        m = split[name]
        lines += ["{s:{c}^{n}}".format(s=title, n=50, c="="), row("Requests:", m["num_requests"]),
                  row("Successful requests:", m["completed"]), row("Failed requests:", m["failed"])]
        if name == "structured":
            lines.append(row("Valid outputs:", m["valid_outputs"]))
            lines.append(rowf("Valid output rate (%):", m["valid_output_rate"]))
        lines += [row("Total generated tokens:", m["total_output_tokens"]),
                  rowf("Mean output tokens per request:", m["total_output_tokens"] / max(m["completed"], 1))]
        lines += _latency_lines(m, metrics, percentiles)
    ratio = split["structured_free_tpot_ratio"]
    lines.append("=" * 50)
    lines.append(row("Structured / free median TPOT:", "n/a") if ratio is None
                 else "{:<40} {:<10.3f}".format("Structured / free median TPOT:", ratio))
    lines.append("=" * 50)
    return "\n".join(lines)

