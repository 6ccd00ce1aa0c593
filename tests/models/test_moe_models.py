"""Mixture-of-experts families against HF transformers (tiny random fp32 configs, CPU): Qwen3-MoE (a dense layer
among sparse ones, renormalised top-k), Qwen2-MoE (shared expert with its gate, q/k/v biases, plain top-k),
Mixtral (fp32 routing weights, per-expert w1 / w3 / w2 names) and Qwen3.5-MoE (the Gated DeltaNet hybrid with a
shared expert in every layer; the causal LM and the text path of the multimodal checkpoint).

The oracle is teacher forcing: HF's forward over prompt + tokenmill's greedy output must pick each of those tokens
with tokenmill's logprob within 1e-4. Then chunked prefill, prefix-cache hits, preemption, batch-of-one runs,
tensor parallelism over two gloo ranks and HF's fused expert tensors must all give the very same tokens."""
from __future__ import annotations

import os

import pytest
import torch

from tests.models.oracle import NEVER_STOP, assert_greedy_matches_hf, tokens
from tokenmill import LLM, SamplingParams

PROMPTS = [
    "The quick brown fox jumps over the lazy dog because it wanted to see what was on the other side of the",
    "Hello, my name is John and I live in a small town by the sea, where",
    "深度学习的优势是什么？请详细说明。",
    "x " * 30,
]
MAX_TOKENS = 10
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=1)
MAY_STOP = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=1, stop=[NEVER_STOP])

TINY = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
            initializer_range=0.3, rms_norm_eps=1e-5)


def _config(arch: str, vocab: int, bos: int, eos: int):
    import transformers as tf
    common = dict(TINY, vocab_size=vocab, bos_token_id=bos, eos_token_id=eos)
    if arch == "qwen3_moe":  # layer 1 dense (mlp_only_layers), layers 0 and 2 sparse
        return tf.Qwen3MoeConfig(**common, head_dim=16, num_hidden_layers=3, intermediate_size=96,
                                 moe_intermediate_size=32, num_experts=8, num_experts_per_tok=3,
                                 norm_topk_prob=True, mlp_only_layers=[1])
    if arch == "qwen2_moe":
        return tf.Qwen2MoeConfig(**common, num_hidden_layers=2, intermediate_size=96, moe_intermediate_size=32,
                                 shared_expert_intermediate_size=48, num_experts=6, num_experts_per_tok=2,
                                 norm_topk_prob=False)
    if arch == "qwen3_5_moe_mm":  # the multimodal checkpoint (vision tower skipped), its text path served
        text = _config("qwen3_5_moe", vocab, bos, eos)
        vision = tf.Qwen3_5MoeVisionConfig(depth=1, hidden_size=32, intermediate_size=64, num_heads=2,
                                           out_hidden_size=64, patch_size=4, temporal_patch_size=1,
                                           num_position_embeddings=16)
        return tf.Qwen3_5MoeConfig(text_config=text.to_dict(), vision_config=vision.to_dict())
    if arch == "qwen3_5_moe":  # the hybrid: Gated DeltaNet and gated full attention, every MLP sparse
        return tf.Qwen3_5MoeTextConfig(
            **common, num_hidden_layers=2, layer_types=["linear_attention", "full_attention"], head_dim=32,
            linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=8,
            linear_conv_kernel_dim=4, moe_intermediate_size=32, shared_expert_intermediate_size=40, num_experts=8,
            num_experts_per_tok=2, pad_token_id=eos, tie_word_embeddings=False,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25})
    return tf.MixtralConfig(**common, num_hidden_layers=2, intermediate_size=48, num_local_experts=4,
                            num_experts_per_tok=2)


