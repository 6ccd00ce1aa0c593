"""Quantized checkpoints end to end through LLM: detected from config.json, loaded, and greedy tokens compared with
HF transformers on the same checkpoint (compressed-tensors, which HF decompresses on the CPU) or with tokenmill on
the dequantized dense checkpoint (formats HF cannot run on the CPU); and the start-up errors for mismatches."""
from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from tokenmill import LLM, SamplingParams

FP8 = torch.float8_e4m3fn
PROMPTS = [[1, 17, 230, 4021, 99], [5, 6, 7], [3000, 12, 12, 800, 41, 9, 77]]
ENGINE = dict(max_model_len=128, num_gpu_blocks_override=32, max_num_seqs=4, enforce_eager=True)
LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def greedy(model_dir: str, **kw) -> list[list[int]]:
    llm = LLM(model_dir, **ENGINE, **kw)
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                            SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
        return [list(o.outputs[0].token_ids) for o in outs]
    finally:
        llm.llm_engine.engine_core.executor.shutdown()


def hf_greedy(model_dir: str) -> list[list[int]]:
    import transformers as tf
    hf = tf.AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    res = []
    with torch.no_grad():
        for p in PROMPTS:
            out = hf.generate(torch.tensor([p]), max_new_tokens=8, do_sample=False, min_new_tokens=8)
            res.append(out[0, len(p):].tolist())
    return res


def _rewrite(src: str, dst: str, tensors: dict, quantization_config: dict | None) -> str:
    shutil.copytree(src, dst)
    save_file(tensors, os.path.join(dst, "model.safetensors"))
    with open(os.path.join(dst, "config.json")) as f:
        cfg = json.load(f)
    cfg.pop("quantization_config", None)
    if quantization_config is not None:
        cfg["quantization_config"] = quantization_config
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(cfg, f)
    return dst


def ct_config(weights: str, activations: str) -> dict:
    """A compressed-tensors quantization_config for FP8 weights (strategy `weights`) with FP8 activations, static
    per tensor ("static") or dynamic per token ("dynamic"), every Linear but lm_head."""
    act = dict(num_bits=8, type="float", symmetric=True, strategy="tensor", dynamic=False) if activations == "static" \
        else dict(num_bits=8, type="float", symmetric=True, strategy="token", dynamic=True)
    return {"quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
            "ignore": ["lm_head"], "config_groups": {"group_0": {
                "targets": ["Linear"], "format": "float-quantized", "input_activations": act,
                "weights": dict(num_bits=8, type="float", symmetric=True, strategy=weights, dynamic=False)}}}


def _is_linear(name: str) -> bool:
    return name.endswith(".weight") and any(f".{m}." in name for m in LINEAR)


