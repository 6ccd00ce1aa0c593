"""ConfigSnapshot: what engine processes read instead of the transformers config (no transformers import there)."""
from __future__ import annotations

import pickle
import subprocess
import sys

import pytest
import torch
import transformers as tf

from tokenmill.layers.rotary import compute_inv_freq
from tokenmill.transformers_utils.config import config_sliding_window, get_max_model_len, get_rope_params
from tokenmill.transformers_utils.config_snapshot import ConfigSnapshot, hf_config_object, snapshot

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=512, vocab_size=300)
_LLAMA3 = {"rope_type": "llama3", "rope_theta": 50000.0, "factor": 8.0, "low_freq_factor": 1.0,
           "high_freq_factor": 4.0, "original_max_position_embeddings": 32}


def _configs() -> dict[str, object]:
    return {
        "llama": tf.LlamaConfig(**TINY),
        "llama3_rope": tf.LlamaConfig(**TINY, rope_parameters=_LLAMA3),
        "qwen2_yarn_legacy": tf.Qwen2Config(**TINY, rope_scaling={"type": "yarn", "factor": 4.0,
                                                                  "original_max_position_embeddings": 64}),
        "qwen3_window": tf.Qwen3Config(**TINY, use_sliding_window=True, sliding_window=9, max_window_layers=0),
        "phi3_longrope": tf.Phi3Config(**TINY, partial_rotary_factor=0.5, original_max_position_embeddings=64,
                                       pad_token_id=0, rope_parameters={
                                           "rope_type": "longrope", "rope_theta": 10000.0,
                                           "short_factor": [1.0] * 4, "long_factor": [2.0] * 4}),
        "mistral": tf.MistralConfig(**TINY, sliding_window=16),
        "gemma2": tf.Gemma2Config(**TINY, head_dim=16, sliding_window=12, pad_token_id=0),
        "gemma3_mm": tf.Gemma3Config(text_config=dict(TINY, head_dim=16, sliding_window=12)),
        "qwen3_5_mm": tf.Qwen3_5Config(text_config=dict(TINY, head_dim=16)),
        "qwen3_5_text": tf.Qwen3_5TextConfig(**TINY, head_dim=16),
    }


def _assert_same(snap: ConfigSnapshot, cfg) -> None:
    """Every public value the config answers for is the snapshot's; sub-configs recursively."""
    assert isinstance(snap, ConfigSnapshot)
    names = {n for n in dir(cfg) if not n.startswith("_")} | set(getattr(cfg, "attribute_map", {}))
    checked = 0
    for name in sorted(names):
        try:
            value = getattr(cfg, name)
        except Exception:  # noqa: BLE001
            continue
        if isinstance(value, tf.PretrainedConfig):
            _assert_same(getattr(snap, name), value)
        elif not callable(value) and name in vars(snap):
            assert getattr(snap, name) == value, name
            checked += 1
    for name in ("model_type", "vocab_size", "hidden_size", "num_hidden_layers", "rope_parameters", "layer_types",
                 "head_dim", "sliding_window", "tie_word_embeddings", "dtype"):
        if hasattr(cfg, name):
            assert hasattr(snap, name), name  # what the engine reads is never left out
    assert checked >= 20
    assert snap.to_dict() == cfg.to_dict()
    assert snap.class_name == type(cfg).__name__


@pytest.mark.parametrize("name", list(_configs()))
def test_a_snapshot_holds_every_value_of_the_config(name):
    cfg = _configs()[name]
    snap = snapshot(cfg)
    _assert_same(snap, cfg)
    text = cfg.get_text_config()
    if text is cfg:
        assert snap.get_text_config() is snap
    else:
        assert snap.get_text_config() is getattr(snap, "text_config")  # one snapshot per sub-config
        _assert_same(snap.get_text_config(), text)
    # What tokenmill derives from the config is the same from the snapshot.
    assert get_rope_params(snap) == get_rope_params(cfg)
    assert get_max_model_len(snap) == get_max_model_len(cfg)
    assert config_sliding_window(snap) == config_sliding_window(cfg)
    t, ts = text, snap.get_text_config()
    head_dim = getattr(t, "head_dim", None) or t.hidden_size // t.num_attention_heads
    partial = name in ("phi3_longrope", "qwen3_5_mm", "qwen3_5_text")
    a = compute_inv_freq(t, head_dim, 256, partial_rotary=partial)
    b = compute_inv_freq(ts, head_dim, 256, partial_rotary=partial)
    assert torch.equal(a[0], b[0]) and a[1:] == b[1:]


