"""Sleep mode on CUDA (run with `pytest -m gpu` on the device): sleeping hands the KV cache's and the weights' device
memory back to the driver, and waking recaptures the CUDA graphs over the restored weights, so greedy tokens
after waking (graphs on) are the ones before sleeping."""
from __future__ import annotations

import os

import pytest
import torch

pytestmark = pytest.mark.gpu

PROMPTS = ["The quick brown fox jumps over the lazy dog because it", "one two three four five six seven eight"]
GiB = 1 << 30


@pytest.fixture(scope="module")
def model_dir(tiny_model_factory):
    return tiny_model_factory("llama")


@pytest.fixture(scope="module")
def llm(model_dir):
    from tokenmill import LLM
    # A modest pool (a tenth of the GPU), so that its release is far above the allocator's noise.
    return LLM(model_dir, max_model_len=256, enable_sleep_mode=True, gpu_memory_utilization=0.1)


def _tokens(llm) -> list[list[int]]:
    from tokenmill import SamplingParams
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def _graphs(llm) -> list[bool]:
    return llm.collective_rpc(lambda w: w.runner.cuda_graphs is not None)


def _kv_bytes(llm) -> int:
    return sum(llm.collective_rpc(lambda w: sum(t.numel() * t.element_size() for t in w.runner.kv_caches)))


def test_level_1_frees_the_pool_and_wakes_with_graphs_over_the_restored_weights(llm):
    before = _tokens(llm)
    assert all(_graphs(llm))
    pool = _kv_bytes(llm)
    assert pool > GiB // 2
    free0 = torch.cuda.mem_get_info()[0]
    llm.sleep(level=1)
    freed = torch.cuda.mem_get_info()[0] - free0
    assert freed >= 0.9 * pool, (freed / GiB, pool / GiB)
    assert not any(_graphs(llm))
    llm.wake_up()
    assert all(_graphs(llm)) and _kv_bytes(llm) == pool
    assert _tokens(llm) == before


def test_level_2_with_weights_reloaded_in_between(llm, model_dir):
    from safetensors.torch import load_file
    before = _tokens(llm)
    llm.sleep(level=2)
    llm.wake_up(tags=["weights"])
    state = load_file(os.path.join(model_dir, "model.safetensors"))
    llm.apply_model(lambda m: m.load_weights(iter(state.items())))
    llm.wake_up(tags=["kv_cache"])
    assert not llm.is_sleeping() and all(_graphs(llm))
    assert _tokens(llm) == before
