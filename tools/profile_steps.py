"""Where does a decode step's time go? Runs on the GPU machine: bs-1 decode and a batch-256 decode, with
torch.profiler tables of CPU and CUDA time. Usage: python3 tools/profile_steps.py qwen3-0.6b"""
from __future__ import annotations

import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

from tokenmill import LLM, SamplingParams
from tokenmill.benchmarks.offline_common import shipped_model_dir

name = sys.argv[1] if len(sys.argv) > 1 else "qwen3-0.6b"
llm = LLM(shipped_model_dir(name), load_format="dummy", skip_tokenizer_init=True, max_model_len=2048)
eng = llm.llm_engine
for bs, steps in ((1, 64), (256, 32)):
    sp = SamplingParams(temperature=0.6, max_tokens=10_000 // 10, ignore_eos=True, detokenize=False)
    for i in range(bs):
        eng.add_request(f"{bs}-{i}", {"prompt_token_ids": list(range(100 + i, 228 + i))}, sp)
    while any(r.num_computed_tokens < r.num_prompt_tokens
              for r in eng.engine_core.scheduler.requests.values()):
        eng.step()
    for _ in range(8):
        eng.step()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(steps):
        eng.step()
    torch.cuda.synchronize()
    print(f"batch {bs}: {1000 * (time.perf_counter() - t) / steps:.3f} ms per decode step (wall)")
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(8):
            eng.step()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18, max_name_column_width=60))
    print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=12, max_name_column_width=60))
    eng.abort_request([f"{bs}-{i}" for i in range(bs)])
    eng.step()