@pytest.fixture(scope="module")
def fp8_checkpoints(tiny_model_factory, tmp_path_factory):
    """(per-tensor static fp8 dir, its twin as a compressed-tensors checkpoint, block-wise fp8 dir, its dequantized
    dense twin)."""
    src = tiny_model_factory("llama")
    sd = load_file(os.path.join(src, "model.safetensors"))
    root = tmp_path_factory.mktemp("fp8")
    tensor, tensor_ct, block, block_dense = {}, {}, {}, {}
    for name, t in sd.items():
        if not _is_linear(name):
            for d in (tensor, tensor_ct, block, block_dense):
                d[name] = t
            continue
        s = t.abs().max() / 448
        q = (t / s).to(FP8)
        base = name[:-len("weight")]
        tensor.update({name: q, base + "weight_scale": s.reshape(()), base + "input_scale": torch.tensor([0.02])})
        tensor_ct.update({name: q, base + "weight_scale": s.reshape(1), base + "input_scale": torch.tensor([0.02])})
        bs = t.reshape(t.shape[0] // 32, 32, t.shape[1] // 32, 32).abs().amax(dim=(1, 3)) / 448
        full = bs.repeat_interleave(32, 0).repeat_interleave(32, 1)
        qb = (t / full).to(FP8)
        block.update({name: qb, base + "weight_scale_inv": bs})
        block_dense[name] = qb.float() * full
    return (_rewrite(src, str(root / "tensor"), tensor, {"quant_method": "fp8", "activation_scheme": "static"}),
            _rewrite(src, str(root / "tensor-ct"), tensor_ct, ct_config("tensor", "static")),
            _rewrite(src, str(root / "block"), block, {"quant_method": "fp8", "activation_scheme": "dynamic",
                                                        "weight_block_size": [32, 32]}),
            _rewrite(src, str(root / "block-dense"), block_dense, None))


def test_fp8_checkpoints_match_transformers_or_their_dequantized_weights(fp8_checkpoints, tm_log):
    """Per-tensor static: HF's compressed-tensors reference on the same tensors (HF runs `quant_method: fp8` only
    on CUDA). Block-wise: tokenmill on the dequantized weights."""
    pytest.importorskip("compressed_tensors")   # HF's reference loader for the compressed-tensors twin
    tensor, tensor_ct, block, block_dense = fp8_checkpoints
    assert greedy(tensor) == hf_greedy(tensor_ct)
    assert "float8_e4m3fn" in tm_log.text and "fp8" in tm_log.text   # the weight-memory line by dtype
    assert greedy(block) == greedy(block_dense)


def test_online_fp8_of_a_dense_checkpoint(tiny_model_factory, tmp_path):
    """--quantization fp8 on a dense checkpoint: weights rounded to e4m3 with one scale per output row, activations
    per token; the reference is HF on a compressed-tensors checkpoint written with those rules (a random tiny
    model's logits have too many near-ties to compare with the unrounded model)."""
    pytest.importorskip("compressed_tensors")
    src = tiny_model_factory("llama")
    sd = load_file(os.path.join(src, "model.safetensors"))
    rounded = {}
    for name, t in sd.items():
        if _is_linear(name):
            s = t.abs().amax(dim=1, keepdim=True) / 448
            rounded[name[:-len("weight")] + "weight_scale"] = s
            t = (t / s).to(FP8)
        rounded[name] = t
    ref = _rewrite(src, str(tmp_path / "r"), rounded, ct_config("channel", "dynamic"))
    assert greedy(src, quantization="fp8") == hf_greedy(ref)


@pytest.fixture(scope="module")
def ct_fp8_dir(tiny_model_factory, tmp_path_factory):
    """The tiny Llama compressed by the compressed-tensors library: FP8 per-channel weights, dynamic per-token FP8
    activations (its FP8_DYNAMIC preset), lm_head left dense."""
    pytest.importorskip("compressed_tensors")
    import transformers as tf
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config, preset_name_to_scheme
    src = tiny_model_factory("llama")
    model = tf.AutoModelForCausalLM.from_pretrained(src, torch_dtype=torch.float32).eval()
    apply_quantization_config(model, QuantizationConfig(
        config_groups={"group_0": preset_name_to_scheme("FP8_DYNAMIC", ["Linear"])}, ignore=["lm_head"]))
    with torch.no_grad():
        for mod in model.modules():
            if hasattr(mod, "weight_scale"):   # what calibration's min-max observer would set
                mod.weight_scale.copy_(mod.weight.abs().amax(dim=1, keepdim=True) / 448)
    comp = ModelCompressor.from_pretrained_model(model, quantization_format="float-quantized")
    comp.compress_model(model)
    d = str(tmp_path_factory.mktemp("ct-fp8"))
    model.save_pretrained(d)
    comp.update_config(d)
    for f in os.listdir(src):
        if f.startswith("tokenizer") or f == "special_tokens_map.json":
            shutil.copy(os.path.join(src, f), d)
    return d


def test_compressed_tensors_fp8_matches_transformers(ct_fp8_dir):
    sd = load_file(os.path.join(ct_fp8_dir, "model.safetensors"))
    assert sd["model.layers.0.self_attn.q_proj.weight"].dtype == FP8
    assert greedy(ct_fp8_dir) == hf_greedy(ct_fp8_dir)


def test_method_mismatches_are_refused_before_loading(tiny_model_factory, fp8_checkpoints, ct_fp8_dir):
    with pytest.raises(ValueError, match="compressed-tensors needs a checkpoint quantized with compressed-tensors"):
        greedy(tiny_model_factory("llama"), quantization="compressed-tensors")
    with pytest.raises(ValueError, match="--quantization fp8 does not match .*'compressed-tensors'"):
        greedy(ct_fp8_dir, quantization="fp8")
    with pytest.raises(ValueError, match="quantization='hqq'.*not supported yet"):
        LLM(fp8_checkpoints[0], quantization="hqq", **ENGINE)


def test_dense_tensor_under_an_fp8_config_names_the_tensor(fp8_checkpoints, tmp_path):
    tensor, dense = fp8_checkpoints[0], fp8_checkpoints[3]
    d = str(tmp_path / "m")
    shutil.copytree(tensor, d)
    sd = load_file(os.path.join(d, "model.safetensors"))
    sd["model.layers.1.mlp.up_proj.weight"] = load_file(os.path.join(dense, "model.safetensors"))[
        "model.layers.1.mlp.up_proj.weight"]
    save_file(sd, os.path.join(d, "model.safetensors"))
    with pytest.raises(ValueError, match="'model.layers.1.mlp.up_proj.weight'.*not fp8"):
        greedy(d)
