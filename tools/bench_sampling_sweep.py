"""The nano-vllm workload under the seeds' sampling settings on one engine: `python3 tools/bench_sampling_sweep.py
MODEL [OUT_DIR]` (a shipped shape with dummy weights, or a model directory). 256 requests (NUM_PROMPTS), lengths
uniform in 101..1022, seed 0, CUDA graphs, prefix caching off; greedy first and last, each setting's out tok/s and
its ratio to the greedy mean; OUT_DIR/sampling_sweep_<name>.json."""
import json
import os
import sys
import time

SETTINGS = [("greedy", dict(temperature=0.0)), ("t0.6/p0.95", dict(temperature=0.6, top_p=0.95)),
            ("t0.7/k20/p0.8", dict(temperature=0.7, top_k=20, top_p=0.8)),
            ("min_p 0.05", dict(temperature=1.0, min_p=0.05)),
            ("t0.6/k20/p0.95", dict(temperature=0.6, top_k=20, top_p=0.95)), ("greedy (again)", dict(temperature=0.0))]

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tokenmill import LLM, SamplingParams  # noqa: E402
from tokenmill.benchmarks.offline_common import random_token_prompts, shipped_model_dir  # noqa: E402

name, out_dir = sys.argv[1], (sys.argv[2] if len(sys.argv) > 2 else os.environ.get("OUT", "/tmp/out"))
shipped = shipped_model_dir(name)
llm = LLM(model=shipped or name, load_format="dummy" if shipped else "auto", skip_tokenizer_init=True,
          max_model_len=2048, max_num_seqs=256, enable_prefix_caching=False, seed=0)
prompts, out_lens = random_token_prompts(int(os.environ.get("NUM_PROMPTS", "256")), 562, 562, 0.82,
                                         llm.llm_engine.config.model_config.vocab_size, 0)
reqs, results = [{"prompt_token_ids": p} for p in prompts], []
for label, kw in SETTINGS:
    params = [SamplingParams(**kw, seed=i, max_tokens=n, ignore_eos=True, detokenize=False)
              for i, n in enumerate(out_lens)]
    llm.generate(reqs[:2], params[:2], use_tqdm=False)  # warm-up: this setting's kernels compile here
    start = time.perf_counter()
    outs = llm.generate(reqs, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    produced = sum(len(o.outputs[0].token_ids) for o in outs)
    assert produced == sum(out_lens), (label, produced, sum(out_lens))
    results.append({"setting": label, **kw, "elapsed_s": elapsed, "output_tok_s": produced / elapsed})
greedy = (results[0]["output_tok_s"] + results[-1]["output_tok_s"]) / 2
for r in results:
    r["vs_greedy"] = r["output_tok_s"] / greedy
    print(f"{name} {r['setting']:16s} {r['output_tok_s']:10.1f} out tok/s  {r['vs_greedy']:.3f} of greedy")
os.makedirs(out_dir, exist_ok=True)
with open(os.path.join(out_dir, f"sampling_sweep_{os.path.basename(name.rstrip('/'))}.json"), "w") as f:
    json.dump(results, f, indent=1)
