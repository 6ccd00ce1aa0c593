"""Why does bf16 greedy output differ from HF's on the tiny models? First mismatch per prompt and HF's top-1/top-2
logit gap there, for async scheduling on/off and graphs/eager. Usage: python3 tools/diag_bf16.py (needs CUDA)."""
from __future__ import annotations

import os
import sys

import torch
import transformers as tf

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from tests.conftest import _make_config  # noqa: E402
from tokenmill import LLM, SamplingParams  # noqa: E402

PROMPTS = ["Hello, my name is", "The quick brown fox jumps over the lazy dog because it", "深度学习的优势是什么？",
           "a", "In 1492, Columbus sailed across the Atlantic Ocean and reached the islands of"]
tok_dir = os.environ["TOKENMILL_TEST_TOKENIZER_DIR"]
tok = tf.AutoTokenizer.from_pretrained(tok_dir)
for arch in ("llama", "qwen3"):
    d = f"/tmp/diag-{arch}"
    cfg = _make_config(arch, len(tok), tok.bos_token_id or 0, tok.eos_token_id or 0)
    torch.manual_seed(0)
    tf.AutoModelForCausalLM.from_config(cfg).save_pretrained(d)
    tok.save_pretrained(d)
    hf = tf.AutoModelForCausalLM.from_pretrained(d, dtype=torch.bfloat16).cuda().eval()
    ref, gaps = [], []
    for p in PROMPTS:
        ids = tok(p, return_tensors="pt").input_ids.cuda()
        with torch.no_grad():
            g = hf.generate(ids, max_new_tokens=12, do_sample=False, output_logits=True,
                            return_dict_in_generate=True, eos_token_id=None, pad_token_id=0)
        ref.append(g.sequences[0, ids.shape[1]:].tolist())
        gaps.append([round((lambda t: (t[0] - t[1]).item())(torch.topk(lg[0].float(), 2).values), 3) for lg in g.logits])
    for kw in (dict(async_scheduling=True), dict(async_scheduling=False), dict(enforce_eager=True),
               dict(enforce_eager=True, async_scheduling=False)):
        llm = LLM(d, dtype="bfloat16", max_model_len=256, num_gpu_blocks_override=256, **kw)
        outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
        rep = []
        for o, r, gp in zip(outs, ref, gaps):
            t = o.outputs[0].token_ids
            i = next((k for k in range(len(r)) if t[k] != r[k]), None)
            rep.append("ok" if i is None else f"@{i} gap {gp[i]} min-gap-before {min(gp[:i] or [9])}")
        print(arch, kw, rep, flush=True)
        del llm
