"""Where the nano-vllm throughput workload's time goes (GPU machine).

1. A timed run with per-phase step timing (TOKENMILL_STEP_TIMING) and per-step wall times bucketed by batch kind,
   then the Triton kernels compiled during it (a fresh TRITON_CACHE_DIR, so every compile leaves a file).
2. Unless --no-profile: a second run under torch.profiler (CUDA activity only, kernels inside CUDA graphs included):
   the kernels by total time and the GPU-busy share.
3. With --cprofile: the timed run under cProfile instead (host hot spots; the run itself is then slower), and
   --sync-debug: a short run with torch's sync debug mode, listing the lines that made the host wait for the GPU.
--bs1: one request of 128 in / 1500 out instead of the nano-vllm workload.
Usage: python3 tools/profile_throughput.py MODEL [--bs1] [--no-profile] [--cprofile] [--sync-debug] [--min-splits N]
       [key=value LLM kwargs ...]
--min-splits N: decode attention uses at least min(N, max_seq_len / 256) context splits (an experiment)."""
from __future__ import annotations

import collections
import os
import sys
import tempfile
import time

os.environ["TOKENMILL_STEP_TIMING"] = "1"
os.environ.setdefault("TRITON_CACHE_DIR", tempfile.mkdtemp(prefix="tcache-"))

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from tokenmill import LLM, SamplingParams  # noqa: E402
from tokenmill.benchmarks.offline_common import random_token_prompts, shipped_model_dir  # noqa: E402
from tokenmill.metrics.step_timing import TIMER  # noqa: E402

args = sys.argv[1:]
name = args.pop(0) if args and "=" not in args[0] and not args[0].startswith("--") else "qwen3-0.6b"
do_profile = "--no-profile" not in args
do_cprofile = "--cprofile" in args
sync_debug = "--sync-debug" in args
min_splits = 0
if "--min-splits" in args:
    min_splits = int(args[args.index("--min-splits") + 1])
extra = {}
for kv in args:
    if "=" in kv:
        k, v = kv.split("=", 1)
        extra[k] = int(v) if v.isdigit() else v
if "--small-decode-tiles" in args:  # A/B: the 64-key decode tiles at every batch size (before session 5)
    import tokenmill.kernels.triton_decode_attention as tda
    _cfg = tda.decode_config
    tda.decode_config = lambda h, g, dt, fp8=False, num_rows=1: _cfg(h, g, dt, fp8, 1)
if min_splits:
    import triton

    import tokenmill.attention.backends.triton_attn as ta
    _orig = ta.decode_num_splits

    def _patched(num_rows, num_kv_heads, max_seq_len, device, **kw):
        return max(_orig(num_rows, num_kv_heads, max_seq_len, device, **kw),
                   min(min_splits, triton.next_power_of_2(max(1, max_seq_len // 256))))
    ta.decode_num_splits = _patched

llm = LLM(shipped_model_dir(name) or name, load_format="dummy", skip_tokenizer_init=True, max_model_len=2048,
          max_num_seqs=256, **extra)
core = llm.llm_engine.engine_core
vocab = llm.llm_engine.config.model_config.vocab_size
if "--bs1" in args:  # one request, 128 in / 1500 out: the batch-1 decode loop
    prompts, out_lens = random_token_prompts(1, 128, 1500, 0.0, vocab, seed=0)
else:
    prompts, out_lens = random_token_prompts(256, 562, 562, 0.82, vocab, seed=0)
params = [SamplingParams(temperature=1.0, max_tokens=n, ignore_eos=True, detokenize=False) for n in out_lens]
reqs = [{"prompt_token_ids": p} for p in prompts]
llm.generate(reqs[:2], params[:2], use_tqdm=False)
if sync_debug:
    import warnings
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        llm.generate(reqs[:64], [SamplingParams(max_tokens=8, ignore_eos=True, detokenize=False)] * 64,
                     use_tqdm=False)
        torch.cuda.set_sync_debug_mode(0)
    where = collections.Counter(f"{w.filename}:{w.lineno} {str(w.message)[:60]}" for w in caught)
    print(f"synchronizing calls in a 64-request run ({sum(where.values())}):")
    for k, n in where.most_common(15):
        print(f"  {n:5d}  {k}")

# Per-step wall time by kind of batch (the step that launches batch N also finishes batch N-1 under async
# scheduling, so a step's wall time is the pace of the pipeline at that point).
steps = collections.defaultdict(lambda: [0, 0.0])
_step = core.step


def timed_step():
    t = time.perf_counter()
    out = _step()
    dt = time.perf_counter() - t
    s = core.last_scheduled
    if s is not None:
        n = len(s.num_scheduled_tokens)
        kind = "prefill" if s.total_num_scheduled_tokens > n else "decode"
        bucket = 1 << max(0, n - 1).bit_length()
        steps[(kind, bucket)][0] += 1
        steps[(kind, bucket)][1] += dt
    return out


core.step = timed_step
TIMER.seconds.clear()
TIMER.counts.clear()
marker = time.time()
if do_cprofile:
    import cProfile
    import pstats
    pr = cProfile.Profile()
    pr.enable()
t = time.perf_counter()
llm.generate(reqs, params, use_tqdm=False)
wall = time.perf_counter() - t
core.step = _step
if do_cprofile:
    pr.disable()
    pstats.Stats(pr).sort_stats("tottime").print_stats(28)
print(f"{name} {extra} min_splits={min_splits}: {sum(out_lens)} output tokens in {wall:.2f} s = "
      f"{sum(out_lens) / wall:,.0f} output tok/s")
print(TIMER.report())
print("steps by kind (requests <= bucket): count, total s, mean ms")
for (kind, bucket), (n, s) in sorted(steps.items()):
    print(f"  {kind:<8}{bucket:>5}: {n:6d} {s:8.3f} {1000 * s / n:8.2f}")
compiled = []
for root, _, files in os.walk(os.environ["TRITON_CACHE_DIR"]):
    for f in files:
        p = os.path.join(root, f)
        if f.endswith(".json") and not f.startswith("__grp") and os.path.getmtime(p) > marker:
            compiled.append(f)
print(f"Triton kernels compiled during the timed run: {len(compiled)} {sorted(compiled)[:12]}")
if do_profile:
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        t = time.perf_counter()
        llm.generate(reqs, params, use_tqdm=False)
        torch.cuda.synchronize()
        wall_p = time.perf_counter() - t
    avg = prof.key_averages()
    total = sum(e.self_device_time_total for e in avg)
    print(f"profiled run: {wall_p:.2f} s wall, {total / 1e6:.2f} s of kernel time "
          f"({100 * total / 1e6 / wall_p:.0f}% busy)")
    for e in sorted(avg, key=lambda e: -e.self_device_time_total)[:12]:
        print(f"  {e.self_device_time_total / 1e3:9.1f} ms {100 * e.self_device_time_total / total:5.1f}% "
              f"{e.count:7d}x {e.self_device_time_total / max(e.count, 1):8.1f} us  {e.key[:90]}")
