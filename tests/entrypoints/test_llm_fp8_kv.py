"""LLM(kv_cache_dtype="fp8"/"fp8_e5m2") end to end with checkpoint KV scales, on the CPU (torch reference backend,
pinned even where CUDA exists; tests/gpu/test_gpu_fp8_kv.py is the CUDA counterpart).

Two oracles:
  * exact: an fp8 cache must give the same tokens and logprobs as an fp32 cache fed K/V that were quantised and
    dequantised with the same scales (the fp8 path is exactly "round K/V to fp8 * scale", nothing else);
  * loose, against the plain fp32 cache: e4m3 keeps 3 mantissa bits, so every cached K/V element moves by up to
    2^-4 of itself. The tiny random model is deliberately sharp (init std 0.3, attention logits of order 10), so a
    6% error in K shifts attention logits by ~0.5 and token logprobs by a few tenths of a nat: measured on these
    prompts, mean |dlogprob| ~0.2 and max ~1 over the teacher-forced prompt tokens. The bounds are about twice
    that; a scale applied wrongly (e.g. the 0.02-0.05 checkpoint scales ignored on read: 20-50x too large K/V)
    moves logprobs by whole nats. Greedy first tokens must agree wherever the fp32 top-1 / top-2 margin exceeds
    0.5 nat (below that, a tie broken either way is no evidence of anything).
"""
from __future__ import annotations


import pytest
import torch

from tokenmill import LLM, SamplingParams
from tokenmill.attention.layer import Attention
from tokenmill.kernels.kv_fp8 import dequantize, quantize

PROMPTS = [
    "Hello, my name is",
    "The quick brown fox jumps over the lazy dog because it wanted to see what was on the other side of the hill",
    "深度学习的优势是什么？请详细说明。",
    "In 1492, Columbus sailed across the Atlantic Ocean and reached the islands of",
    "x " * 40,
    "The capital of France is Paris, and the capital of Germany is",
]
SP = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2, prompt_logprobs=0)
KV_BYTES = 1 << 20


@pytest.fixture(scope="module")
def scaled_dir(kv_scaled_llama):
    return kv_scaled_llama


def make(d, kv_cache_dtype, **kw):
    return LLM(d, device="cpu", max_model_len=256, kv_cache_memory_bytes=KV_BYTES, kv_cache_dtype=kv_cache_dtype,
               **kw)


def runner(llm):
    return llm.llm_engine.engine_core.executor.worker.runner


@pytest.fixture(scope="module")
def fp32_llm(scaled_dir):
    # No prefix caching: the same prompts run again through it with fake-quantised K/V.
    return make(scaled_dir, "auto", enable_prefix_caching=False)


@pytest.fixture(scope="module")
def fp32_outputs(fp32_llm):
    return fp32_llm.generate(PROMPTS, SP, use_tqdm=False)


def fake_quantised(llm, fp8, monkeypatch):
    """Outputs of the float-cache engine with every layer's new K/V rounded to fp8 * scale before the store."""
    forward = Attention.forward

    def rounded(self, q, k, v):
        k = dequantize(quantize(k, self.k_scale, fp8), self.k_scale, k.dtype)
        v = dequantize(quantize(v, self.v_scale, fp8), self.v_scale, v.dtype)
        return forward(self, q, k, v)

    with monkeypatch.context() as m:
        m.setattr(Attention, "forward", rounded)
        # The fused path (attention straight from the qkv projection) never calls Attention.forward: off, so that
        # every layer's K/V passes through the rounding above.
        m.setattr(Attention, "forward_qkv", lambda self, *a, **kw: None)
        return llm.generate(PROMPTS, SP, use_tqdm=False)


def prompt_lps(out) -> torch.Tensor:
    if out.prompt_logprobs is None:
        return torch.zeros(0)
    return torch.tensor([lp[t].logprob for lp, t in zip(out.prompt_logprobs[1:], out.prompt_token_ids[1:])])


def sampled_lps(out) -> torch.Tensor:
    c = out.outputs[0]
    return torch.tensor([lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids)])


@pytest.mark.parametrize("kv_dtype, fp8", [("fp8", torch.float8_e4m3fn), ("fp8_e5m2", torch.float8_e5m2)],
                         ids=["e4m3", "e5m2"])
def test_fp8_cache_equals_fp32_cache_of_rounded_kv(scaled_dir, fp32_llm, kv_dtype, fp8, monkeypatch):
    llm = make(scaled_dir, kv_dtype)
    attn = runner(llm).model.model.layers[0].self_attn.attn
    assert runner(llm).kv_caches[0].dtype == fp8
    assert attn.k_scale.item() == pytest.approx(0.05) and attn.v_scale.item() == pytest.approx(0.02)
    got = llm.generate(PROMPTS, SP, use_tqdm=False)
    want = fake_quantised(fp32_llm, fp8, monkeypatch)
    # The two engines reach attention by different paths (the fp32 one without its fused qkv decode), so their
    # fp32 sums differ in the last bits: up to ~1e-5 on these logprobs (of ~4) on an AVX2 host. The fp8 rounding
    # itself moves them by tenths of a nat (this file's loose oracle), four orders of magnitude past the bound.
    for g, w in zip(got, want):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        torch.testing.assert_close(sampled_lps(g), sampled_lps(w), rtol=0, atol=5e-5)
        torch.testing.assert_close(prompt_lps(g), prompt_lps(w), rtol=0, atol=5e-5)
    # A second pass reads the prompts' K/V back from the prefix cache (stored as fp8): same result.
    again = llm.generate(PROMPTS, SP, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in got]


def test_fp8_cache_close_to_fp32_cache(scaled_dir, fp32_outputs):
    got = make(scaled_dir, "fp8").generate(PROMPTS, SP, use_tqdm=False)
    diffs, checked = [], 0
    for g, w in zip(got, fp32_outputs):
        diffs.append((prompt_lps(g) - prompt_lps(w)).abs())
        top2 = sorted((v.logprob for v in w.outputs[0].logprobs[0].values()), reverse=True)[:2]
        if top2[0] - top2[1] > 0.5:
            assert g.outputs[0].token_ids[0] == w.outputs[0].token_ids[0]
            checked += 1
    assert checked >= 2, "too few prompts with a clear first token to compare"
    d = torch.cat(diffs)
    assert d.mean().item() < 0.4 and d.max().item() < 2.0, (d.mean().item(), d.max().item())


def test_fp8_doubles_the_kv_blocks(scaled_dir, fp32_llm):
    blocks = {}
    for kv_dtype in ("bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2"):
        llm = make(scaled_dir, kv_dtype)
        blocks[kv_dtype] = llm.llm_engine.engine_core.scheduler.kv.num_blocks
        assert runner(llm).kv_caches[0].shape[1] == blocks[kv_dtype]
        assert runner(llm).kv_caches[0].element_size() == (2 if kv_dtype == "bfloat16" else 1)
        del llm
    two_bytes = blocks["bfloat16"]
    assert two_bytes == KV_BYTES // runner(fp32_llm).kv_cache_bytes_per_block() * 2    # fp32 cache on the CPU
    assert blocks == {"bfloat16": two_bytes, "fp8": 2 * two_bytes, "fp8_e4m3": 2 * two_bytes,
                      "fp8_e5m2": 2 * two_bytes}


def test_calculate_kv_scales_with_fp8_is_refused(scaled_dir):
    with pytest.raises(ValueError, match="calculate_kv_scales"):
        make(scaled_dir, "fp8", calculate_kv_scales=True)

