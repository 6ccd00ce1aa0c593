"""Model options read from the checkpoint and the local HF cache: --code-revision, --tokenizer-revision (picking
 files of the cache, as in vLLM) and --disable-sliding-window."""
from __future__ import annotations

import json
import os
import shutil

import pytest

from tokenmill.config.engine_args import create_engine_config

REMOTE_CONFIG = '''from transformers import LlamaConfig


class TinyRemoteConfig(LlamaConfig):
    model_type = "tiny_remote_llama"

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.code_version = "{version}"
'''


def _cache_repo(cache: str, repo: str, revisions: dict[str, str], fill) -> None:
    """An HF hub cache entry for `repo` with one snapshot per {ref: commit}; fill(snapshot_dir, ref) writes it."""
    root = os.path.join(cache, "models--" + repo.replace("/", "--"))
    os.makedirs(os.path.join(root, "refs"), exist_ok=True)
    for ref, commit in revisions.items():
        with open(os.path.join(root, "refs", ref), "w") as fh:
            fh.write(commit)
        snap = os.path.join(root, "snapshots", commit)
        os.makedirs(snap, exist_ok=True)
        fill(snap, ref)


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    import huggingface_hub.constants as hub_constants
    import transformers.dynamic_module_utils as dyn
    cache = str(tmp_path / "hub")
    monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", cache)
    monkeypatch.setattr(dyn, "HF_MODULES_CACHE", str(tmp_path / "modules"))
    return cache


def test_code_revision_selects_the_remote_config_code(tiny_model_factory, hub_cache, tmp_path):
    commits = {"main": "a" * 40, "v2": "b" * 40}

    def write_code(snap, ref):
        with open(os.path.join(snap, "configuration_tiny.py"), "w") as fh:
            fh.write(REMOTE_CONFIG.format(version=ref))
    _cache_repo(hub_cache, "org/code", commits, write_code)
    model = str(tmp_path / "model")
    shutil.copytree(tiny_model_factory("llama"), model)
    with open(os.path.join(model, "config.json")) as fh:
        cfg = json.load(fh)
    cfg.update(model_type="tiny_remote_llama", auto_map={"AutoConfig": "org/code--configuration_tiny.TinyRemoteConfig"})
    with open(os.path.join(model, "config.json"), "w") as fh:
        json.dump(cfg, fh)

    hf = create_engine_config(model=model, trust_remote_code=True).model_config.hf_config
    assert hf.code_version == "main"
    hf = create_engine_config(model=model, trust_remote_code=True, code_revision="v2").model_config.hf_config
    assert hf.code_version == "v2"


def test_code_revision_without_remote_code_changes_nothing(tiny_model_factory):
    model = tiny_model_factory("llama")
    plain = create_engine_config(model=model).model_config.hf_config
    assert create_engine_config(model=model, code_revision="v2").model_config.hf_config.to_dict() == plain.to_dict()


def test_tokenizer_revision_without_tokenizer_reads_the_model_repo_at_that_revision(tiny_model_factory, hub_cache):
    from tokenmill.entrypoints.llm import LLM
    commits = {"main": "c" * 40, "v2": "d" * 40}
    src = tiny_model_factory("llama")

    def write_model(snap, ref):
        shutil.copytree(src, snap, dirs_exist_ok=True)
        with open(os.path.join(snap, "chat_template.jinja"), "w") as fh:  # where transformers 5 keeps it
            fh.write(f"template of {ref}")
    _cache_repo(hub_cache, "org/tiny", commits, write_model)
    cfg = create_engine_config(model="org/tiny", tokenizer_revision="v2")
    assert cfg.model_config.resolved.path.endswith(commits["main"])  # the weights stay at the model's revision
    llm = LLM(model="org/tiny", tokenizer_revision="v2", enforce_eager=True, num_gpu_blocks_override=8,
              max_model_len=64)
    assert llm.get_tokenizer().chat_template == "template of v2"
    assert LLM(model="org/tiny", enforce_eager=True, num_gpu_blocks_override=8,
               max_model_len=64).get_tokenizer().chat_template == "template of main"


def test_disable_sliding_window_caps_the_context_at_the_window(tiny_model_factory):
    model, window = tiny_model_factory("mistral"), {"sliding_window": 32}
    assert create_engine_config(model=model, hf_overrides=window).model_config.max_model_len == 512
    capped = create_engine_config(model=model, hf_overrides=window, disable_sliding_window=True).model_config
    assert (capped.sliding_window, capped.max_model_len) == (32, 32)
    with pytest.raises(ValueError, match=r"larger than the model's maximum context length \(32, its sliding window"):
        create_engine_config(model=model, hf_overrides=window, disable_sliding_window=True, max_model_len=64)
    assert create_engine_config(model=model, disable_sliding_window=True).model_config.max_model_len == 512
