"""Per-layer cache specs (which layers slide, by how much, as HF applies it) and the KV cache manager freeing the
blocks below a sliding window: a request's memory follows the window, not its length, and prefix hits stay
exact (every block a later query reads is cached, the ones below the window are not needed)."""
from __future__ import annotations

import pytest
import transformers as tf

from tokenmill.core.block_hash import BlockHasher
from tokenmill.core.kv_cache_manager import KVCacheManager
from tokenmill.core.kv_cache_spec import (FullAttentionSpec, RecurrentStateSpec, SlidingWindowSpec,
                                          attention_specs, capacity_report, group_layers, layer_sliding_windows,
                                          manager_spec, model_state_specs)
from tokenmill.core.request import Request
from tokenmill.sampling_params import SamplingParams

SMALL = dict(hidden_size=32, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1, vocab_size=100)


def test_layer_windows_follow_each_family_like_hf():
    assert layer_sliding_windows(tf.MistralConfig(**SMALL, num_hidden_layers=3, sliding_window=8)) == [8, 8, 8]
    assert layer_sliding_windows(tf.MistralConfig(**SMALL, num_hidden_layers=2, sliding_window=None)) == [None] * 2
    # Qwen2: a window only with use_sliding_window, on the layers from max_window_layers on.
    assert layer_sliding_windows(tf.Qwen2Config(**SMALL, num_hidden_layers=3, sliding_window=8)) == [None] * 3
    q = tf.Qwen2Config(**SMALL, num_hidden_layers=4, use_sliding_window=True, sliding_window=8, max_window_layers=2)
    assert layer_sliding_windows(q) == [None, None, 8, 8]
    g2 = tf.Gemma2Config(**SMALL, num_hidden_layers=4, sliding_window=16)
    assert layer_sliding_windows(g2) == [16, None, 16, None]
    g3 = tf.Gemma3TextConfig(**SMALL, num_hidden_layers=7, sliding_window=16)  # five local to one global
    assert layer_sliding_windows(g3) == [16] * 5 + [None, 16]
    mm = tf.Gemma3Config(text_config=dict(SMALL, num_hidden_layers=3, sliding_window_pattern=3, sliding_window=4))
    assert layer_sliding_windows(mm) == [4, 4, None]
    assert layer_sliding_windows(g3, disable_sliding_window=True) == [None] * 7


def test_spec_sizes_and_groups():
    specs = attention_specs(tf.Gemma2Config(**SMALL, num_hidden_layers=4, sliding_window=16), 16, 2, 64, 2)
    full, slide = specs[1], specs[0]
    assert type(full) is FullAttentionSpec and isinstance(slide, SlidingWindowSpec)
    assert full.bytes_per_token == 2 * 2 * 64 * 2 and full.bytes_per_block == 16 * full.bytes_per_token
    assert slide.name == "sliding_attention(window=16)" and full.name == "full_attention"
    assert group_layers(specs, range(4)) == {slide: [0, 2], full: [1, 3]}
    assert group_layers(specs, range(2, 4)) == {slide: [2], full: [3]}  # one pipeline stage's layers
    # A request of 1000 tokens in steps of up to 8: full attention holds them all, a window 16 + 8 - 1 of them.
    assert full.max_blocks_per_request(1000, 8) == 63
    assert slide.max_blocks_per_request(1000, 8) == 3
    # The query at p sees keys from p - 15: block 0 (keys 0..15) is dead from p = 31 on.
    assert [slide.num_dead_blocks(p) for p in (16, 30, 31, 46, 47)] == [0, 0, 1, 1, 2]


def test_the_manager_spec_of_mixed_layers_is_the_full_one():
    g3 = attention_specs(tf.Gemma3TextConfig(**SMALL, num_hidden_layers=6, sliding_window=16), 16, 1, 64, 2)
    assert type(manager_spec(g3)) is FullAttentionSpec
    mistral = attention_specs(tf.MistralConfig(**SMALL, num_hidden_layers=2, sliding_window=16), 16, 1, 64, 2)
    assert manager_spec(mistral) == mistral[0]
    report = capacity_report(g3, range(6), 640, 1024, 256)
    assert report == {"sliding_attention(window=16) x5 layers": 10.0, "full_attention x1 layers": 10.0}
    assert capacity_report(mistral, range(2), 640, 1024, 256) == {"sliding_attention(window=16) x2 layers":
                                                                  640 / mistral[0].max_blocks_per_request(1024, 256)}


def test_recurrent_state_specs_come_from_the_model():
    class Hybrid:
        def state_specs(self):
            return [RecurrentStateSpec("gated_deltanet", bytes_per_request=3 << 20, num_layers=48)]
    assert model_state_specs(Hybrid()) == [RecurrentStateSpec("gated_deltanet", 3 << 20, 48)]
    assert model_state_specs(object()) == []


def request(rid, tokens, bs=4):
    return Request(rid, list(tokens), SamplingParams(max_tokens=200), 0.0, max_model_len=1024,
                   block_hasher=BlockHasher(bs, "sha256"))


def run(kv, req, chunk):
    """Compute the prompt in chunks of `chunk` tokens, then decode 20 tokens; returns the most blocks held."""
    most = 0
    while req.num_computed_tokens < req.num_tokens:
        n = min(chunk, req.num_tokens - req.num_computed_tokens)
        assert kv.allocate_slots(req, n) is not None
        req.num_computed_tokens += n
        most = max(most, kv.num_held_blocks(req.request_id))
    for t in range(20):
        req.append_output_token_ids([t])
        assert kv.allocate_slots(req, 1) is not None
        req.num_computed_tokens += 1
        most = max(most, kv.num_held_blocks(req.request_id))
    return most


