"""`tokenmill bench spec`: speculative decoding on real weights, batch 1: the embedded default model (or --model) with no drafts, ngram
and suffix decoding, on chat prompts that quote their own context (edit or repeat a given passage or code block)
and on ordinary chat prompts. Greedy, so every method must give the very same tokens (checked).

Usage: tokenmill bench spec [--model PATH] [--max-tokens 128] [--k 4] [--rounds 3] [--dtype float32]
Prints per prompt kind and method: output tok/s over all rounds (each prompt one at a time, the methods taking
turns prompt by prompt), the speed-up over no drafts (overall and per round), the speed-up of decoding alone (the
time after each reply's first token: the prompt's prefill, the same work for every method, left out) and the draft
acceptance rate; then one JSON line with every figure.
"""
from __future__ import annotations

import argparse
import json
import time

CODE = '''def moving_average(values, window):
    if window <= 0:
        raise ValueError("window must be positive")
    out = []
    total = 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        if i + 1 >= window:
            out.append(total / window)
    return out
'''
PASSAGE = ("The old lighthouse stood at the edge of the cliff, its white paint peeling in the salt wind. Every "
           "evening the keeper climbed the spiral stairs, lit the great lamp, and watched the ships pass far out "
           "at sea. In the winter storms the waves reached halfway up the tower, and the keeper would sit by the "
           "window with a cup of tea, listening to the wind and waiting for the morning light.")
