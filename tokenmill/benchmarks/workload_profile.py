"""`tokenmill bench profile`: where an offline workload's time goes (CPU or CUDA).

Runs random-token requests through one LLM (by default the nano-vllm workload of `tokenmill bench throughput`:
256 requests, lengths uniform in 101..1022; `--num-prompts 1 --input-len 128 --output-len 1500
--random-range-ratio 0` is the batch-1 decode loop) after a two-request warm-up, and reports:
  * output tokens per second of the timed run;
  * the engine's per-phase step timing (schedule, execute_model, sample, wait_output, update_from_output, ...);
  * engine steps by kind (prefill: some request ran more than one token; decode: none did) and batch size
    bucket (requests <= 1, 2, 4, ...): count, total seconds, mean ms. Under async scheduling a step that
    launches batch N also finishes batch N-1, so its wall time is the pipeline's pace at that point;
  * the Triton kernels compiled during the timed run (new files in the Triton cache: a compile inside a timed
    run is a stall the warm-up should have taken);
then, on request, the same workload again under cProfile (`--cprofile N`: the N functions with the most own
time) and under torch.profiler (`--kernels N`: the N ops with the most device time on CUDA, CPU time
otherwise, and the device's busy share). `--sync-debug` adds, before the timed run, 64 short requests in
torch's CUDA sync-debug mode and lists the source lines that made the host wait for the device.
"""
from __future__ import annotations

import argparse
import collections
import os
import sys
import time

from tokenmill import envs
from tokenmill.benchmarks.offline_common import (ENGINE_FLAGS_EPILOG, add_dataset_args, add_sampling_args,
                                                 random_token_prompts, sampling_kwargs, split_engine_args, write_json)


def make_parser(prog: str = "tokenmill bench profile") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=ENGINE_FLAGS_EPILOG)
    add_dataset_args(p, input_len=562, output_len=562, num_prompts=256)
    p.set_defaults(random_range_ratio=0.82)
    add_sampling_args(p)
    p.add_argument("--cprofile", type=int, default=0, metavar="N",
                   help="Run the workload again under cProfile and print the N functions with the most own time.")
    p.add_argument("--kernels", type=int, default=0, metavar="N",
                   help="Run the workload again under torch.profiler and print the N ops with the most time.")
    p.add_argument("--sync-debug", action="store_true",
                   help="CUDA: run 64 short requests in torch's sync-debug mode and list what synchronized.")
    p.add_argument("--output-json", default=None, help="Write the figures here as JSON.")
    return p


class StepBuckets:
    """Wraps an engine core's step() and files each step's wall time under (kind, batch-size bucket)."""

    def __init__(self, core) -> None:
        self.core = core
        self.steps: dict[tuple[str, int], list[float]] = collections.defaultdict(lambda: [0, 0.0])
        self._own = None  # the core's own instance attribute `step`, if it had one

    def __enter__(self) -> StepBuckets:
        self._own = vars(self.core).get("step")
        step = self.core.step

        def timed():
            t = time.perf_counter()
            out = step()
            dt = time.perf_counter() - t
            s = self.core.last_scheduled
            if s is not None and not s.is_empty:
                n = len(s.num_scheduled_tokens)
                kind = "prefill" if s.total_num_scheduled_tokens > n else "decode"
                row = self.steps[(kind, 1 << max(0, n - 1).bit_length())]
                row[0] += 1
                row[1] += dt
            return out
        self.core.step = timed
        return self

    def __exit__(self, *exc) -> None:
        if self._own is not None:
            self.core.step = self._own
        else:
            del self.core.step  # the class's step shows through again

    def rows(self) -> list[dict]:
        return [{"kind": k, "max_requests": b, "steps": n, "seconds": s}
                for (k, b), (n, s) in sorted(self.steps.items())]


def triton_cache_dir() -> str:
    return envs.TRITON_CACHE_DIR or os.path.join(os.path.expanduser("~"), ".triton", "cache")


def files_written_since(root: str, since: float) -> list[str]:
    """Kernel metadata files (one per compiled kernel) written under root after `since` (a time.time())."""
    found = []
    for dirpath, _, files in os.walk(root):
        for f in files:
            path = os.path.join(dirpath, f)
            if f.endswith(".json") and not f.startswith("__grp") and os.path.getmtime(path) > since:
                found.append(f[:-5])
    return sorted(found)


def _cprofile(run, top: int) -> None:
    import cProfile
    import pstats
    prof = cProfile.Profile()
    prof.enable()
    run()
    prof.disable()
    print(f"=== cProfile, top {top} by own time")
    pstats.Stats(prof).sort_stats("tottime").print_stats(top)


