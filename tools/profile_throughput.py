"""Where the nano-vllm throughput workload's GPU time goes: one timed run, then one under torch.profiler (CUDA
activity only, kernels inside CUDA graphs included), printing the kernels by total time and the GPU-busy share.
Usage (GPU machine): python3 tools/profile_throughput.py qwen3-0.6b [extra LLM kwargs as key=value ...]"""
from __future__ import annotations

import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

from tokenmill import LLM, SamplingParams
from tokenmill.benchmarks.offline_common import random_token_prompts, shipped_model_dir

name = sys.argv[1] if len(sys.argv) > 1 else "qwen3-0.6b"
extra = {}
for kv in sys.argv[2:]:
    k, v = kv.split("=", 1)
    extra[k] = int(v) if v.isdigit() else v
llm = LLM(shipped_model_dir(name), load_format="dummy", skip_tokenizer_init=True, max_model_len=2048,
          max_num_seqs=256, **extra)
vocab = llm.llm_engine.config.model_config.vocab_size
prompts, out_lens = random_token_prompts(256, 562, 562, 0.82, vocab, seed=0)
params = [SamplingParams(temperature=1.0, max_tokens=n, ignore_eos=True, detokenize=False) for n in out_lens]
reqs = [{"prompt_token_ids": p} for p in prompts]
llm.generate(reqs[:2], params[:2], use_tqdm=False)
t = time.perf_counter()
llm.generate(reqs, params, use_tqdm=False)
wall = time.perf_counter() - t
print(f"{name} {extra}: {sum(out_lens)} output tokens in {wall:.2f} s = {sum(out_lens) / wall:,.0f} output tok/s")
with profile(activities=[ProfilerActivity.CUDA]) as prof:
    t = time.perf_counter()
    llm.generate(reqs, params, use_tqdm=False)
    torch.cuda.synchronize()
    wall_p = time.perf_counter() - t
avg = prof.key_averages()
total = sum(e.self_device_time_total for e in avg)
print(f"profiled run: {wall_p:.2f} s wall, {total / 1e6:.2f} s of kernel time ({100 * total / 1e6 / wall_p:.0f}% busy)")
for e in sorted(avg, key=lambda e: -e.self_device_time_total)[:18]:
    print(f"  {e.self_device_time_total / 1e3:9.1f} ms {100 * e.self_device_time_total / total:5.1f}% "
          f"{e.count:7d}x {e.self_device_time_total / max(e.count, 1):8.1f} us  {e.key[:90]}")
