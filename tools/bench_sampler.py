"""GPU micro-benchmark of the sampler's truncation paths: the sort-based torch path against the sort-free Triton
kernel (tokenmill.kernels.triton_topk_topp), on the Qwen3-0.6B vocabulary, per batch size and sampling setting.

Usage (on a CUDA machine, in the repository root): python tools/bench_sampler.py [--vocab 151936] [--batch 1 64 256]
Prints one JSON line per (setting, batch): microseconds per call of greedy argmax, plain temperature race, the sort
path (logits -> fp32, temperature, min-p, sort-based top-k/top-p, race) and the kernel path (with top-k: the rows
drawn from torch.topk's candidates by kernels/triton_topk_select; "topk_us": that torch.topk alone;
"kernel_topk_search_us": top-k by the full-row kernels' own search passes instead), plus how many rows of the
kernel's tokens differ from the sort path's (0 expected: both draw the race winner over the same kept set; a rare
mismatch can only come from a float rounding difference in a top-p mass sum at the boundary). Setting "mixed": every
other row without top-k, so the full-row kernels draw those rows after the select kernel drew the others.
Logits are N(0, sigma) per row, sigma = 1 (flat rows like dummy weights: wide nuclei) or 4 (peaked rows).
"""
from __future__ import annotations

import argparse
import json

import torch
import triton

from tokenmill.kernels.triton_sampling import race_argmax
from tokenmill.kernels.triton_topk_select import TIE_SLACK
from tokenmill.kernels.triton_topk_topp import topk_topp_sample
from tokenmill.layers.sampler import apply_min_p, apply_top_k_top_p

SETTINGS = {"sample": dict(temperature=0.6, top_p=0.95), "topk": dict(temperature=0.7, top_k=20, top_p=0.8),
            "minp": dict(temperature=0.6, min_p=0.05), "qwen3": dict(temperature=0.6, top_k=20, top_p=0.95),
            "mixed": dict(temperature=0.6, top_k=20, top_p=0.95, top_k_every_other=True)}


def timed(fn, iters=50) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return 1000 * start.elapsed_time(end) / iters


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 64, 256])
    ap.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    ap.add_argument("--sigma", type=float, nargs="+", default=[1.0, 4.0], help="Logit scales (randn * sigma).")
    args = ap.parse_args()
    dev = torch.device("cuda")
    for sigma in args.sigma:
        for name in args.settings:
            s = SETTINGS[name]
            for b in args.batch:
                g = torch.Generator(device=dev).manual_seed(0)
                logits = (torch.randn(b, args.vocab, device=dev, generator=g) * sigma).bfloat16()
                seeds = torch.arange(b, device=dev) * 7919 + 1
                pos = torch.arange(b, device=dev)
                temp = torch.full((b,), s["temperature"], device=dev)
                k = torch.full((b,), s["top_k"], device=dev) if "top_k" in s else None
                if s.get("top_k_every_other"):
                    k[1::2] = 0
                p = torch.full((b,), s["top_p"], device=dev) if "top_p" in s else None
                mp = torch.full((b,), s["min_p"], device=dev) if "min_p" in s else None

                def sort_path():
                    y = logits.float().div_(temp[:, None])
                    if mp is not None:
                        apply_min_p(y, mp)
                    apply_top_k_top_p(y, k, p, s.get("top_k", 0))
                    return race_argmax(y, seeds, pos)

                def kernel_path(max_top_k=s.get("top_k", 0), want_threshold=False):
                    return topk_topp_sample(logits, seeds, pos, temp, k, p, mp, want_threshold=want_threshold,
                                            max_top_k=max_top_k)[0]

                def topk():   # the candidates kernels/triton_topk_select reads
                    return torch.topk(logits, min(args.vocab, triton.next_power_of_2(s["top_k"] + TIE_SLACK)), dim=-1)

                mismatches = int((sort_path() != kernel_path()).sum())
                print(json.dumps({
                    "setting": name, "sigma": sigma, "batch": b,
                    "argmax_us": round(timed(lambda: logits.argmax(-1)), 1),
                    "race_us": round(timed(lambda: race_argmax(logits, seeds, pos, temp)), 1),
                    "sort_path_us": round(timed(sort_path), 1), "kernel_us": round(timed(kernel_path), 1),
                    "kernel_with_threshold_us": round(timed(lambda: kernel_path(want_threshold=True)), 1),
                    "kernel_topk_search_us": round(timed(lambda: kernel_path(0)), 1) if k is not None else None,
                    "topk_us": round(timed(topk), 1) if k is not None else None,
                    "mismatched_rows": mismatches}), flush=True)


if __name__ == "__main__":
    main()