def _kernels(run, top: int, cuda: bool) -> dict:
    import torch
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]) as prof:
        t = time.perf_counter()
        run()
        if cuda:
            torch.cuda.synchronize()
        wall = time.perf_counter() - t
    avg = prof.key_averages()
    own = (lambda e: e.self_device_time_total) if cuda else (lambda e: e.self_cpu_time_total)
    total = sum(own(e) for e in avg) or 1
    what = "device" if cuda else "CPU"
    print(f"=== torch.profiler: {wall:.2f} s wall, {total / 1e6:.2f} s of {what} op time"
          + (f" ({100 * total / 1e6 / wall:.0f}% busy)" if cuda else ""))
    rows = []
    for e in sorted(avg, key=own, reverse=True)[:top]:
        rows.append({"name": e.key, "us": own(e), "count": e.count})
        print(f"  {own(e) / 1e3:10.1f} ms {100 * own(e) / total:5.1f}% {e.count:8d}x "
              f"{own(e) / max(e.count, 1):9.1f} us  {e.key[:90]}")
    return {"wall_s": wall, "op_seconds": total / 1e6, "top": rows}


def _sync_debug(llm, reqs) -> list[tuple[str, int]]:
    import warnings

    import torch

    from tokenmill import SamplingParams
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            llm.generate(reqs[:64], SamplingParams(max_tokens=8, ignore_eos=True, detokenize=False),
                         use_tqdm=False)
        finally:
            torch.cuda.set_sync_debug_mode(0)
    where = collections.Counter(f"{w.filename}:{w.lineno} {str(w.message)[:60]}" for w in caught)
    print(f"=== synchronizing calls in a run of {min(64, len(reqs))} 8-token requests ({sum(where.values())}):")
    for k, n in where.most_common(15):
        print(f"  {n:5d}  {k}")
    return where.most_common()


def main(argv: list[str] | None = None) -> dict:
    parser = make_parser()
    args, engine_kwargs = split_engine_args(sys.argv[1:] if argv is None else argv, parser)
    if args.cprofile < 0 or args.kernels < 0:
        parser.error("--cprofile and --kernels take a positive count (0: off)")
    engine_kwargs.setdefault("seed", args.seed)
    sampling = sampling_kwargs(args)
    from tokenmill import LLM, SamplingParams
    from tokenmill.metrics.step_timing import TIMER
    llm = LLM(**engine_kwargs)
    cuda = llm.llm_engine.config.device_config.torch_device.type == "cuda"
    if args.sync_debug and not cuda:
        parser.error("--sync-debug needs the engine on CUDA")
    core = llm.llm_engine.engine_core
    if not hasattr(core, "last_scheduled"):
        parser.error("profiles only an engine core in this process (no data parallelism)")
    vocab = llm.llm_engine.config.model_config.vocab_size
    prompts, out_lens = random_token_prompts(args.num_prompts, args.input_len, args.output_len,
                                             args.random_range_ratio, vocab, args.seed)
    params = [SamplingParams(**sampling, max_tokens=n, ignore_eos=True, detokenize=False) for n in out_lens]
    reqs = [{"prompt_token_ids": p} for p in prompts]

    def run() -> None:
        llm.generate(reqs, params, use_tqdm=False)

    llm.generate(reqs[:2], params[:2], use_tqdm=False)  # warm-up
    if args.sync_debug:
        _sync_debug(llm, reqs)
    timer_was = TIMER.enabled
    TIMER.enabled = True
    TIMER.seconds.clear()
    TIMER.counts.clear()
    marker = time.time()
    try:
        with StepBuckets(core) as buckets:
            t = time.perf_counter()
            run()
            wall = time.perf_counter() - t
    finally:
        TIMER.enabled = timer_was
    compiled = files_written_since(triton_cache_dir(), marker)
    n_out = sum(out_lens)
    print(f"{n_out} output tokens in {wall:.2f} s = {n_out / wall:,.1f} output tok/s "
          f"({len(prompts)} requests)")
    print(TIMER.report())
    print("steps by kind (requests <= bucket): count, total s, mean ms")
    for r in buckets.rows():
        print(f"  {r['kind']:<8}{r['max_requests']:>5}: {r['steps']:6d} {r['seconds']:8.3f} "
              f"{1000 * r['seconds'] / r['steps']:8.2f}")
    print(f"Triton kernels compiled during the timed run: {len(compiled)} {compiled[:12]}")
    result = {"elapsed_time": wall, "total_output_tokens": n_out, "output_tokens_per_second": n_out / wall,
              "phases": {k: {"seconds": v, "calls": TIMER.counts[k]} for k, v in TIMER.seconds.items()},
              "steps": buckets.rows(), "triton_compiled": compiled}
    if args.cprofile:
        _cprofile(run, args.cprofile)
    if args.kernels:
        result["kernels"] = _kernels(run, args.kernels, cuda)
    write_json(args.output_json, result)
    return result


if __name__ == "__main__":
    main()
