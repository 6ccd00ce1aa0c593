"""Sliding-window families against HF transformers (tiny random fp32 configs, CPU): Mistral and Qwen2 with
`sliding_window`, Gemma 2, Gemma 3 text and the text path of Gemma3ForConditionalGeneration.

Prompts are several windows long. The oracle is teacher forcing: HF's forward over prompt + tokenmill's greedy
output must pick each of those tokens (argmax) with tokenmill's logprob within 1e-4. Then chunked prefill that
splits prompts, prefix-cache hits, preemption under a tiny KV pool and batch-of-one runs must give the very same
tokens, and every block must come back."""
from __future__ import annotations

import pytest
import torch

from tests.models.oracle import NEVER_STOP, assert_greedy_matches_hf, hf_logprobs, tokens
from tokenmill import LLM, SamplingParams

WINDOW = 6
PROMPTS = [
    "The quick brown fox jumps over the lazy dog because it wanted to see what was on the other side of the",
    "Hello, my name is John and I live in a small town by the sea, where",
    "深度学习的优势是什么？请详细说明。",
    "x " * 30,
    "The quick brown fox jumps over the lazy dog because it wanted to eat",
]
MAX_TOKENS = 12
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=1)
MAY_STOP = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=1, stop=[NEVER_STOP])

TINY = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=512, initializer_range=0.3, rms_norm_eps=1e-5)


def _config(arch: str, vocab: int, bos: int, eos: int):
    import transformers as tf
    common = dict(TINY, vocab_size=vocab, bos_token_id=bos, eos_token_id=eos)
    if arch == "mistral":
        return tf.MistralConfig(**common, num_hidden_layers=2, sliding_window=WINDOW)
    if arch == "qwen2":  # layer 0 full attention, layer 1 windowed (HF: layers >= max_window_layers slide)
        return tf.Qwen2Config(**common, num_hidden_layers=2, use_sliding_window=True, sliding_window=WINDOW,
                              max_window_layers=1, tie_word_embeddings=True)
    gemma = dict(common, head_dim=16, query_pre_attn_scalar=24, sliding_window=WINDOW,
                 hidden_activation="gelu_pytorch_tanh", pad_token_id=eos)
    if arch == "gemma2":
        return tf.Gemma2Config(**gemma, num_hidden_layers=3, attn_logit_softcapping=4.0, final_logit_softcapping=3.0)
    if arch == "gemma2_longrope":  # LongRoPE, pretraining length 24 (8 factors for head_dim 16)
        return tf.Gemma2Config(**gemma, num_hidden_layers=2, rope_parameters={
            "rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 24,
            "short_factor": [1.0 + 0.1 * i for i in range(8)], "long_factor": [1.5 + 0.2 * i for i in range(8)]})
    text = tf.Gemma3TextConfig(**gemma, num_hidden_layers=3, sliding_window_pattern=2,
                               rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10.0},
                                                "full_attention": {"rope_type": "linear", "factor": 2.0,
                                                                   "rope_theta": 10000.0}})
    if arch == "gemma3":
        return text
    if arch == "gemma3_capped":  # HF's Gemma 3 reads attn_logit_softcapping but never applies it
        return tf.Gemma3TextConfig(**gemma, num_hidden_layers=2, sliding_window_pattern=2,
                                   attn_logit_softcapping=2.0, final_logit_softcapping=3.0)
    vision = tf.SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                   image_size=32, patch_size=8)
    return tf.Gemma3Config(text_config=text.to_dict(), vision_config=vision.to_dict(), mm_tokens_per_image=4,
                           image_token_index=vocab - 1, boi_token_index=vocab - 2, eoi_token_index=vocab - 3)


@pytest.fixture(scope="module")
def make_model(tmp_path_factory, smollm2_tokenizer):
    import transformers as tf
    built = {}

    def make(arch: str):
        if arch in built:
            return built[arch]
        tok = smollm2_tokenizer
        cfg = _config(arch, len(tok), tok.bos_token_id or 0, tok.eos_token_id)
        torch.manual_seed(4321)
        cls = tf.Gemma3ForConditionalGeneration if arch == "gemma3_mm" else tf.AutoModelForCausalLM
        hf = cls._from_config(cfg, dtype=torch.float32, attn_implementation="eager") if arch == "gemma3_mm" \
            else cls.from_config(cfg, dtype=torch.float32, attn_implementation="eager")
        with torch.no_grad():  # Gemma's norms start at 0 ((1 + w) = 1): randomise every norm so the form matters
            for name, p in hf.named_parameters():
                if "norm" in name:
                    p.normal_(0.0, 0.3)
        d = str(tmp_path_factory.mktemp(f"sw-{arch}"))
        hf.save_pretrained(d, safe_serialization=True)
        tok.save_pretrained(d)
        built[arch] = (d, hf.eval())
        return built[arch]

    return make


