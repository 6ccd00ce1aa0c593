"""PEFT adapter loading and its refusals, the LoRA engine arguments, and prefix-cache keys per adapter."""
from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from tokenmill.config.lora import LoRAConfig
from tokenmill.lora.peft import LoRAAdapterError, read_adapter
from tokenmill.lora.request import LoRARequest

from .conftest import make_adapter


@pytest.fixture(scope="module")
def text_config(lora_base):
    import transformers as tf
    return tf.AutoConfig.from_pretrained(lora_base)


def _read(path, text_config, lora_base, **kw):
    kw.setdefault("max_rank", 16)
    return read_adapter("ad", 1, path, text_config=text_config, served_names=[lora_base], **kw)


def test_weights_are_peft_tensors_with_scaling_folded_in(lora_adapters, text_config, lora_base):
    from safetensors.torch import load_file
    raw = load_file(os.path.join(lora_adapters["qv_rslora"], "adapter_model.safetensors"))
    ad = _read(lora_adapters["qv_rslora"], text_config, lora_base)
    assert ad.rank == 4 and sorted(m.rsplit(".", 1)[1] for m in ad.weights) == ["q_proj", "q_proj", "v_proj", "v_proj"]
    a, b = ad.weights["model.layers.1.self_attn.v_proj"]
    pre = "base_model.model.model.layers.1.self_attn.v_proj"
    assert torch.equal(a, raw[f"{pre}.lora_A.weight"])
    assert torch.allclose(b, raw[f"{pre}.lora_B.weight"] * (8 / 4 ** 0.5))  # rsLoRA: alpha / sqrt(r)
    ad = _read(lora_adapters["all"], text_config, lora_base)
    assert len(ad.weights) == 14  # 7 projections x 2 layers


def test_bin_weights_load_like_safetensors(lora_base, text_config, tmp_path):
    kw = dict(r=4, lora_alpha=4, target_modules=["o_proj"])
    st = _read(make_adapter(lora_base, str(tmp_path / "st"), 7, **kw), text_config, lora_base)
    bn = _read(make_adapter(lora_base, str(tmp_path / "bn"), 7, safe=False, **kw), text_config, lora_base)
    assert os.path.exists(tmp_path / "bn" / "adapter_model.bin")
    assert all(torch.equal(st.weights[k][1], bn.weights[k][1]) for k in st.weights)


def _copy(src, dst, config_edit=None):
    shutil.copytree(src, dst)
    if config_edit:
        p = os.path.join(dst, "adapter_config.json")
        cfg = json.load(open(p))
        config_edit(cfg)
        json.dump(cfg, open(p, "w"))
    return str(dst)


def test_refusals_name_the_adapter_and_the_problem(lora_adapters, text_config, lora_base, tmp_path):
    src = lora_adapters["mlp"]
    with pytest.raises(LoRAAdapterError, match="'ad' has rank 16, more than max_lora_rank=8"):
        _read(src, text_config, lora_base, max_rank=8)
    with pytest.raises(LoRAAdapterError, match="made for base model 'meta-llama/Other'"):
        _read(_copy(src, tmp_path / "b", lambda c: c.update(base_model_name_or_path="meta-llama/Other")),
              text_config, lora_base)
    with pytest.raises(LoRAAdapterError, match="made for base model 'x'"):
        _read(src, text_config, lora_base, base_model_name="x")
    with pytest.raises(LoRAAdapterError, match="is not a directory"):
        _read(str(tmp_path / "missing"), text_config, lora_base)
    with pytest.raises(LoRAAdapterError, match="no adapter_config.json"):
        os.makedirs(tmp_path / "empty")
        _read(str(tmp_path / "empty"), text_config, lora_base)
    bad = _copy(src, tmp_path / "trunc")
    open(os.path.join(bad, "adapter_model.safetensors"), "wb").write(b"\x00" * 10)
    with pytest.raises(LoRAAdapterError, match="cannot read .*adapter_model.safetensors"):
        _read(bad, text_config, lora_base)
    with pytest.raises(LoRAAdapterError, match="DoRA"):
        _read(_copy(src, tmp_path / "dora", lambda c: c.update(use_dora=True)), text_config, lora_base)
    # A module the model lacks (an adapter of a deeper model): refused naming the module.
    from safetensors.torch import load_file, save_file
    deep = _copy(src, tmp_path / "deep")
    w = load_file(os.path.join(deep, "adapter_model.safetensors"))
    w = {k.replace("layers.1.", "layers.7."): v for k, v in w.items()}
    save_file(w, os.path.join(deep, "adapter_model.safetensors"))
    with pytest.raises(LoRAAdapterError, match="targets module 'model.layers.7.mlp.down_proj', which the model"):
        _read(deep, text_config, lora_base)


