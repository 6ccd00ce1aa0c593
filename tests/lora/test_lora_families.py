"""Multi-LoRA beyond the tiny Llama, against HF transformers + peft (fp32, CPU): the decoder families users deploy
with adapters (Qwen2 with q/k/v biases, Qwen3's q/k norms, Phi-3's fused qkv_proj / gate_up_proj modules, Gemma 2's
soft-capping and sliding window) and Qwen3.5, whose Gated DeltaNet layers have projections of their own
(in_proj_qkv, in_proj_z, in_proj_b / in_proj_a stacked into in_proj_ba, out_proj) and whose multimodal checkpoint
names the decoder `model.language_model.`."""
from __future__ import annotations

import json
import os

import pytest
import torch

from tokenmill import LLM, SamplingParams
from tokenmill.lora.peft import LoRAAdapterError, read_adapter
from tokenmill.lora.request import LoRARequest

N = 6
PROMPTS = ["Hello, my name is", "The quick brown fox jumps over the lazy dog because it",
           # Two full KV blocks and more: with prefix caching the second pass hits them under each adapter.
           "In 1492, Columbus sailed across the Atlantic Ocean and reached the islands of the Caribbean, where he "
           "met the people who had lived there"]
ATTN_MLP = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
GDN = ["in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj"]
TARGETS = {"phi3": ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"], "qwen3_5": ATTN_MLP + GDN,
           # "qkv" is the vision tower's attention: skipped, since text requests never run it.
           "qwen3_5_mm": ["q_proj", "v_proj", "down_proj", "qkv"] + GDN,
           # The SigLIP tower has q/k/v projections too: peft adapts them as well, tokenmill skips them.
           "gemma3_mm": ["q_proj", "k_proj", "v_proj", "o_proj", "down_proj"]}


def _config(arch: str, vocab: int, bos: int, eos: int):
    import transformers as tf
    if arch == "gemma2":
        return tf.Gemma2Config(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                               max_position_embeddings=512, initializer_range=0.3, rms_norm_eps=1e-5,
                               vocab_size=vocab, bos_token_id=bos, eos_token_id=eos, pad_token_id=eos, head_dim=16,
                               query_pre_attn_scalar=24, sliding_window=8, hidden_activation="gelu_pytorch_tanh",
                               num_hidden_layers=3, attn_logit_softcapping=4.0, final_logit_softcapping=3.0)
    if arch.startswith("qwen3_5"):
        text = tf.Qwen3_5TextConfig(
            vocab_size=vocab, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
            layer_types=["linear_attention", "full_attention"] * 2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
            linear_value_head_dim=8, linear_conv_kernel_dim=4, max_position_embeddings=512, initializer_range=0.2,
            bos_token_id=bos, eos_token_id=eos, pad_token_id=eos, tie_word_embeddings=False,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25})
        if arch == "qwen3_5":
            return text
        vision = tf.Qwen3_5VisionConfig(depth=1, hidden_size=32, intermediate_size=64, num_heads=2,
                                        out_hidden_size=64, patch_size=4, temporal_patch_size=1,
                                        num_position_embeddings=16)
        return tf.Qwen3_5Config(text_config=text.to_dict(), vision_config=vision.to_dict())
    if arch == "gemma3_mm":
        text = tf.Gemma3TextConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                                   max_position_embeddings=512, initializer_range=0.3, rms_norm_eps=1e-5,
                                   vocab_size=vocab, bos_token_id=bos, eos_token_id=eos, pad_token_id=eos,
                                   head_dim=16, query_pre_attn_scalar=24, sliding_window=8,
                                   hidden_activation="gelu_pytorch_tanh", num_hidden_layers=3,
                                   sliding_window_pattern=2)
        vision = tf.SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                       num_attention_heads=2, image_size=32, patch_size=8)
        return tf.Gemma3Config(text_config=text.to_dict(), vision_config=vision.to_dict(), mm_tokens_per_image=4,
                               image_token_index=vocab - 1, boi_token_index=vocab - 2, eoi_token_index=vocab - 3)
    raise ValueError(arch)


