"""Where does a decode step's time go? Runs on the GPU machine: per-component wall times (with a device sync at
each boundary) for decode at batch 1 and 256, then a torch.profiler CUDA table.
Usage: python3 tools/profile_steps.py qwen3-0.6b [--bs1-only]"""
from __future__ import annotations

import collections
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

from tokenmill import LLM, SamplingParams
from tokenmill.benchmarks.offline_common import shipped_model_dir
from tokenmill.sampling_params import RequestOutputKind

name = sys.argv[1] if len(sys.argv) > 1 else "qwen3-0.6b"
bs1_only = "--bs1-only" in sys.argv
llm = LLM(shipped_model_dir(name), load_format="dummy", skip_tokenizer_init=True, max_model_len=2048)
eng = llm.llm_engine
core = eng.engine_core
sched, ex = core.scheduler, core.executor
runner = ex.worker.runner


def timed(obj, attr, key, T):
    fn = getattr(obj, attr)

    def wrapper(*a, **k):
        torch.cuda.synchronize()
        t = time.perf_counter()
        r = fn(*a, **k)
        torch.cuda.synchronize()
        T[key] += time.perf_counter() - t
        return r
    setattr(obj, attr, wrapper)
    return fn


def drain():
    """Resolve a step in flight so the manual loop below starts from a settled state."""
    mode = core.async_scheduling
    core.async_scheduling = False
    core.step()
    core.async_scheduling = mode


for bs, steps in ((1, 64),) if bs1_only else ((1, 64), (256, 24)):
    sp = SamplingParams(temperature=0.6, max_tokens=1000, ignore_eos=True, detokenize=False,
                        output_kind=RequestOutputKind.FINAL_ONLY)
    for i in range(bs):
        eng.add_request(f"{bs}-{i}", {"prompt_token_ids": list(range(100 + i, 228 + i))}, sp)
    for _ in range(12):
        eng.step()
    for mode in (False, True):
        drain()
        core.async_scheduling = mode
        eng.step()
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(steps):
            eng.step()
        torch.cuda.synchronize()
        print(f"batch {bs}, async_scheduling={mode}: {1000 * (time.perf_counter() - t) / steps:.3f} ms per decode "
              "step (wall, uninstrumented)")
    if bs == 1 and runner.cuda_graphs is not None:
        # The device's own pace: the batch-1 graph replayed back to back, nothing else on the host.
        g, reps = runner.cuda_graphs.graphs[1], 400
        g.replay()  # warm-up
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(reps):
            g.replay()
        torch.cuda.synchronize()
        runner.cuda_graphs.sync_host_io()   # these replays advanced the device's host-IO counter
        print(f"batch-1 decode graph replayed back to back: {1000 * (time.perf_counter() - t) / reps:.3f} ms each")
    if bs == 1:  # where does the host time go at batch 1 (async on, as served)?
        import cProfile
        import pstats
        core.async_scheduling = True
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(steps):
            eng.step()
        pr.disable()
        pstats.Stats(pr).sort_stats("tottime").print_stats(40)
    drain()
    T = collections.defaultdict(float)
    saved = [(runner.sampler, "forward", timed(runner.sampler, "forward", "sampler", T)),
             (runner.sampling, "make_metadata", timed(runner.sampling, "make_metadata", "make_metadata", T))]
    if runner.cuda_graphs is not None:
        saved.append((runner.cuda_graphs, "replay", timed(runner.cuda_graphs, "replay", "graph_replay", T)))
    for _ in range(steps):
        t0 = time.perf_counter()
        so = sched.schedule()
        t1 = time.perf_counter()
        ex.execute_model(so)
        t2 = time.perf_counter()
        out = ex.sample_tokens(sched.get_grammar_bitmask(so)).get()
        t3 = time.perf_counter()
        outs = sched.update_from_output(so, out)
        t4 = time.perf_counter()
        eng.output_processor.process_outputs(outs.outputs)
        t5 = time.perf_counter()
        for k, dt in (("schedule", t1 - t0), ("execute_model", t2 - t1), ("sample+get", t3 - t2),
                      ("update", t4 - t3), ("outproc", t5 - t4)):
            T[k] += dt
    for obj, attr, fn in saved:
        setattr(obj, attr, fn)
    print("  " + ", ".join(f"{k} {1000 * v / steps:.3f}" for k, v in T.items()) + " (ms per step, synced)")
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(4):
            eng.step()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=16, max_name_column_width=60))
    eng.abort_request([f"{bs}-{i}" for i in range(bs)])
    while core.has_unfinished_requests():
        eng.step()

if bs1_only:
    sys.exit(0)
# Prefill: one step of 16 prompts x 512 tokens = 8192 tokens (the default token budget), synchronous.
core.async_scheduling = False
sp1 = SamplingParams(temperature=0.6, max_tokens=1, ignore_eos=True, detokenize=False,
                     output_kind=RequestOutputKind.FINAL_ONLY)
times = []
for rep in range(4):
    for i in range(16):
        base = 1000 + 20000 * rep + 600 * i  # distinct prompts: no prefix-cache hits
        eng.add_request(f"p{rep}-{i}", {"prompt_token_ids": list(range(base, base + 512))}, sp1)
    torch.cuda.synchronize()
    t = time.perf_counter()
    eng.step()
    torch.cuda.synchronize()
    times.append(time.perf_counter() - t)
    while core.has_unfinished_requests():
        eng.step()
print(f"prefill step of 8192 tokens (16 x 512): {[round(1000 * x, 2) for x in times]} ms")
with profile(activities=[ProfilerActivity.CUDA]) as prof:
    for i in range(16):
        base = 90000 + 600 * i
        eng.add_request(f"q-{i}", {"prompt_token_ids": list(range(base, base + 512))}, sp1)
    eng.step()
    torch.cuda.synchronize()
print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=10, max_name_column_width=60))
