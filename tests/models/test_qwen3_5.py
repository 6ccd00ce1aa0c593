"""Qwen3.5 (hybrid Gated DeltaNet + gated full attention) against HF transformers: tiny random fp32 configs on the
CPU, the text-only causal LM and the text path of Qwen3_5ForConditionalGeneration (vision tower and MTP tensors
in the checkpoint, skipped).

Teacher forcing: HF's forward over prompt + tokenmill's greedy output must pick each of those tokens with
tokenmill's logprob within 1e-4. Then prompts split over prefill chunks (the recurrent state carried across
steps, mixed prefill + decode batches), preemption under a tiny KV pool (the state slot freed and rebuilt), and
one request at a time must give the very same tokens."""
from __future__ import annotations

import pytest
import torch

from tests.models.oracle import NEVER_STOP, assert_greedy_matches_hf, hf_logprobs, tokens
from tokenmill import LLM, SamplingParams

PROMPTS = [
    "The quick brown fox jumps over the lazy dog because it wanted to see what was on the other side of the",
    "Hello, my name is John and I live in a small town by the sea, where",
    "深度学习的优势是什么？请详细说明。",
    "one two three four five six seven eight nine ten " * 9,   # > 64 tokens: several delta-rule chunks
    "Hi",
]
MAX_TOKENS = 10
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=1)
MAY_STOP = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=1, stop=[NEVER_STOP])
TYPES = ["linear_attention", "full_attention", "linear_attention", "full_attention"]


# LongRoPE on the gated attention's rotary quarter (8 dims: 4 factors), pretraining length 64.
LONGROPE = {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
            "short_factor": [1.0, 1.1, 1.2, 1.3], "long_factor": [1.5, 1.7, 1.9, 2.1],
            "original_max_position_embeddings": 64}


def _text_config(vocab: int, bos: int, eos: int, rope_parameters: dict | None = None):
    import transformers as tf
    return tf.Qwen3_5TextConfig(
        vocab_size=vocab, hidden_size=64, intermediate_size=96, num_hidden_layers=4, layer_types=TYPES,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, linear_num_key_heads=2,
        linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=8, linear_conv_kernel_dim=4,
        max_position_embeddings=512, rms_norm_eps=1e-6, initializer_range=0.2, bos_token_id=bos, eos_token_id=eos,
        pad_token_id=eos, tie_word_embeddings=False,
        rope_parameters=rope_parameters or {"rope_type": "default", "rope_theta": 10000.0,
                                            "partial_rotary_factor": 0.25, "mrope_section": [2, 1, 1],
                                            "mrope_interleaved": True})


@pytest.fixture(scope="module")
def make_model(tmp_path_factory, smollm2_tokenizer):
    import transformers as tf
    from safetensors.torch import load_file, save_file
    built = {}

    def make(arch: str):
        if arch in built:
            return built[arch]
        tok = smollm2_tokenizer
        text = _text_config(len(tok), tok.bos_token_id or 0, tok.eos_token_id,
                            LONGROPE if arch == "causal_longrope" else None)
        torch.manual_seed(1234)
        if arch.startswith("causal"):
            hf = tf.Qwen3_5ForCausalLM(text)
        else:
            vision = tf.Qwen3_5VisionConfig(depth=1, hidden_size=32, intermediate_size=64, num_heads=2,
                                            out_hidden_size=64, patch_size=4, temporal_patch_size=1,
                                            num_position_embeddings=16)
            cfg = tf.Qwen3_5Config(text_config=text.to_dict(), vision_config=vision.to_dict())
            hf = tf.Qwen3_5ForConditionalGeneration(cfg)
        hf = hf.to(torch.float32).eval()
        with torch.no_grad():  # (1 + w) norms start at 0: randomise every norm so the form matters
            for name, p in hf.named_parameters():
                if "norm" in name:
                    p.normal_(0.0, 0.3)
        d = str(tmp_path_factory.mktemp(f"qwen3_5-{arch}"))
        hf.save_pretrained(d, safe_serialization=True)
        tok.save_pretrained(d)
        if arch == "conditional":  # real checkpoints also carry the MTP head: it must be skipped
            import glob
            path = sorted(glob.glob(f"{d}/*.safetensors"))[0]
            tensors = load_file(path)
            tensors["mtp.fc.weight"] = torch.randn(64, 128)
            tensors["mtp.layers.0.mlp.up_proj.weight"] = torch.randn(96, 64)
            save_file(tensors, path, metadata={"format": "pt"})
        built[arch] = (d, hf)
        return built[arch]

    return make


def llm_for(d, **kw):
    return LLM(d, **dict(dict(max_model_len=192, block_size=4, num_gpu_blocks_override=512), **kw))