def llm_for(d, **kw):
    kw = dict(dict(max_model_len=128, block_size=4, num_gpu_blocks_override=256, enable_prefix_caching=False), **kw)
    return LLM(d, **kw)


def assert_all_blocks_free(llm):
    sched = llm.llm_engine.engine_core.scheduler
    assert not sched.has_unfinished_requests()
    assert sched.kv.num_free_blocks() == sched.kv.num_blocks


ARCHS = ["mistral", "qwen2", "gemma2", "gemma3", "gemma3_mm"]


@pytest.fixture(scope="module", params=ARCHS)
def reference(request, make_model):
    d, hf = make_model(request.param)
    llm = llm_for(d)
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    return request.param, d, hf, outs


def test_teacher_forced_logprobs_match_hf(reference):
    arch, _, hf, outs = reference
    for out in outs:
        c = out.outputs[0]
        assert len(out.prompt_token_ids) > 2 * WINDOW or "深" in out.prompt
        ref = hf_logprobs(hf, out.prompt_token_ids + c.token_ids)
        n = len(out.prompt_token_ids)
        for i, (tid, lp) in enumerate(zip(c.token_ids, c.logprobs)):
            row = ref[n - 1 + i]
            assert tid == int(row.argmax()), f"{arch}: token {i} of {out.prompt!r}"
            assert abs(lp[tid].logprob - row[tid].item()) < 1e-4, f"{arch}: logprob {i} of {out.prompt!r}"


def test_the_window_matters(reference, make_model):
    """The same weights with full attention disagree with HF somewhere (so the test above checks the window)."""
    arch, _, hf, outs = reference
    if arch != "mistral":
        pytest.skip("one family is enough to show the window is exercised")
    import copy
    full = copy.deepcopy(hf)
    full.config.sliding_window = None
    for layer in full.model.layers:
        layer.self_attn.sliding_window = None
    diffs = 0
    for out in outs:
        ids = out.prompt_token_ids + out.outputs[0].token_ids
        diffs += int((hf_logprobs(full, ids) - hf_logprobs(hf, ids)).abs().max() > 1e-3)
    assert diffs == len(outs)


def test_chunked_prefill_prefix_hits_and_preemption_give_the_same_tokens(reference):
    """One engine that chunks every prompt (8-token steps), caches prefixes, and has too few blocks for all
    requests at once (so it preempts); two passes, the second hitting the prefix cache."""
    arch, d, _, outs = reference
    want = tokens(outs)
    # Mistral's layers all slide, so its requests hold a few blocks each (the ones below the window are freed).
    tight = 10 if arch == "mistral" else 20
    llm = llm_for(d, max_num_batched_tokens=8, enable_prefix_caching=True, num_gpu_blocks_override=tight,
                  max_num_seqs=5, max_model_len=64)
    assert tokens(llm.generate(PROMPTS, MAY_STOP, use_tqdm=False)) == want
    assert llm.llm_engine.last_stats.num_preemptions > 0
    assert tokens(llm.generate(PROMPTS, MAY_STOP, use_tqdm=False)) == want
    # A prompt run alone twice: the second run hits the cache (with a window, only the blocks inside the window
    # of the prompt's end must still be cached) and computes the same tokens.
    one = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    first = llm.generate(PROMPTS[0], one, use_tqdm=False)[0]
    second = llm.generate(PROMPTS[0], one, use_tqdm=False)[0]
    assert second.num_cached_tokens > 0
    assert second.outputs[0].token_ids == first.outputs[0].token_ids == want[0][:3]
    assert_all_blocks_free(llm)


def test_batch_of_one_gives_the_same_tokens(reference):
    arch, d, _, outs = reference
    if arch not in ("qwen2", "gemma3"):
        pytest.skip("the hybrid families are enough here")
    llm = llm_for(d, max_num_seqs=1)
    assert tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == tokens(outs)


