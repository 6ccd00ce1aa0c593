"""`tokenmill bench latency`: time one batch of fixed-length requests end to end, with percentiles.

Also reports the decode time per output token, from runs with output length N and 1 (so prefill cancels out).
"""
from __future__ import annotations

import argparse
import sys
import time

from tokenmill.benchmarks.offline_common import (ENGINE_FLAGS_EPILOG, add_sampling_args, random_token_prompts,
                                                 sampling_kwargs, split_engine_args, summarize, write_json)


def make_parser(prog: str = "tokenmill bench latency") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=__doc__, epilog=ENGINE_FLAGS_EPILOG,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--num-iters-warmup", type=int, default=3)
    p.add_argument("--num-iters", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output-json", default=None)
    add_sampling_args(p)
    return p


def main(argv: list[str] | None = None) -> dict:
    parser = make_parser()
    args, engine_kwargs = split_engine_args(sys.argv[1:] if argv is None else argv, parser)
    engine_kwargs.setdefault("seed", args.seed)
    sampling = sampling_kwargs(args)
    from tokenmill import LLM, SamplingParams
    llm = LLM(**engine_kwargs)
    vocab = llm.llm_engine.config.model_config.vocab_size
    prompts, _ = random_token_prompts(args.batch_size, args.input_len, args.output_len, 0.0, vocab, args.seed)
    inputs = [{"prompt_token_ids": p} for p in prompts]

    def run(n_out: int) -> float:
        sp = SamplingParams(**sampling, max_tokens=n_out, ignore_eos=True, detokenize=False)
        llm.reset_prefix_cache()  # every iteration pays its prefill
        t = time.perf_counter()
        llm.generate(inputs, sp, use_tqdm=False)
        return time.perf_counter() - t

    for _ in range(args.num_iters_warmup):
        run(args.output_len)
    lat = [run(args.output_len) for _ in range(args.num_iters)]
    prefill = [run(1) for _ in range(max(3, args.num_iters // 2))]
    stats = summarize(lat)
    decode_ms = 1000 * (stats["p50"] - summarize(prefill)["p50"]) / max(args.output_len - 1, 1)
    print(f"Avg latency: {stats['avg']:.4f} seconds")
    for k, v in stats.items():
        if k != "avg":
            print(f"{k[1:]}% percentile latency: {v:.4f} seconds")
    print(f"Median prefill + first token: {summarize(prefill)['p50'] * 1000:.2f} ms; decode: {decode_ms:.3f} ms per "
          f"output token at batch {args.batch_size}")
    spec = _spec_summary(llm)
    if spec:
        print(f"Speculative decoding: {spec['drafts']} verify steps, {spec['acceptance'] * 100:.1f}% of drafts "
              f"accepted, {spec['mean_tokens_per_step']:.2f} tokens per verify step")
    from tokenmill.metrics.step_timing import TIMER
    if TIMER.enabled:
        print(TIMER.report())
    result = {"avg_latency": stats["avg"], "latencies": lat, "percentiles": stats,
              "prefill_latencies": prefill, "decode_ms_per_token": decode_ms, "batch_size": args.batch_size,
              "input_len": args.input_len, "output_len": args.output_len, "spec_decode": spec, **sampling}
    write_json(args.output_json, result)
    return result


def _spec_summary(llm) -> dict | None:
    """The engine's speculative-decoding counters (None without drafts)."""
    m = {x.name: getattr(x, "value", None) for x in llm.get_metrics()}
    drafts = m.get("vllm:spec_decode_num_drafts")
    if not drafts:
        return None
    tokens, accepted = m["vllm:spec_decode_num_draft_tokens"], m["vllm:spec_decode_num_accepted_tokens"]
    return {"drafts": int(drafts), "acceptance": accepted / max(tokens, 1),
            "mean_tokens_per_step": 1 + accepted / drafts}


if __name__ == "__main__":
    main()