QUOTING = [
    f"Here is a Python function:\n\n{CODE}\nRewrite this function with the parameter `values` renamed to `data`. "
    "Output only the code.",
    f"Repeat the following code block exactly, then add a docstring to it:\n\n{CODE}",
    f"Here is a passage:\n\n{PASSAGE}\n\nRewrite the passage, replacing 'keeper' with 'guardian'. Change nothing "
    "else.",
    f"Copy this paragraph word for word:\n\n{PASSAGE}",
]
ORDINARY = [
    "What are three good habits for staying healthy?",
    "Write a short story about a robot who learns to paint.",
    "Explain why the sky is blue.",
    "Give me some tips for learning a new language.",
]
METHODS = {"none": None, "ngram": {"method": "ngram", "prompt_lookup_min": 2, "prompt_lookup_max": 5},
           "suffix": {"method": "suffix"}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="tokenmill bench spec", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--rounds", type=int, default=3,
                    help="timed rounds; each builds fresh engines (suffix decoding's trie starts empty) and runs "
                    "every prompt under every method in turn, so that a drift in the machine's speed touches all "
                    "methods alike. The figures sum the rounds")
    ap.add_argument("--dtype", default="auto", help="float32: the dense oracle path (batch-shape-invariant "
                    "enough for greedy identity); auto: the default quantized path, whose bf16 / fp16 products can "
                    "round differently at k + 1 rows than at 1 and so flip near-ties")
    ap.add_argument("--no-step-aside", action="store_true",
                    help="speculate at every step (step_aside false): the drafts' own cost and gain, without the "
                    "engine's measured fallback to plain decoding")
    ap.add_argument("-O", "--optimization-level", type=int, default=2, choices=(0, 1, 2, 3),
                    help="the engines' -O level (-O3 on the CPU: the model's steps through torch.compile)")
    args = ap.parse_args(argv)
    from tokenmill import LLM, SamplingParams
    sp = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    tokens: dict = {}
    secs = {(kind, name): 0.0 for kind in ("quoting", "ordinary") for name in METHODS}
    n_tok = dict.fromkeys(secs, 0)
    decode_secs, decode_tok = dict.fromkeys(secs, 0.0), dict.fromkeys(secs, 0)  # after each reply's first token
    counts = dict.fromkeys(secs, (0, 0))  # (drafted, accepted)
    per_round = {key: [] for key in secs}
    # Process-wide first-use costs (the CPU math libraries' kernels for each new product shape, lazy imports) are
    # paid here, by an engine without drafts over every prompt, so that no timed run carries them.
    warm = LLM(args.model, max_model_len=args.max_model_len, dtype=args.dtype,
               optimization_level=args.optimization_level)
    warm.chat([[{"role": "user", "content": p}] for p in QUOTING + ORDINARY], sp, use_tqdm=False)
    del warm
    for _ in range(args.rounds):
        engines = {}
        for name, spec in METHODS.items():
            if spec is not None:
                spec = {**spec, "num_speculative_tokens": args.k, "step_aside": not args.no_step_aside}
            engines[name] = llm = LLM(args.model, speculative_config=spec, max_model_len=args.max_model_len,
                                      dtype=args.dtype, optimization_level=args.optimization_level)
            llm.chat([[{"role": "user", "content": "Hello"}]], sp, use_tqdm=False)   # warm-up
        round_tok, round_secs = dict.fromkeys(secs, 0), dict.fromkeys(secs, 0.0)
        for kind, prompts in (("quoting", QUOTING), ("ordinary", ORDINARY)):
            for i, p in enumerate(prompts):
                for name, llm in engines.items():
                    before = _spec_counts(llm)
                    t = time.perf_counter()
                    out_req = llm.chat([[{"role": "user", "content": p}]], sp, use_tqdm=False)[0]
                    out = out_req.outputs[0]
                    dt = time.perf_counter() - t
                    after = _spec_counts(llm)
                    key = (kind, name)
                    tokens.setdefault((kind, i), {}).setdefault(name, set()).add(tuple(out.token_ids))
                    round_tok[key] += len(out.token_ids)
                    round_secs[key] += dt
                    m = out_req.metrics
                    if m is not None and m.first_token_time is not None and m.last_token_time is not None:
                        decode_secs[key] += m.last_token_time - m.first_token_time
                        decode_tok[key] += len(out.token_ids) - 1
                    counts[key] = tuple(c + a - b for c, a, b in zip(counts[key], after, before))
        for key in secs:
            secs[key] += round_secs[key]
            n_tok[key] += round_tok[key]
            per_round[key].append(round_tok[key] / round_secs[key])
        del engines, llm
    results = {}
    for key in secs:
        drafted, accepted = counts[key]
        results[key] = {"tok_s": n_tok[key] / secs[key], "tokens": n_tok[key], "rounds_tok_s": per_round[key],
                        "decode_tok_s": decode_tok[key] / decode_secs[key] if decode_secs[key] else None,
                        "acceptance": accepted / drafted if drafted else None}
    same = sum(len(set().union(*by.values())) == 1 for by in tokens.values())
    for (kind, name), r in results.items():
        base = results[kind, "none"]["tok_s"]
        acc = "-" if r["acceptance"] is None else f"{100 * r['acceptance']:.0f}%"
        ratios = " ".join(f"{x / b:.2f}" for x, b in zip(r["rounds_tok_s"], results[kind, "none"]["rounds_tok_s"]))
        dec, dec_base = r["decode_tok_s"], results[kind, "none"]["decode_tok_s"]
        dec = f"x{dec / dec_base:.2f}" if dec and dec_base else "-"
        print(f"{kind:9s} {name:7s} {r['tok_s']:7.1f} tok/s  x{r['tok_s'] / base:.2f} (rounds {ratios})  "
              f"decoding alone {dec}  acceptance {acc}")
    print(f"prompts whose greedy tokens are identical across methods: {same} of {len(tokens)}")
    print(json.dumps({"k": args.k, "max_tokens": args.max_tokens, "dtype": args.dtype, "rounds": args.rounds,
                      "step_aside": not args.no_step_aside, "identical_prompts": same,
                      "results": {f"{k}/{n}": r for (k, n), r in results.items()}}))
    return 0


def _spec_counts(llm) -> tuple[int, int]:
    m = {x.name: x for x in llm.get_metrics()}
    if "vllm:spec_decode_num_draft_tokens" not in m:
        return 0, 0
    return m["vllm:spec_decode_num_draft_tokens"].value, m["vllm:spec_decode_num_accepted_tokens"].value


if __name__ == "__main__":
    raise SystemExit(main())