def test_sliding_layers_hold_only_the_window(reference):
    """In a hybrid model the sliding-window layers' group frees the blocks below the window as the request
    advances (a few blocks at any time), while the full-attention group keeps the whole context."""
    from tokenmill.core.kv_cache_groups import HybridKVCacheManager
    from tokenmill.core.kv_cache_spec import SlidingWindowSpec
    arch, d, _, _ = reference
    if arch not in ("qwen2", "gemma3"):
        pytest.skip("the hybrid families")
    llm = llm_for(d, max_num_batched_tokens=8)
    eng = llm.llm_engine
    kv = eng.engine_core.scheduler.kv
    assert isinstance(kv, HybridKVCacheManager)
    eng.add_request("long", {"prompt_token_ids": list(range(100, 190))},
                    SamplingParams(max_tokens=20, ignore_eos=True, temperature=0))
    most = [0] * len(kv.groups)
    while eng.has_unfinished_requests():
        eng.step()
        for g, group in enumerate(kv.groups):
            most[g] = max(most[g], sum(group.num_held_blocks(r) for r in list(group.req_to_blocks)))
    for group, spec, n in zip(kv.groups, kv.specs, most):
        if isinstance(spec, SlidingWindowSpec):
            assert n <= spec.max_blocks_per_request(110, 8) < 110 // 4
        else:
            # The whole context: the last step (token 109's KV) finishes the request and frees its blocks before
            # the loop looks, so the most seen is the 108 tokens before it.
            assert n == -(-108 // 4)
    assert kv.num_free_blocks() == kv.num_blocks


def test_gemma3_ignores_attn_logit_softcapping_as_hf_does(make_model):
    """A Gemma 3 config that sets attn_logit_softcapping: HF's Gemma 3 attention never caps scores (only Gemma 2's
    does), so tokenmill must not either (it capped them, off from HF by up to 0.2 in logprob). Final-logit capping
    still applies."""
    d, hf = make_model("gemma3_capped")
    outs = llm_for(d).generate(PROMPTS[:2], GREEDY, use_tqdm=False)
    for out in outs:
        c = out.outputs[0]
        ref = hf_logprobs(hf, out.prompt_token_ids + c.token_ids)
        n = len(out.prompt_token_ids)
        for i, (tid, lp) in enumerate(zip(c.token_ids, c.logprobs)):
            assert tid == int(ref[n - 1 + i].argmax())
            assert abs(lp[tid].logprob - ref[n - 1 + i][tid].item()) < 1e-4


def test_gemma2_longrope_prompts_past_the_pretraining_length_use_the_long_factors(make_model):
    """HF uses LongRoPE's long factors for a prompt longer than the pretraining length (24 here), the short ones
    within it; Gemma 2 kept the short ones for every prompt."""
    d, hf = make_model("gemma2_longrope")
    outs = llm_for(d).generate(["Hello, my name is", PROMPTS[3]], GREEDY, use_tqdm=False)
    assert len(outs[0].prompt_token_ids) + MAX_TOKENS <= 24 < len(outs[1].prompt_token_ids)
    assert_greedy_matches_hf(hf, outs)


def test_gemma3_longrope_past_the_pretraining_length_is_refused():
    """Gemma 3's per-kind RoPE tables hold one set of factors: LongRoPE is refused past its pretraining length."""
    import transformers as tf

    from tokenmill.models.gemma3 import _rotary_of_kind
    cfg = tf.Gemma3TextConfig(hidden_size=64, num_attention_heads=4, head_dim=16, num_hidden_layers=2,
                              max_position_embeddings=256, rope_parameters={
                                  "sliding_attention": {"rope_type": "default", "rope_theta": 10.0},
                                  "full_attention": {"rope_type": "longrope", "rope_theta": 10000.0,
                                                     "original_max_position_embeddings": 64,
                                                     "short_factor": [1.0] * 8, "long_factor": [2.0] * 8}})
    with pytest.raises(ValueError, match="max_model_len <= 64"):
        _rotary_of_kind(cfg, "full_attention", 16, 128)
    assert _rotary_of_kind(cfg, "full_attention", 16, 64).long_prompt_len is None
