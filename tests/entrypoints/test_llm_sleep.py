"""LLM.sleep / wake_up / is_sleeping (vLLM's sleep mode, as RL frameworks call it between rollouts): the device
memory of the weights and the KV cache is released and taken back, and greedy tokens after waking are the ones
before sleeping; generating while asleep, or sleeping without enable_sleep_mode, is a clear error."""
from __future__ import annotations

import os

import pytest
import torch

from tokenmill import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=8)
PROMPTS = ["The quick brown fox jumps over the lazy dog, and the lazy dog sleeps under the old tree by the river until", "one two three four five six seven eight"]


@pytest.fixture(scope="module")
def model_dir(tiny_model_factory):
    return tiny_model_factory("llama")


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(model_dir, max_model_len=128, num_gpu_blocks_override=64, enable_sleep_mode=True, block_size=16)


def tokens(llm) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def weights_released(llm) -> bool:
    return all(llm.apply_model(lambda m: all(p.numel() == 0 for p in m.parameters())))


def test_level_1_keeps_the_weights_and_resets_the_prefix_cache(llm):
    before = tokens(llm)
    assert llm.generate(PROMPTS[0], GREEDY, use_tqdm=False)[0].num_cached_tokens > 0  # a prefix hit
    llm.sleep(level=1)
    assert llm.is_sleeping() and weights_released(llm)
    assert llm.collective_rpc(lambda w: w.runner.kv_caches) == [[]]
    with pytest.raises(RuntimeError, match=r"sleeping \(kv_cache and weights released\): call wake_up\(\)"):
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()
    llm.wake_up()
    assert not llm.is_sleeping() and not weights_released(llm)
    # The cache's blocks were discarded with their contents: nothing is served from them.
    assert llm.generate(PROMPTS[0], GREEDY, use_tqdm=False)[0].num_cached_tokens == 0
    assert tokens(llm) == before


def test_level_2_weights_come_back_for_a_sync(llm, model_dir):
    from safetensors.torch import load_file
    before = tokens(llm)
    llm.sleep(level=2)
    llm.wake_up(tags=["weights"])  # the RL order: weights first, sync them, then the KV cache
    assert llm.is_sleeping() and not weights_released(llm)
    with pytest.raises(RuntimeError, match=r"sleeping \(kv_cache released\)"):
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    state = load_file(os.path.join(model_dir, "model.safetensors"))
    llm.apply_model(lambda m: m.load_weights(iter(state.items())))
    llm.wake_up(tags=["kv_cache"])
    assert not llm.is_sleeping()
    assert tokens(llm) == before


def test_kv_cache_woken_first_comes_back_with_the_weights(llm):
    before = tokens(llm)
    llm.sleep()
    llm.wake_up(tags=["kv_cache"])
    assert llm.is_sleeping() and llm.collective_rpc(lambda w: w.runner.kv_caches) == [[]]
    llm.wake_up(tags=["weights"])
    assert not llm.is_sleeping() and tokens(llm) == before


def test_bad_levels_and_tags_and_repeats(llm, caplog):
    with pytest.raises(ValueError, match="sleep level must be 1 .* or 2"):
        llm.sleep(level=3)
    llm.sleep()
    llm.sleep()  # already asleep: a warning, as in vLLM
    with pytest.raises(ValueError, match=r"unknown tag\(s\) \['weight'\]"):
        llm.wake_up(tags=["weight"])
    llm.wake_up()
    llm.wake_up()  # not sleeping: a warning
    assert not llm.is_sleeping()


def test_sleep_needs_enable_sleep_mode(model_dir):
    llm = LLM(model_dir, max_model_len=64, num_gpu_blocks_override=16)
    for call in (llm.sleep, llm.wake_up):
        with pytest.raises(ValueError, match=r"enable_sleep_mode=True \(--enable-sleep-mode\)"):
            call()
    assert not llm.is_sleeping()


def test_tied_weights_wake_as_one_tensor(tiny_model_factory):
    """A weight two modules share (tied embeddings) wakes as one tensor again, so a weight sync reaches both."""
    from tokenmill.worker.sleep import SleepState

    class Runner:
        device, proposer = torch.device("cpu"), None

        def __init__(self):
            emb = torch.nn.Embedding(4, 3)
            head = torch.nn.Linear(3, 4, bias=False)
            head.weight = emb.weight
            self.model = torch.nn.ModuleDict({"emb": emb, "head": head})
            self.model.register_buffer("table", torch.arange(3.0))

        def release_kv_cache(self):
            pass

    r = Runner()
    state = SleepState(r, rebuild_kv=lambda: None)
    state.sleep(level=2)
    assert r.model["emb"].weight.numel() == 0
    state.wake_up(["weights", "kv_cache"])
    assert r.model["emb"].weight is r.model["head"].weight and r.model["emb"].weight.shape == (4, 3)
    assert torch.equal(r.model.table, torch.arange(3.0))  # buffers are kept at level 2


def test_level_2_drops_the_heads_fp16_copies_so_a_sync_reaches_the_logits():
    """The CPU LM head's fp16 copies (the default GGUF path's) are derived from the weight: a level-2 sleep drops
    them, so the logits after a weight sync are the new weight's (level 1 keeps them: the same weight wakes)."""
    if "fbgemm" not in torch.backends.quantized.supported_engines:
        pytest.skip("this torch build has no FBGEMM")
    from tokenmill.layers.vocab_parallel_embedding import ParallelLMHead
    from tokenmill.worker.sleep import SleepState

    class Runner:
        device, proposer = torch.device("cpu"), None

        def __init__(self):
            self.model = torch.nn.ModuleDict({"lm_head": ParallelLMHead(40, 16)})
            self.model["lm_head"].weight.data.normal_(generator=torch.Generator().manual_seed(1))
            self.model["lm_head"].enable_fp16_copies(packed_rows=4, half_rows=0)

        def release_kv_cache(self):
            pass

    r = Runner()
    head, h = r.model["lm_head"], torch.randn(2, 16, generator=torch.Generator().manual_seed(2))
    state = SleepState(r, rebuild_kv=lambda: None)
    state.sleep(level=1)
    state.wake_up(["weights", "kv_cache"])
    assert head._packed is not None
    state.sleep(level=2)
    state.wake_up(["weights", "kv_cache"])
    new = torch.randn(40, 16, generator=torch.Generator().manual_seed(3))
    head.weight.data.copy_(new)
    assert head._packed is None
    torch.testing.assert_close(head.compute_logits(h), torch.nn.functional.linear(h, new), rtol=1e-6, atol=1e-6)