@pytest.fixture(scope="module", params=["causal", "conditional"])
def reference(request, make_model):
    d, hf = make_model(request.param)
    llm = llm_for(d, enable_prefix_caching=False)
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    return request.param, d, hf, outs, llm


def test_teacher_forced_logprobs_match_hf(reference):
    arch, _, hf, outs, llm = reference
    for out in outs:
        c = out.outputs[0]
        ref = hf_logprobs(hf, out.prompt_token_ids + c.token_ids)
        n = len(out.prompt_token_ids)
        for i, (tid, lp) in enumerate(zip(c.token_ids, c.logprobs)):
            row = ref[n - 1 + i]
            assert tid == int(row.argmax()), f"{arch}: token {i} of {out.prompt!r}"
            assert abs(lp[tid].logprob - row[tid].item()) < 1e-4, f"{arch}: logprob {i} of {out.prompt!r}"


def test_chunked_prefill_and_preemption_give_the_same_tokens(reference):
    arch, d, _, outs, _ = reference
    want = tokens(outs)
    # 16-token steps split the long prompts; 32 blocks of 4 tokens hold too little for all five at once.
    llm = llm_for(d, max_num_batched_tokens=16, num_gpu_blocks_override=32, max_num_seqs=5, max_model_len=128)
    assert tokens(llm.generate(PROMPTS, MAY_STOP, use_tqdm=False)) == want
    assert llm.llm_engine.last_stats.num_preemptions > 0
    sched = llm.llm_engine.engine_core.scheduler
    assert not sched.has_unfinished_requests() and sched.kv.num_free_blocks() == sched.kv.num_blocks


def test_batch_of_one_gives_the_same_tokens(reference):
    arch, d, _, outs, _ = reference
    if arch != "causal":
        pytest.skip("one class is enough here")
    llm = llm_for(d, max_num_seqs=1)
    assert tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == tokens(outs)


def test_flags_the_hybrid_cannot_honour_are_refused(make_model):
    d, _ = make_model("causal")
    with pytest.raises(ValueError, match="kv_cache_dtype=fp8.*linear_attention"):
        llm_for(d, kv_cache_dtype="fp8")


@pytest.mark.timeout(240)
def test_tensor_parallel_splits_the_deltanet_heads(reference):
    """TP=2 on the CPU (gloo): each rank holds half the key / value heads of every Gated DeltaNet layer (its conv
    channels and state too) and half the attention heads; the greedy tokens are TP=1's."""
    arch, d, _, outs, _ = reference
    if arch != "causal":
        pytest.skip("one class is enough here")
    from tests.distributed.engine_outputs import shutdown
    llm = llm_for(d, tensor_parallel_size=2, max_num_seqs=8)
    try:
        assert tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == tokens(outs)
    finally:
        shutdown(llm)


def test_prefix_cache_hits_resume_from_state_checkpoints(reference):
    """Prefix caching on the hybrid: a hit ends where a recurrent-state checkpoint was saved (every 32nd block
    boundary of a prompt and its last full block) and gives the tokens a miss gives, with prompts split over
    16-token steps (checkpoints saved inside chunks) and repeated, and prompts that share a long prefix only."""
    arch, d, _, outs, _ = reference
    if arch != "causal":
        pytest.skip("one class is enough here")
    llm = llm_for(d, enable_prefix_caching=True, max_num_batched_tokens=16, max_model_len=512)
    sched = llm.llm_engine.engine_core.scheduler
    assert sched.state_ckpts is not None
    first = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert tokens(first) == tokens(outs)
    again = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert tokens(again) == tokens(outs)
    long_prompt = 3   # ~90 tokens: its hit ends at its last full block
    assert again[long_prompt].num_cached_tokens >= len(again[long_prompt].prompt_token_ids) - 2 * 4
    # A shared prefix of > 32 blocks (128 tokens): the second prompt skips to the 32-block checkpoint.
    shared = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu " * 14
    pair = [shared + "The end of the first story is", shared + "Nobody remembers what happened when"]
    miss = llm_for(d, enable_prefix_caching=False, max_model_len=512).generate(pair, GREEDY, use_tqdm=False)
    a = llm.generate(pair[:1], GREEDY, use_tqdm=False)
    b = llm.generate(pair[1:], GREEDY, use_tqdm=False)
    assert tokens(a + b) == tokens(miss)
    assert b[0].num_cached_tokens == 128


def test_longrope_prompts_past_the_pretraining_length_use_the_long_factors(make_model):
    """LongRoPE on Qwen3.5: HF uses the long factors for a prompt longer than the pretraining length (64), the
    short ones within it; tokenmill kept the short ones for every prompt."""
    d, hf = make_model("causal_longrope")
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 40000, (n,), generator=gen).tolist() for n in (20, 90)]
    outs = llm_for(d).generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    assert_greedy_matches_hf(hf, outs)