@pytest.fixture(scope="module")
def make_model(tmp_path_factory, smollm2_tokenizer):
    import transformers as tf
    built = {}

    def make(arch: str):
        if arch in built:
            return built[arch]
        tok = smollm2_tokenizer
        cfg = _config(arch, len(tok), tok.bos_token_id or 0, tok.eos_token_id)
        torch.manual_seed(1234)
        if arch.startswith("qwen3_5_moe"):
            cls = tf.Qwen3_5MoeForCausalLM if arch == "qwen3_5_moe" else tf.Qwen3_5MoeForConditionalGeneration
            hf = cls(cfg).to(torch.float32)
        else:
            hf = tf.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation="eager")
        with torch.no_grad():  # spread the router's logits so routing differs from token to token
            for name, p in hf.named_parameters():
                if "norm" in name:  # around 1, as Qwen3.5's (1 + w) norms are with w near 0; a wider spread
                    # there amplifies fp32 noise past 1e-4 wherever a router's top-k is a near-tie
                    p.normal_(0.0, 0.1) if arch.startswith("qwen3_5_moe") else p.normal_(1.0, 0.2)
                elif name.endswith("gate.weight"):
                    p.normal_(0.0, 0.5)
        d = str(tmp_path_factory.mktemp(f"moe-{arch}"))
        hf.save_pretrained(d, safe_serialization=True)
        tok.save_pretrained(d)
        built[arch] = (d, hf.eval())
        return built[arch]

    return make


def llm_for(d, **kw):
    kw = dict(dict(max_model_len=128, block_size=4, num_gpu_blocks_override=256, enable_prefix_caching=False), **kw)
    return LLM(d, **kw)


ARCHS = ["qwen3_moe", "qwen2_moe", "mixtral", "qwen3_5_moe", "qwen3_5_moe_mm"]


@pytest.fixture(scope="module", params=ARCHS)
def reference(request, make_model):
    d, hf = make_model(request.param)
    outs = llm_for(d).generate(PROMPTS, GREEDY, use_tqdm=False)
    return request.param, d, hf, outs


def test_checkpoint_stores_experts_one_by_one(reference):
    """The saved checkpoint has per-expert tensors (what published MoE checkpoints hold), so the test above loads
    that form; the fused form is loaded below."""
    from safetensors import safe_open
    arch, d, _, _ = reference
    with safe_open(os.path.join(d, "model.safetensors"), "pt") as f:
        names = list(f.keys())
    assert any(".experts.0." in n for n in names), names[:10]


def test_teacher_forced_logprobs_match_hf(reference):
    arch, _, hf, outs = reference
    assert_greedy_matches_hf(hf, outs)


def test_routing_varies_across_tokens(reference):
    """The router sends different tokens to different experts (otherwise the experts' indexing is untested)."""
    arch, _, hf, outs = reference
    ids = torch.tensor([outs[0].prompt_token_ids])
    seen = set()

    def hook(module, args, out):
        seen.update(out[2].flatten().tolist())

    layer = getattr(hf.model, "language_model", hf.model).layers[0].mlp
    handle = layer.gate.register_forward_hook(hook)
    try:
        with torch.no_grad():
            hf(input_ids=ids)
    finally:
        handle.remove()
    assert len(seen) >= 3, (arch, seen)


def test_chunked_prefill_prefix_hits_and_preemption_give_the_same_tokens(reference):
    arch, d, _, outs = reference
    llm = llm_for(d, max_num_batched_tokens=8, enable_prefix_caching=True, num_gpu_blocks_override=20,
                  max_num_seqs=4, max_model_len=64)
    assert tokens(llm.generate(PROMPTS, MAY_STOP, use_tqdm=False)) == tokens(outs)
    assert llm.llm_engine.last_stats.num_preemptions > 0
    assert tokens(llm.generate(PROMPTS, MAY_STOP, use_tqdm=False)) == tokens(outs)
    one = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    first = llm.generate(PROMPTS[0], one, use_tqdm=False)[0]
    second = llm.generate(PROMPTS[0], one, use_tqdm=False)[0]
    assert second.num_cached_tokens > 0
    assert second.outputs[0].token_ids == first.outputs[0].token_ids == tokens(outs)[0][:3]


def test_batch_of_one_gives_the_same_tokens(reference):
    arch, d, _, outs = reference
    if arch != "qwen2_moe":
        pytest.skip("one family is enough here")
    llm = llm_for(d, max_num_seqs=1)
    assert tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == tokens(outs)


def test_tensor_parallel_two_ranks_gives_the_same_tokens(reference):
    """Two gloo ranks, each with every expert's half of the intermediate features (and half the heads)."""
    arch, d, _, outs = reference
    if arch not in ("qwen2_moe", "qwen3_5_moe"):
        pytest.skip("the families with a shared expert are enough here")
    from tests.distributed.engine_outputs import shutdown
    llm = llm_for(d, tensor_parallel_size=2, max_num_seqs=8)
    try:
        assert tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == tokens(outs)
    finally:
        shutdown(llm)