def _hf_class(arch: str):
    import transformers as tf
    return {"qwen3_5_mm": tf.Qwen3_5ForConditionalGeneration,
            "gemma3_mm": tf.Gemma3ForConditionalGeneration}.get(arch, tf.AutoModelForCausalLM)


@pytest.fixture(scope="module")
def family(tmp_path_factory, smollm2_tokenizer, tiny_model_factory):
    """arch -> (base model dir, adapter dir): random fp32 weights (the shared tiny models of the Llama-like
    families), a random peft adapter (lora_B too)."""
    import peft
    import transformers as tf
    built = {}

    def make(arch: str):
        if arch in built:
            return built[arch]
        tok, root = smollm2_tokenizer, tmp_path_factory.mktemp(f"lora-{arch}")
        if arch in ("qwen2", "qwen3", "phi3"):
            base = tiny_model_factory(arch)
        else:
            cfg = _config(arch, len(tok), tok.bos_token_id or 0, tok.eos_token_id)
            torch.manual_seed(1234)
            model = (_hf_class(arch)(cfg) if arch.endswith("_mm")
                     else tf.AutoModelForCausalLM.from_config(cfg)).to(torch.float32)
            with torch.no_grad():  # (1 + w) norms start at 0: random ones make their form matter
                for name, p in model.named_parameters():
                    if "norm" in name:
                        p.normal_(0.0, 0.3)
            base = str(root / "base")
            model.save_pretrained(base, safe_serialization=True)
            tok.save_pretrained(base)
        torch.manual_seed(7)
        lora = peft.get_peft_model(_hf_class(arch).from_pretrained(base, dtype=torch.float32),
                                   peft.LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0,
                                                   target_modules=TARGETS.get(arch, ATTN_MLP)))
        with torch.no_grad():
            for name, p in lora.named_parameters():
                if "lora_" in name:
                    p.normal_(0.0, 0.3)
        adapter = str(root / "adapter")
        lora.save_pretrained(adapter)
        built[arch] = (base, adapter)
        return built[arch]
    return make


def _peft_greedy(arch: str, base: str, adapter: str | None, prompts: list[list[int]]) -> list[list[int]]:
    import peft
    hf = _hf_class(arch).from_pretrained(base, dtype=torch.float32).eval()
    model = peft.PeftModel.from_pretrained(hf, adapter).eval() if adapter else hf
    out = []
    for ids in prompts:
        x = torch.tensor([ids])
        with torch.no_grad():
            y = model.generate(input_ids=x, attention_mask=torch.ones_like(x), max_new_tokens=N, do_sample=False,
                               pad_token_id=0, eos_token_id=None)
        out.append(y[0, len(ids):].tolist())
    return out


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "phi3", "gemma2", "gemma3_mm", "qwen3_5", "qwen3_5_mm"])
def test_each_request_gets_its_own_adapters_tokens(arch, family):
    base, adapter = family(arch)
    llm = LLM(base, max_model_len=256, num_gpu_blocks_override=96, max_num_seqs=8, enable_lora=True, max_loras=1,
              max_lora_rank=8, enable_prefix_caching=True)
    lora = LoRARequest("ad", 1, adapter)
    sp = SamplingParams(temperature=0, max_tokens=N, ignore_eos=True)
    reqs = [lora, None] * len(PROMPTS)  # the base model and the adapter in one batch, on the same prompts
    prompts = [p for p in PROMPTS for _ in range(2)]
    outs = llm.generate(prompts, sp, use_tqdm=False, lora_request=reqs)
    ids = [o.prompt_token_ids for o in outs[::2]]
    want_lora, want_base = _peft_greedy(arch, base, adapter, ids), _peft_greedy(arch, base, None, ids)
    assert [o.outputs[0].token_ids for o in outs[::2]] == want_lora
    assert [o.outputs[0].token_ids for o in outs[1::2]] == want_base
    assert want_lora != want_base  # the adapter changes the output: the test can fail
    # Again, with the prompts' blocks (and on Qwen3.5 the saved recurrent states) cached under each adapter.
    again = llm.generate(prompts, sp, use_tqdm=False, lora_request=reqs)
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in outs]


