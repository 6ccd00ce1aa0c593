"""Engines for the speculative-decoding tests, and the "cycle" model whose output drafts can predict.

A random tiny model rarely repeats itself, so prompt lookup would never be accepted and a greedy-equality test would
pass without verifying a single draft. The cycle model is the tiny random Llama with its embeddings and LM head
rewritten so that the residual stream's own token dominates the logits through a fixed permutation: its greedy
continuation of token x is mostly `cycle_next(x)` (a cycle of CYCLE tokens within each block of CYCLE ids), while
the attention and MLP layers, scaled by `mix`, still move some positions elsewhere (so drafts are rejected too and
the verified positions' attention over the drafts matters).
"""
from __future__ import annotations

import os
import shutil

import numpy as np
import pytest
import torch

from tokenmill.entrypoints.llm import LLM

CYCLE = 7


def cycle_next(x: int) -> int:
    return x - x % CYCLE + (x + 1) % CYCLE


def cycle_prompt(start: int, length: int) -> list[int]:
    """`length` tokens following the cycle from `start` (which the model continues, so drafts are accepted)."""
    out = [start]
    while len(out) < length:
        out.append(cycle_next(out[-1]))
    return out


def write_cycle_model(src: str, dst: str, mix: float, embed_scale: float = 1.0, head_scale: float = 1.0) -> str:
    from safetensors.torch import load_file, save_file
    shutil.copytree(src, dst, dirs_exist_ok=True)
    path = os.path.join(dst, "model.safetensors")
    w = load_file(path)
    g = torch.Generator().manual_seed(7)
    emb = w["model.embed_tokens.weight"]
    v, h = emb.shape
    emb = torch.randn(v, h, generator=g) * embed_scale
    ids = np.arange(v)
    full = v - v % CYCLE
    nxt = ids.copy()
    nxt[:full] = ids[:full] - ids[:full] % CYCLE + (ids[:full] + 1) % CYCLE
    prev = np.empty_like(nxt)
    prev[nxt] = ids                                   # prev[y]: the token whose successor is y
    w["model.embed_tokens.weight"] = emb.contiguous()
    w["lm_head.weight"] = (emb[torch.from_numpy(prev)] * head_scale).contiguous()
    for name in list(w):
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            w[name] = (w[name] * mix).contiguous()
    save_file(w, path, metadata={"format": "pt"})
    return dst


@pytest.fixture(scope="session")
def tiny_llama(tiny_model_factory) -> str:
    return tiny_model_factory("llama")


@pytest.fixture(scope="session")
def cycle_model(tiny_llama, tmp_path_factory) -> str:
    return write_cycle_model(tiny_llama, str(tmp_path_factory.mktemp("cycle-llama")), mix=0.05)


def make_llm(path: str, spec: dict | None = None, **kw) -> LLM:
    """An engine on the tiny model; with `spec`, one that speculates at every step (the measured step-aside of
    spec_decode/step_aside.py would make the drafts a test counts depend on timing; its own tests turn it on)."""
    if spec is not None:
        spec = {"step_aside": False, **spec}
    kw = {"max_model_len": 256, "max_num_seqs": 8, "dtype": "float32", "seed": 0, **kw}
    if torch.cuda.is_available():  # several engines share the GPU here: none may claim a share of its memory
        kw.setdefault("num_gpu_blocks_override", 256)
    return LLM(path, speculative_config=spec, **kw)
