"""`tokenmill bench throughput`: offline throughput on random prompts, optionally against HF transformers.

Prints `Throughput: X requests/s, Y total tokens/s, Z output tokens/s` like `vllm bench throughput`.
"""
from __future__ import annotations

import argparse
import sys
import time

from tokenmill.benchmarks.offline_common import (ENGINE_FLAGS_EPILOG, add_dataset_args, add_sampling_args,
                                                 random_token_prompts, sampling_kwargs, split_engine_args, write_json)


def make_parser(prog: str = "tokenmill bench throughput") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=__doc__, epilog=ENGINE_FLAGS_EPILOG,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_dataset_args(p, input_len=1024, output_len=128, num_prompts=1000)
    p.add_argument("--backend", default="tokenmill", choices=["tokenmill", "vllm", "hf"],
                   help="tokenmill (alias vllm): this engine; hf: HF transformers generate on the same prompts.")
    p.add_argument("--hf-max-batch-size", type=int, default=256, help="Batch size for --backend hf.")
    add_sampling_args(p)
    p.add_argument("--output-json", default=None, help="Write the results here as JSON.")
    p.add_argument("--disable-detokenize", action="store_true", help="Return token ids only.")
    return p


def run_tokenmill(prompts, out_lens, engine_kwargs, sampling: dict, detokenize: bool) -> tuple[float, int]:
    """Seconds for the whole batch, and how many times a request was preempted (its KV freed and recomputed):
    the figure that tells a throughput lost to an oversubscribed KV pool from one lost elsewhere."""
    from tokenmill import LLM, SamplingParams
    llm = LLM(**engine_kwargs)
    detok = detokenize and llm.llm_engine.get_tokenizer() is not None
    params = [SamplingParams(**sampling, max_tokens=n, ignore_eos=True, detokenize=detok) for n in out_lens]
    llm.generate([{"prompt_token_ids": p} for p in prompts[:2]], params[:2], use_tqdm=False)  # warm-up
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=True)
    elapsed = time.perf_counter() - start
    produced = sum(len(o.outputs[0].token_ids) for o in outs)
    if produced != sum(out_lens):
        raise RuntimeError(f"expected {sum(out_lens)} output tokens, got {produced}")
    preemptions = sum(int(m.value) for m in llm.get_metrics() if m.name == "vllm:num_preemptions")
    return elapsed, preemptions


# The engine flags the HF baseline uses (which weights, in which dtype; the seed of its sampling); any other engine
# flag is rejected with --backend hf rather than silently ignored. skip_tokenizer_init is set by the bench itself.
_HF_FLAGS = ("model", "dtype", "load_format", "seed", "max_model_len", "skip_tokenizer_init")


def run_hf(prompts, out_lens, engine_kwargs, batch_size: int, sampling: dict) -> tuple[float, int]:
    """HF generate in batches of left-padded prompts. A batch runs to its longest requested output, and every
    token it generates is counted (generous to HF: it is credited for tokens nobody asked for)."""
    unused = sorted(k for k in engine_kwargs if k not in _HF_FLAGS)
    if unused:
        raise ValueError(f"--backend hf does not use {', '.join('--' + k.replace('_', '-') for k in unused)}: "
                         f"the HF baseline takes only --model, --dtype, --load-format, --seed and --max-model-len "
                         f"besides the benchmark's own flags")
    import torch
    import transformers as tf
    from tokenmill.config.engine_args import create_engine_config
    from tokenmill.transformers_utils.config_snapshot import hf_config_object
    torch.manual_seed(engine_kwargs["seed"])
    cfg = create_engine_config(**{**engine_kwargs, "skip_tokenizer_init": True})
    mc = cfg.model_config
    device = cfg.device_config.torch_device
    dtype = mc.get_torch_dtype(device)
    if engine_kwargs.get("load_format") == "dummy":
        model = tf.AutoModelForCausalLM.from_config(hf_config_object(mc.hf_config), dtype=dtype).to(device)
    else:
        kw = {"gguf_file": mc.resolved.gguf_file} if mc.is_gguf else {}
        model = tf.AutoModelForCausalLM.from_pretrained(mc.resolved.path, dtype=dtype, **kw).to(device)
    model.eval()
    temperature = sampling["temperature"]
    # top_k=0 spelled out: HF's generation config would otherwise apply its default top-k of 50.
    draw = ({"do_sample": True, "temperature": temperature, "top_p": sampling["top_p"],
             "top_k": max(sampling["top_k"], 0), **({"min_p": sampling["min_p"]} if sampling["min_p"] > 0 else {})}
            if temperature > 0 else {"do_sample": False})
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    generated = 0
    start = time.perf_counter()
    for b in range(0, len(order), batch_size):
        idx = order[b:b + batch_size]
        width = max(len(prompts[i]) for i in idx)
        ids = torch.zeros((len(idx), width), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for r, i in enumerate(idx):
            ids[r, width - len(prompts[i]):] = torch.tensor(prompts[i])
            mask[r, width - len(prompts[i]):] = 1
        n = max(out_lens[i] for i in idx)
        generated += n * len(idx)
        with torch.no_grad():
            model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), max_new_tokens=n,
                           min_new_tokens=n, pad_token_id=0, **draw)
    return time.perf_counter() - start, generated


def main(argv: list[str] | None = None) -> dict:
    parser = make_parser()
    args, engine_kwargs = split_engine_args(sys.argv[1:] if argv is None else argv, parser)
    engine_kwargs.setdefault("seed", args.seed)
    sampling = sampling_kwargs(args)
    from tokenmill.config.engine_args import create_engine_config
    vocab = create_engine_config(**{**engine_kwargs, "skip_tokenizer_init": True}).model_config.vocab_size
    prompts, out_lens = random_token_prompts(args.num_prompts, args.input_len, args.output_len,
                                             args.random_range_ratio, vocab, args.seed)
    n_in, n_out = sum(map(len, prompts)), sum(out_lens)
    if args.backend == "hf":
        elapsed, n_out = run_hf(prompts, out_lens, engine_kwargs, args.hf_max_batch_size, sampling)
    else:
        elapsed, preemptions = run_tokenmill(prompts, out_lens, engine_kwargs, sampling, not args.disable_detokenize)
    result = {"backend": args.backend, **sampling, "elapsed_time": elapsed, "num_requests": len(prompts),
              "total_input_tokens": n_in, "total_output_tokens": n_out,
              "requests_per_second": len(prompts) / elapsed, "tokens_per_second": (n_in + n_out) / elapsed,
              "output_tokens_per_second": n_out / elapsed}
    print(f"Throughput: {result['requests_per_second']:.2f} requests/s, {result['tokens_per_second']:.2f} total "
          f"tokens/s, {result['output_tokens_per_second']:.2f} output tokens/s")
    print(f"Total num prompt tokens:  {n_in}\nTotal num output tokens:  {n_out}")
    if args.backend != "hf":
        result["num_preemptions"] = preemptions
        print(f"Preemptions: {preemptions}")
    from tokenmill.metrics.step_timing import TIMER
    if TIMER.enabled:
        print(TIMER.report())
    write_json(args.output_json, result)
    return result


if __name__ == "__main__":
    main()