def test_hybrid_adapter_modules_must_match_the_layer_kind(family, tmp_path):
    import transformers as tf
    from safetensors.torch import load_file, save_file

    from tokenmill.models.qwen3_5 import Qwen3_5ForCausalLM
    base, adapter = family("qwen3_5")
    cfg = tf.AutoConfig.from_pretrained(base)
    kw = dict(max_rank=8, text_config=cfg, served_names=[base], mapping=Qwen3_5ForCausalLM.weight_mapping)
    ad = read_adapter("ad", 1, adapter, **kw)
    # q/k/v/o only on the full-attention layers (1, 3), the DeltaNet projections only on the others
    assert {m.split(".")[2] for m in ad.weights if ".self_attn." in m} == {"1", "3"}
    assert {m.split(".")[2] for m in ad.weights if ".linear_attn." in m} == {"0", "2"}
    assert ad.weights["model.layers.1.self_attn.q_proj"][1].shape == (2 * 4 * 32, 8)  # query and gate per head
    # An adapter whose layer-0 in_proj_z moved to layer 1 (a full-attention layer) is refused by name.
    moved = tmp_path / "moved"
    moved.mkdir()
    cfg_json = json.load(open(os.path.join(adapter, "adapter_config.json")))
    cfg_json["base_model_name_or_path"] = base
    json.dump(cfg_json, open(moved / "adapter_config.json", "w"))
    tensors = {k.replace("layers.0.linear_attn.in_proj_z", "layers.1.linear_attn.in_proj_z"): v
               for k, v in load_file(os.path.join(adapter, "adapter_model.safetensors")).items()}
    save_file(tensors, str(moved / "adapter_model.safetensors"))
    with pytest.raises(LoRAAdapterError, match=r"'model\.layers\.1\.linear_attn\.in_proj_z', which the model does "
                                               r"not have"):
        read_adapter("moved", 2, str(moved), **kw)


def test_target_modules_restrict_the_deltanet_projections(family):
    from tokenmill.config.lora import LoRAConfig
    c = LoRAConfig(enable_lora=True, lora_target_modules=["in_proj_b", "out_proj"])
    assert c.targets("in_proj_b") and c.targets("out_proj")  # in_proj_b alone of the stacked in_proj_ba
    assert not c.targets("in_proj_a") and not c.targets("in_proj_qkv") and not c.targets("q_proj")
    assert LoRAConfig(enable_lora=True, lora_target_modules=["in_proj_ba"]).targets("in_proj_a")
    base, adapter = family("qwen3_5")
    llm = LLM(base, max_model_len=128, num_gpu_blocks_override=32, enable_lora=True, max_lora_rank=8,
              lora_target_modules=["in_proj_qkv"])
    manager = llm.llm_engine.engine_core.executor.worker.runner.lora
    assert sorted(p.rsplit(".", 1)[1] for p in manager.layers) == ["in_proj_qkv", "in_proj_qkv"]


@pytest.mark.timeout(180)
def test_hybrid_adapters_under_tensor_parallelism(family):
    """2 ranks (gloo): in_proj_qkv's B rows split per q / k / v slice, in_proj_b / in_proj_a per head, out_proj's A
    columns per input slice, like the layers themselves."""
    base, adapter = family("qwen3_5")
    llm = LLM(base, tensor_parallel_size=2, max_model_len=256, num_gpu_blocks_override=64, max_num_seqs=4,
              enable_lora=True, max_loras=1, max_lora_rank=8)
    try:
        reqs = [LoRARequest("ad", 1, adapter), None]
        outs = llm.generate([PROMPTS[1]] * 2, SamplingParams(temperature=0, max_tokens=N, ignore_eos=True),
                            use_tqdm=False, lora_request=reqs)
        ids = [outs[0].prompt_token_ids]
        assert outs[0].outputs[0].token_ids == _peft_greedy("qwen3_5", base, adapter, ids)[0]
        assert outs[1].outputs[0].token_ids == _peft_greedy("qwen3_5", base, None, ids)[0]
    finally:
        llm.llm_engine.engine_core.executor.shutdown()