def _rewrite(d: str, out_dir: str, rename) -> None:
    """A copy of the checkpoint in `d` whose tensors went through rename(dict) -> dict."""
    import shutil
    from safetensors.torch import load_file, save_file
    shutil.copytree(d, out_dir)
    sd = load_file(os.path.join(d, "model.safetensors"))
    save_file(rename(sd), os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})


def _fused(sd: dict) -> dict:
    """HF's in-memory form: experts.gate_up_proj [E, 2I, H] and experts.down_proj [E, H, I] per layer."""
    out, experts = {}, {}
    for name, t in sd.items():
        parts = name.split(".experts.")
        if len(parts) == 2 and parts[1].split(".")[0].isdigit():
            e, proj = parts[1].split(".")[:2]
            experts.setdefault(parts[0], {})[(int(e), proj)] = t
        else:
            out[name] = t
    for prefix, d in experts.items():
        n = 1 + max(e for e, _ in d)
        out[f"{prefix}.experts.gate_up_proj"] = torch.stack(
            [torch.cat([d[(e, "gate_proj")], d[(e, "up_proj")]]) for e in range(n)]).contiguous()
        out[f"{prefix}.experts.down_proj"] = torch.stack([d[(e, "down_proj")] for e in range(n)]).contiguous()
    return out


def test_fused_expert_tensors_load(reference, tmp_path):
    arch, d, _, outs = reference
    if arch != "qwen3_moe":
        pytest.skip("one family is enough here")
    fused = str(tmp_path / "fused")
    _rewrite(d, fused, _fused)
    llm = llm_for(fused)
    assert tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == tokens(outs)


def test_a_missing_expert_is_named(reference, tmp_path):
    arch, d, _, _ = reference
    if arch != "qwen3_moe":
        pytest.skip("one family is enough here")
    gone = "model.layers.2.mlp.experts.5.up_proj.weight"
    broken = str(tmp_path / "broken")
    _rewrite(d, broken, lambda sd: {k: v for k, v in sd.items() if k != gone})
    with pytest.raises(ValueError, match=r"experts\.5\.up_proj"):
        llm_for(broken)


def test_quantized_experts_are_refused(make_model, tmp_path):
    """A quantization the experts cannot take is refused at start-up, naming it."""
    d, _ = make_model("mixtral")
    with pytest.raises(ValueError, match="MoE experts with quantization 'fp8'"):
        llm_for(d, quantization="fp8")



def test_lora_on_attention_matches_peft_and_shared_expert_targets_are_refused(reference, tmp_path):
    """An adapter on the attention projections of a MoE model gives peft's greedy tokens and logprobs; one that
    targets the shared expert's (or the experts') projections is refused naming the module."""
    import copy

    import peft
    from tests.models.oracle import hf_logprobs
    from tokenmill.lora.peft import LoRAAdapterError
    from tokenmill.lora.request import LoRARequest
    arch, d, hf, _ = reference
    if arch not in ("qwen3_moe", "qwen2_moe"):
        pytest.skip("two families are enough here")
    targets = ["q_proj", "v_proj", "o_proj"] + (["down_proj"] if arch == "qwen2_moe" else [])
    torch.manual_seed(7)
    pm = peft.get_peft_model(copy.deepcopy(hf), peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets,
                                                                init_lora_weights=False))
    ad = str(tmp_path / "adapter")
    pm.save_pretrained(ad)
    llm = llm_for(d, enable_lora=True, max_lora_rank=8)
    lora = LoRARequest("a", 1, ad)
    if arch == "qwen2_moe":
        # peft versions differ on whether "down_proj" also adapts the fused experts: either module is named
        with pytest.raises(LoRAAdapterError, match=r"mlp\.(shared_expert|experts)"):
            llm.generate(PROMPTS[:1], GREEDY, lora_request=lora, use_tqdm=False)
        return
    outs = llm.generate(PROMPTS[:2], GREEDY, lora_request=lora, use_tqdm=False)
    for out in outs:
        c = out.outputs[0]
        ref = hf_logprobs(pm.eval(), out.prompt_token_ids + c.token_ids)
        n = len(out.prompt_token_ids)
        for i, (tid, lp) in enumerate(zip(c.token_ids, c.logprobs)):
            assert tid == int(ref[n - 1 + i].argmax()), i
            assert abs(lp[tid].logprob - ref[n - 1 + i][tid].item()) < 1e-4, i
