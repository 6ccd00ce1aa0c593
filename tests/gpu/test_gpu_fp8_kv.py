"""fp8 KV cache on CUDA end to end (Triton kernels, CUDA graphs), with per-layer KV scales in the checkpoint.

fp32 activations, so bf16 near-ties cannot blur the comparison. The oracle is the same engine with a float cache fed
K/V that were already rounded to fp8 * scale (tests/entrypoints/test_llm_fp8_kv.py does the same on the CPU, where
the match is bit for bit); here the kernels fold the scales into the softmax scale and the output instead of
multiplying each element, so logprobs agree to ~1e-5, not exactly.
"""
from __future__ import annotations


import pytest
import torch

pytestmark = pytest.mark.gpu

PROMPTS = ["Hello, my name is", "The quick brown fox jumps over the lazy dog because it", "深度学习的优势是什么？",
           "a", "In 1492, Columbus sailed across the Atlantic Ocean and reached the islands of"] * 3


@pytest.fixture(scope="module")
def scaled_dir(kv_scaled_llama):
    return kv_scaled_llama


def logprobs(out) -> torch.Tensor:
    c = out.outputs[0]
    return torch.tensor([lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids)])


def test_fp8_matches_rounded_kv_with_and_without_cuda_graphs(scaled_dir, monkeypatch):
    from tokenmill import LLM, SamplingParams
    from tokenmill.kernels.kv_fp8 import dequantize, quantize
    from tokenmill.attention.layer import Attention
    sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=1)
    kw = dict(device="cuda", dtype="float32", max_model_len=256, num_gpu_blocks_override=512, max_num_seqs=32)

    graphs = LLM(scaled_dir, kv_cache_dtype="fp8", **kw)
    runner = graphs.llm_engine.engine_core.executor.worker.runner
    assert runner.cuda_graphs is not None and runner.kv_caches[0].dtype == torch.float8_e4m3fn
    assert runner.model.model.layers[0].self_attn.attn.k_scale.item() == pytest.approx(0.05)
    got = graphs.generate(PROMPTS, sp, use_tqdm=False)
    del graphs, runner
    eager = LLM(scaled_dir, kv_cache_dtype="fp8", enforce_eager=True, **kw).generate(PROMPTS, sp, use_tqdm=False)

    forward = Attention.forward

    def rounded(self, q, k, v):
        k = dequantize(quantize(k, self.k_scale, torch.float8_e4m3fn), self.k_scale, k.dtype)
        v = dequantize(quantize(v, self.v_scale, torch.float8_e4m3fn), self.v_scale, v.dtype)
        return forward(self, q, k, v)

    monkeypatch.setattr(Attention, "forward", rounded)       # in place before the graphs are captured
    monkeypatch.setattr(Attention, "forward_qkv", lambda self, *a, **k: None)  # the fused store would skip it
    want = LLM(scaled_dir, kv_cache_dtype="auto", **kw).generate(PROMPTS, sp, use_tqdm=False)
    for g, e, w in zip(got, eager, want):
        assert g.outputs[0].token_ids == e.outputs[0].token_ids == w.outputs[0].token_ids
        torch.testing.assert_close(logprobs(g), logprobs(w), rtol=0, atol=1e-3)