def test_a_pickled_snapshot_is_free_of_transformers_until_asked():
    cfg = tf.LlamaConfig(**TINY, rope_parameters=_LLAMA3)
    snap = snapshot(cfg)
    assert hf_config_object(snap).to_dict() == cfg.to_dict()  # the config itself, for transformers' own functions
    assert hf_config_object(cfg) is cfg
    blob = pickle.dumps(snap)  # after hf_object(): the unpickled config does not travel
    code = ("import pickle, sys\n"
            f"snap = pickle.loads({blob!r})\n"
            "print(snap.hidden_size, snap.rope_parameters['rope_type'], 'transformers' in sys.modules)\n"
            "print(getattr(snap, 'no_such_key', 'absent'), 'transformers' in sys.modules)\n"
            "import json; print(json.loads(snap.to_json_string())['hidden_size'], 'transformers' in sys.modules)\n"
            "print(type(snap.hf_object()).__name__)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    # A name the config lacks is missing at once; its methods come from the config itself (imported then).
    assert out.stdout.split() == ["64", "llama3", "False", "absent", "False", "64", "True", "LlamaConfig"]


def test_the_callers_config_is_left_as_it_was():
    cfg = tf.Qwen2Config(**TINY, rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64})
    before = cfg.to_dict()
    snapshot(cfg)
    assert cfg.to_dict() == before
    assert snapshot(snapshot(cfg)).to_dict() == before  # a snapshot's snapshot is itself


# ------------------------------------------------------------------------------------------------------- disk cache
@pytest.fixture
def model_dir(tmp_path):
    d = tmp_path / "model"
    tf.LlamaConfig(**TINY, rope_parameters=_LLAMA3).save_pretrained(d)
    return d


def test_get_hf_config_reads_a_cached_snapshot_on_later_starts(model_dir, tmp_path, monkeypatch):
    import os

    from tokenmill import envs
    from tokenmill.transformers_utils import config as config_mod
    from tokenmill.transformers_utils.resolve import resolve_model

    resolved = resolve_model(str(model_dir))
    loads = []
    real = config_mod._load_config
    monkeypatch.setattr(config_mod, "_load_config", lambda *a, **k: loads.append(1) or real(*a, **k))
    with envs.override(TOKENMILL_CACHE_DIR=str(tmp_path / "cache")):
        first = config_mod.get_hf_config(resolved)
        again = config_mod.get_hf_config(resolved)
        assert isinstance(first, ConfigSnapshot) and len(loads) == 1  # the second came from the disk
        assert again.to_dict() == first.to_dict() and again.rope_parameters["rope_type"] == "llama3"
        # Overrides are part of the key: no entry answers for another set of them.
        over = config_mod.get_hf_config(resolved, hf_overrides={"max_position_embeddings": 1024})
        assert over.max_position_embeddings == 1024 and len(loads) == 2
        assert config_mod.get_hf_config(resolved).max_position_embeddings == 512 and len(loads) == 2
        # An edited config.json is read again.
        cfg = tf.LlamaConfig.from_pretrained(model_dir)
        cfg.num_hidden_layers = 3
        cfg.save_pretrained(model_dir)
        st = os.stat(model_dir / "config.json")
        os.utime(model_dir / "config.json", ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
        assert config_mod.get_hf_config(resolved).num_hidden_layers == 3 and len(loads) == 3
        # A damaged entry is rebuilt, not an error.
        for f in (tmp_path / "cache" / "hf_configs").glob("*.pkl"):
            f.write_bytes(b"not a pickle")
        assert config_mod.get_hf_config(resolved).num_hidden_layers == 3 and len(loads) == 4
        # Remote config code is never cached (the key would not cover its source).
        config_mod.get_hf_config(resolved, trust_remote_code=True)
        config_mod.get_hf_config(resolved, trust_remote_code=True)
        assert len(loads) == 6
    with envs.override(TOKENMILL_CACHE_DIR=""):  # no cache: built every time, a snapshot still
        assert isinstance(config_mod.get_hf_config(resolved), ConfigSnapshot) and len(loads) == 7


def test_with_a_warm_cache_the_engine_config_is_built_without_transformers(model_dir, tmp_path):
    """The API server sends the engine core its config before it imports transformers for the tokenizer: on a
    later start nothing on that path imports transformers (seconds of `tokenmill serve`'s start)."""
    code = ("import sys\n"
            "from tokenmill.config.engine_args import create_engine_config\n"
            f"c = create_engine_config(model={str(model_dir)!r}, load_format='dummy', skip_tokenizer_init=True)\n"
            "print(c.model_config.get_text_config().num_hidden_layers, 'transformers' in sys.modules)\n")
    env = dict(__import__("os").environ, TOKENMILL_CACHE_DIR=str(tmp_path / "cache"))
    runs = [subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
            for _ in range(2)]
    assert [r.returncode for r in runs] == [0, 0], runs[1].stderr
    assert runs[0].stdout.split() == ["4", "True"]  # the first start reads config.json through transformers
    assert runs[1].stdout.split() == ["4", "False"]
