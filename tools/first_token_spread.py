"""How much `tokenmill bench latency`'s "prefill + first token" (a generate of max_tokens=1) moves from one process
to the next (GPU machine). Session 15 saw it at 2.2-2.4 ms in some processes and 2.6-2.8 ms in others, with the
host-IO switch (TOKENMILL_GRAPH_HOST_IO) on or off alike; this prints six such runs, three right after a 256-token
run, and six more with a timing wrapper around the runner's execute_model.
Usage: python3 tools/first_token_spread.py (Qwen3-0.6B shape, dummy weights, batch 1, 128 prompt tokens)"""
from __future__ import annotations

import os
import statistics
import time

import numpy as np

from tokenmill import LLM, SamplingParams
from tokenmill.benchmarks.offline_common import shipped_model_dir


def main() -> None:
    llm = LLM(shipped_model_dir("qwen3-0.6b"), load_format="dummy", skip_tokenizer_init=True, max_model_len=2048,
              seed=0)
    runner = llm.llm_engine.engine_core.executor.worker.runner
    inputs = [{"prompt_token_ids": np.random.default_rng(0).integers(0, 150000, 128).tolist()}]

    def run(n: int) -> float:
        sp = SamplingParams(temperature=1.0, max_tokens=n, ignore_eos=True, detokenize=False)
        llm.reset_prefix_cache()
        t = time.perf_counter()
        llm.generate(inputs, sp, use_tqdm=False)
        return 1000 * (time.perf_counter() - t)

    run(256)
    plain = [run(1) for _ in range(6)]
    after = []
    for _ in range(3):
        run(256)
        after.append(run(1))
    spent: list[float] = []
    inner = runner.execute_model

    def timed(*a, **k):
        t = time.perf_counter()
        r = inner(*a, **k)
        spent.append(1e6 * (time.perf_counter() - t))
        return r
    runner.execute_model = timed
    wrapped = [run(1) for _ in range(6)]
    fmt = lambda xs: [round(x, 2) for x in xs]  # noqa: E731
    print(f"IO={os.environ.get('TOKENMILL_GRAPH_HOST_IO')}: run1 {fmt(plain)}; after run256 {fmt(after)}; "
          f"wrapped {fmt(wrapped)} (execute_model {statistics.median(spent):.0f} us)")


if __name__ == "__main__":
    main()
