"""TP=1 vs TP=N on one model shape (GPU machine): greedy tokens, batch-1 decode latency and the nano-vllm throughput
workload, one engine start per tensor-parallel size.

  python3 tools/tp_compare.py run TP OUT.json [MODEL]   # one engine: greedy + latency + throughput -> OUT.json
  python3 tools/tp_compare.py compare A.json B.json     # greedy agreement, with TP=1's top-2 margin at divergences
"""
from __future__ import annotations

import json
import statistics
import sys
import time


def run(tp: int, out_path: str, model: str = "llama-3-8b") -> None:
    import numpy as np

    from tokenmill import LLM, SamplingParams
    from tokenmill.benchmarks.offline_common import random_token_prompts, shipped_model_dir
    llm = LLM(shipped_model_dir(model) or model, load_format="dummy", skip_tokenizer_init=True, max_model_len=2048,
              max_num_seqs=256, tensor_parallel_size=tp)
    vocab = llm.llm_engine.config.model_config.vocab_size
    res: dict = {"tp": tp, "model": model}
    # Greedy, with the top-2 logprobs at every position (the margin says how close a tie was).
    rng = np.random.default_rng(7)
    prompts = [{"prompt_token_ids": rng.integers(1, int(vocab * 0.9), size=int(n)).tolist()}
               for n in rng.integers(16, 200, size=24)]
    sp = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True, logprobs=2, detokenize=False)
    outs = llm.generate(prompts, sp, use_tqdm=False)
    res["greedy"] = [{"ids": list(o.outputs[0].token_ids),
                      "top2": [sorted((x.logprob for x in lp.values()), reverse=True)[:2]
                               for lp in o.outputs[0].logprobs]} for o in outs]
    # Batch-1 decode: 128 in, 256 out minus 128 in, 1 out, over 255 tokens (median of 3).
    one = [{"prompt_token_ids": rng.integers(1, int(vocab * 0.9), size=128).tolist()}]

    def timed(n: int) -> float:
        t = time.perf_counter()
        llm.generate(one, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, detokenize=False),
                     use_tqdm=False)
        return time.perf_counter() - t
    timed(256)
    full = statistics.median(timed(256) for _ in range(3))
    first = statistics.median(timed(1) for _ in range(3))
    res["bs1_decode_ms"] = 1000 * (full - first) / 255
    # Throughput: the nano-vllm workload (256 requests, lengths uniform in 101..1022, ignore_eos, seed 0).
    ps, out_lens = random_token_prompts(256, 562, 562, 0.82, vocab, seed=0)
    params = [SamplingParams(temperature=1.0, max_tokens=n, ignore_eos=True, detokenize=False) for n in out_lens]
    reqs = [{"prompt_token_ids": p} for p in ps]
    llm.generate(reqs[:2], params[:2], use_tqdm=False)
    t = time.perf_counter()
    llm.generate(reqs, params, use_tqdm=False)
    res["throughput_s"] = time.perf_counter() - t
    res["output_tok_s"] = sum(out_lens) / res["throughput_s"]
    print(f"TP={tp}: bs1 decode {res['bs1_decode_ms']:.3f} ms/token, throughput {res['output_tok_s']:,.0f} "
          f"output tok/s ({res['throughput_s']:.2f} s)", flush=True)
    with open(out_path, "w") as f:
        json.dump(res, f)


def compare(a_path: str, b_path: str) -> None:
    a, b = json.load(open(a_path)), json.load(open(b_path))
    same, rows = 0, []
    for i, (x, y) in enumerate(zip(a["greedy"], b["greedy"])):
        if x["ids"] == y["ids"]:
            same += 1
            continue
        j = next(k for k, (p, q) in enumerate(zip(x["ids"], y["ids"])) if p != q)
        margin = x["top2"][j][0] - x["top2"][j][1]
        rows.append(f"  prompt {i}: first differs at token {j}, TP={a['tp']} top-2 logprob margin there {margin:.2e}")
    margins = [t[0] - t[1] for g in a["greedy"] for t in g["top2"]]
    print(f"greedy: {same}/{len(a['greedy'])} prompts identical over {len(a['greedy'][0]['ids'])} tokens; "
          f"median TP={a['tp']} top-2 margin {statistics.median(margins):.2e}")
    print("\n".join(rows))
    print(f"bs1 decode: TP={a['tp']} {a['bs1_decode_ms']:.3f} ms, TP={b['tp']} {b['bs1_decode_ms']:.3f} ms "
          f"({b['bs1_decode_ms'] / a['bs1_decode_ms']:.3f}x)")
    print(f"throughput: TP={a['tp']} {a['output_tok_s']:,.0f}, TP={b['tp']} {b['output_tok_s']:,.0f} output tok/s "
          f"({b['output_tok_s'] / a['output_tok_s']:.2f}x)")


if __name__ == "__main__":
    if sys.argv[1] == "run":
        run(int(sys.argv[2]), sys.argv[3], *sys.argv[4:5])
    else:
        compare(sys.argv[2], sys.argv[3])