def test_lora_config_validates_and_refuses_options_without_enable_lora():
    c = LoRAConfig(enable_lora=True, max_loras=3)
    assert c.max_cpu_loras == 3
    with pytest.raises(ValueError, match="max_cpu_loras \\(2\\) must be >= max_loras \\(3\\)"):
        LoRAConfig(enable_lora=True, max_loras=3, max_cpu_loras=2)
    with pytest.raises(ValueError, match="`max_loras=4` \\(--max-loras\\) needs enable_lora=True"):
        LoRAConfig(max_loras=4)
    with pytest.raises(ValueError, match="Invalid value 24 for `max_lora_rank`"):
        LoRAConfig(enable_lora=True, max_lora_rank=24)
    with pytest.raises(ValueError, match="unknown module\\(s\\) 'lm_head'"):
        LoRAConfig(enable_lora=True, lora_target_modules=["lm_head"])
    t = LoRAConfig(enable_lora=True, lora_target_modules=["qkv_proj", "down_proj"])
    assert t.targets("k_proj") and t.targets("down_proj") and not t.targets("up_proj")
    with pytest.raises(ValueError, match="fully_sharded_loras=True.*not supported yet"):
        LoRAConfig(enable_lora=True, fully_sharded_loras=True).verify_parallel(2)


def test_cli_flags_reach_the_lora_config():
    import shlex

    from tokenmill.config.args import parse_serve_args
    engine, _ = parse_serve_args(shlex.split("--enable-lora --max-loras 4 --max-lora-rank 32 --max-cpu-loras 8 "
                                             "--lora-dtype float32 --lora-target-modules o_proj qkv_proj"))
    assert engine == {"enable_lora": True, "max_loras": 4, "max_lora_rank": 32, "max_cpu_loras": 8,
                      "lora_dtype": "float32", "lora_target_modules": ["o_proj", "qkv_proj"]}


def test_prefix_cache_keys_differ_per_adapter():
    from tokenmill.core.block_hash import BlockHasher
    from tokenmill.core.request import Request
    from tokenmill.sampling_params import SamplingParams
    h = BlockHasher(4, "sha256")
    ids = list(range(12))

    def keys(lora):
        return Request("r", ids, SamplingParams(), 0.0, block_hasher=h, lora_request=lora).block_hashes
    a, b = LoRARequest("a", 1, "/a"), LoRARequest("b", 2, "/b")
    assert len(keys(None)) == 3
    assert keys(a) == keys(LoRARequest("a", 1, "/a")) and keys(a) != keys(b) and keys(a) != keys(None)
    assert not set(keys(a)) & set(keys(None))


def test_lora_request_checks_its_fields():
    with pytest.raises(ValueError, match="lora_int_id must be an integer >= 1"):
        LoRARequest("x", 0, "/p")
    with pytest.raises(ValueError, match="lora_path must name"):
        LoRARequest("x", 1)
    import msgspec
    r = LoRARequest("x", 3, "/p", base_model_name="m")
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(r), type=LoRARequest) == r


def test_lora_modules_parse_both_forms_and_refuse_bad_entries():
    from tokenmill.config.lora import LoRAModulePath, parse_lora_modules
    assert parse_lora_modules(["a=/x", '{"name": "b", "path": "/y", "base_model_name": "m"}']) == [
        LoRAModulePath("a", "/x"), LoRAModulePath("b", "/y", "m")]
    for bad, said in ((["a"], "neither name=path"), (["a=/x", "a=/y"], "'a' is given twice"),
                      (['{"name": "b"}'], "needs `name` and `path`"), (['{"name": "b", "path": "/y", "r": 1}'],
                                                                      "unknown key\\(s\\) r"),
                      (["{bad"], "not valid JSON")):
        with pytest.raises(ValueError, match=said):
            parse_lora_modules(bad)
