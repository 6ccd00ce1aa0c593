"""Shared pieces of the offline benchmarks: engine flags, shipped benchmark model shapes, random token prompts."""
from __future__ import annotations

import argparse
import os
import sys
from typing import Any

import numpy as np

ENGINE_FLAGS_EPILOG = ("Every engine flag of `tokenmill serve` is accepted too (e.g. --load-format dummy, --dtype, "
                       "--max-model-len, --max-num-seqs, --enforce-eager).")
_SHIPPED = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "model_configs")


def shipped_model_dir(name: str | None) -> str | None:
    """`qwen3-0.6b` / `llama-3-8b`: config-only directories shipped with tokenmill, for --load-format dummy."""
    if name is None:
        return None
    path = os.path.join(_SHIPPED, name.lower())
    return path if not os.path.exists(name) and os.path.isfile(os.path.join(path, "config.json")) else None


def split_engine_args(argv: list[str], bench_parser: argparse.ArgumentParser) -> tuple[argparse.Namespace, dict]:
    """Benchmark flags are parsed here; everything else goes through the `serve` parser as engine arguments."""
    from tokenmill.config.args import parse_serve_args
    args, rest = bench_parser.parse_known_args(argv)
    engine_kwargs, _ = parse_serve_args(rest, prog=bench_parser.prog)
    model = engine_kwargs.get("model")
    shipped = shipped_model_dir(model)
    if shipped is not None:
        engine_kwargs["model"] = shipped
        engine_kwargs.setdefault("load_format", "dummy")
    spec = engine_kwargs.get("speculative_config")
    if isinstance(spec, str):
        import json
        spec = json.loads(spec)
    if isinstance(spec, dict) and shipped_model_dir(spec.get("model")) is not None:  # a shipped draft shape
        engine_kwargs["speculative_config"] = {**spec, "model": shipped_model_dir(spec["model"])}
    if engine_kwargs.get("load_format") == "dummy" and engine_kwargs.get("model") and not _has_tokenizer(
            engine_kwargs["model"]):
        engine_kwargs["skip_tokenizer_init"] = True
    return args, engine_kwargs


def require_cuda(prog: str, num_gpus: int = 1) -> None:
    """Exit with status 2 and a one-line reason unless this machine has at least num_gpus CUDA devices."""
    import torch
    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if have < num_gpus:
        print(f"{prog}: needs {num_gpus} CUDA GPU{'s' if num_gpus > 1 else ''}; this machine has {have}",
              file=sys.stderr)
        raise SystemExit(2)


def _has_tokenizer(model: str) -> bool:
    return os.path.isdir(model) and any(
        os.path.exists(os.path.join(model, f)) for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model"))


def random_token_prompts(num: int, input_len: int, output_len: int, range_ratio: float, vocab_size: int,
                         seed: int) -> tuple[list[list[int]], list[int]]:
    """Prompts of random token ids with lengths uniform in [len*(1-r), len*(1+r)] (vLLM's random dataset)."""
    if not 0 <= range_ratio < 1:
        raise ValueError(f"--random-range-ratio must be in [0, 1), got {range_ratio}.")
    rng = np.random.default_rng(seed)

    def lengths(n: int) -> np.ndarray:
        lo, hi = max(1, int(n * (1 - range_ratio))), max(1, int(n * (1 + range_ratio)))
        return rng.integers(lo, hi + 1, size=num)

    in_lens, out_lens = lengths(input_len), lengths(output_len)
    # Stay clear of the ids where tokenizers keep special tokens (the top of the vocabulary).
    high = max(2, int(vocab_size * 0.9))
    prompts = [rng.integers(1, high, size=int(n)).tolist() for n in in_lens]
    return prompts, [int(n) for n in out_lens]


def add_dataset_args(p: argparse.ArgumentParser, input_len: int, output_len: int, num_prompts: int) -> None:
    p.add_argument("--dataset-name", default="random", choices=["random"],
                   help="Only random token prompts are available offline.")
    p.add_argument("--input-len", "--random-input-len", type=int, default=input_len, dest="input_len")
    p.add_argument("--output-len", "--random-output-len", type=int, default=output_len, dest="output_len")
    p.add_argument("--random-range-ratio", type=float, default=0.0,
                   help="Lengths are uniform in [len*(1-r), len*(1+r)].")
    p.add_argument("--num-prompts", type=int, default=num_prompts)
    p.add_argument("--seed", type=int, default=0)


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--temperature", type=float, default=1.0,
                   help="Sampling temperature of every request (0: greedy; default 1.0, as vLLM's bench uses).")
    p.add_argument("--top-p", type=float, default=1.0, help="Nucleus sampling mass in (0, 1] (1: off).")
    p.add_argument("--top-k", type=int, default=0, help="Keep the k most likely tokens (0 or -1: off).")
    p.add_argument("--min-p", type=float, default=0.0,
                   help="Drop tokens less likely than min_p times the most likely one, in [0, 1] (0: off).")


def sampling_kwargs(args: argparse.Namespace) -> dict:
    """The sampling flags as SamplingParams fields, validated there: a bad value is refused (ValueError naming
    the field) before any model loads."""
    from tokenmill import SamplingParams
    kw = {"temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k, "min_p": args.min_p}
    SamplingParams(**kw)
    return kw


def summarize(values: list[float], percentiles=(10, 25, 50, 75, 90, 99)) -> dict[str, Any]:
    arr = np.asarray(values)
    return {"avg": float(arr.mean()), **{f"p{p}": float(np.percentile(arr, p)) for p in percentiles}}


def write_json(path: str | None, result: dict[str, Any]) -> None:
    if path:
        import json
        with open(path, "w") as f:
            json.dump(result, f, indent=2)