@pytest.mark.parametrize("chunk", [1, 5, 64])
def test_sliding_window_blocks_are_freed_as_a_request_advances(chunk):
    spec = SlidingWindowSpec(4, 1, 8, 2, sliding_window=6)
    kv = KVCacheManager(num_blocks=40, block_size=4, enable_caching=False, spec=spec)
    req = request("a", range(100))
    most = run(kv, req, chunk)
    assert most <= spec.max_blocks_per_request(120, chunk)
    assert kv.num_held_blocks("a") <= spec.max_blocks_per_request(120, 1)
    ids = kv.get_block_ids("a")
    assert len(ids) == 30 and ids[:26] == [-1] * 26  # 120 tokens: positions below 120 - 6 + 1 = 115 are gone
    kv.free(req)
    assert kv.num_free_blocks() == 40
    # Full attention keeps every block.
    full = KVCacheManager(num_blocks=40, block_size=4, enable_caching=False, spec=FullAttentionSpec(4, 1, 8, 2))
    assert run(full, request("b", range(100)), chunk) == 30


def test_a_prefix_hit_needs_only_the_blocks_inside_the_window():
    spec = SlidingWindowSpec(4, 1, 8, 2, sliding_window=6)
    kv = KVCacheManager(num_blocks=12, block_size=4, enable_caching=True, spec=spec)
    a = request("a", range(40))
    run(kv, a, 8)
    kv.free(a)
    # The same 40-token prompt plus one token: the last blocks of the prompt are still cached, the first ones were
    # evicted by a's own later blocks (12 blocks in all).
    b = request("b", list(range(40)) + [7])
    hits, n = kv.get_computed_blocks(b)
    assert n == 40 and len(hits) == 10
    assert hits[:8] == [None] * 8 and all(h is not None for h in hits[8:])  # keys from 40 - 6 + 1 = 35 on
    ids = kv.allocate_slots(b, 1, hits)
    assert ids[:8] == [0] * 8 and len(ids) == 11
    assert kv.num_held_blocks("b") == 3
    # A different prompt sharing only the first block gets no hit past what is cached.
    c = request("c", list(range(4)) + [9] * 20)
    assert kv.get_computed_blocks(c)[1] == 0
    kv.free(b)
    assert kv.num_free_blocks() == 12 and all(blk.ref_cnt == 0 for blk in kv.pool.blocks)


def test_a_hybrid_cache_frees_sliding_blocks_and_hits_only_where_every_group_can():
    from tokenmill.core.kv_cache_groups import HybridKVCacheManager, split_kv_budget
    full, slide = FullAttentionSpec(4, 1, 8, 2), SlidingWindowSpec(4, 1, 8, 2, sliding_window=6)
    kv = HybridKVCacheManager((40, 12), 4, True, [full, slide])
    a = request("a", range(40))
    most = run(kv, a, 8)
    assert kv.groups[0].num_held_blocks("a") == 15                       # 60 tokens, all kept
    assert kv.groups[1].num_held_blocks("a") <= slide.max_blocks_per_request(60, 1)
    assert most <= 15 + slide.max_blocks_per_request(60, 8)
    kv.free(a)
    assert kv.num_free_blocks() == kv.num_blocks == 52
    # The full group still has every block of the prompt, the sliding one only its last few: a hit of 10 blocks
    # (the prompt's 40 tokens) needs blocks 8 and 9 in the sliding group.
    b = request("b", list(range(40)) + [7])
    hits, n = kv.get_computed_blocks(b)
    assert n == 40 and len(hits[0]) == len(hits[1]) == 10
    assert all(h is not None for h in hits[0]) and hits[1][:8] == [None] * 8
    ids = kv.allocate_slots(b, 1, hits)
    assert len(ids) == 2 and len(ids[0]) == len(ids[1]) == 11
    kv.free(b)
    # Evict the sliding group's cached blocks: no hit, although the full group has the whole prefix.
    filler = request("f", [99] * 44)
    assert kv.allocate_slots(filler, 44) is not None
    kv.free(filler)
    assert kv.get_computed_blocks(request("c", list(range(40)) + [7]))[1] == 0
    # A budget is split so both groups hold as many max_model_len requests: 2 full layers, 4 sliding ones.
    groups = [(full, [0, 1]), (slide, [2, 3, 4, 5])]
    blocks = split_kv_budget(1 << 20, groups, range(6), 1000, 8)
    need = (full.max_blocks_per_request(1000, 8), slide.max_blocks_per_request(1000, 8))
    assert blocks[0] / need[0] == pytest.approx(blocks[1] / need[1], rel=0.01)
    assert blocks[0] * full.bytes_per_block * 2 + blocks[1] * slide.bytes_per_block * 4 <= 1 << 20


def test_kv_capacity_reports_each_layer_group():
    from tokenmill.core.kv_cache_groups import HybridKVCacheManager, kv_capacity
    full, slide = FullAttentionSpec(4, 1, 8, 2), SlidingWindowSpec(4, 1, 8, 2, sliding_window=6)
    rows = kv_capacity(HybridKVCacheManager((250, 12), 4, False, [full, slide]), 1000, 8)
    need = slide.max_blocks_per_request(1000, 8)
    assert rows == [["full_attention", 250, 1.0], ["sliding_attention(window=6)", 12, round(12 / need, 2)]]
    assert kv_capacity(KVCacheManager(500, 4, False, full), 1000, 8) == [["full_attention", 500, 2.0]]
