"""Sharded weight loading of the parallel layers, without processes: each rank is simulated in turn by setting the
parallel state, and the ranks' shards, combined the way the collectives would, must equal the one-rank layer."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tokenmill.distributed import ParallelState, use_parallel_state
from tokenmill.layers.linear import (ColumnParallelLinear, MergedColumnParallelLinear, QKVParallelLinear,
                                     RowParallelLinear)
from tokenmill.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding


def as_rank(tp_rank: int, tp_size: int):
    """Build layers as TP rank `tp_rank` of `tp_size` would (no process group: only construction and loading)."""
    return use_parallel_state(ParallelState(world_size=tp_size, rank=tp_rank, tp_size=tp_size, tp_rank=tp_rank))


def build(tp_size: int, make):
    """[layer of rank 0, ..., layer of rank tp_size-1]."""
    layers = []
    for r in range(tp_size):
        with as_rank(r, tp_size):
            layers.append(make())
    return layers


def load(layer, name: str, tensor: torch.Tensor, shard=None) -> None:
    p = getattr(layer, name)
    p.weight_loader(p, tensor, shard)


def test_column_and_row_parallel_shards_recombine():
    torch.manual_seed(0)
    w_up, b_up, w_down, b_down = torch.randn(12, 8), torch.randn(12), torch.randn(8, 12), torch.randn(8)
    x = torch.randn(5, 8)
    ref = F.linear(F.linear(x, w_up, b_up), w_down, b_down)
    cols = build(2, lambda: ColumnParallelLinear(8, 12, bias=True))
    rows = build(2, lambda: RowParallelLinear(12, 8, bias=True))
    partial = []
    for col, row in zip(cols, rows):
        assert col.weight.shape == (6, 8) and col.weight.full_shape == (12, 8)
        assert row.weight.shape == (8, 6) and row.bias.shape == (8,)
        for layer, w, b in ((col, w_up, b_up), (row, w_down, b_down)):
            load(layer, "weight", w)
            load(layer, "bias", b)
        partial.append(F.linear(col(x), row.weight))  # the row layer's matmul before its all-reduce
    torch.testing.assert_close(sum(partial) + rows[0].bias, ref)


def test_merged_gate_up_per_shard_and_fused_loading_agree():
    torch.manual_seed(0)
    gate, up = torch.randn(10, 4), torch.randn(10, 4)
    by_shard = build(2, lambda: MergedColumnParallelLinear(4, [10, 10]))
    fused = build(2, lambda: MergedColumnParallelLinear(4, [10, 10]))
    for r in range(2):
        load(by_shard[r], "weight", gate, 0)
        load(by_shard[r], "weight", up, 1)
        load(fused[r], "weight", torch.cat([gate, up]))
        expect = torch.cat([gate[5 * r:5 * r + 5], up[5 * r:5 * r + 5]])
        torch.testing.assert_close(by_shard[r].weight.data, expect)
        torch.testing.assert_close(fused[r].weight.data, expect)


@pytest.mark.parametrize("tp,num_kv", [(2, 2), (2, 1), (4, 2), (4, 1)])
def test_qkv_splits_query_heads_and_replicates_scarce_kv_heads(tp, num_kv):
    hd, nh, hidden = 3, 4, 5
    q = torch.arange(nh * hd * hidden, dtype=torch.float32).reshape(nh * hd, hidden)
    k = 1000 + torch.arange(num_kv * hd * hidden, dtype=torch.float32).reshape(num_kv * hd, hidden)
    v = -k
    layers = build(tp, lambda: QKVParallelLinear(hidden, hd, nh, num_kv, bias=True))
    for r, layer in enumerate(layers):
        assert layer.num_heads == nh // tp
        assert layer.num_kv_heads == max(num_kv // tp, 1)
        for sid, t in (("q", q), ("k", k), ("v", v)):
            load(layer, "weight", t, sid)
            load(layer, "bias", t[:, 0], sid)
        qh, kvh = layer.num_heads, layer.num_kv_heads
        kv_head = r // max(tp // num_kv, 1) * kvh  # first KV head rank r holds
        got_q, got_k, got_v = layer.weight.data.split([qh * hd, kvh * hd, kvh * hd])
        torch.testing.assert_close(got_q, q[r * qh * hd:(r + 1) * qh * hd])
        torch.testing.assert_close(got_k, k[kv_head * hd:(kv_head + kvh) * hd])
        torch.testing.assert_close(got_v, v[kv_head * hd:(kv_head + kvh) * hd])
        torch.testing.assert_close(layer.bias.data, layer.weight.data[:, 0])


def test_qkv_rejects_head_counts_that_do_not_split():
    with as_rank(0, 3), pytest.raises(ValueError, match="num_attention_heads .4. is not divisible by "
                                                        "tensor_parallel_size .3."):
        QKVParallelLinear(8, 2, 4, 4)
    with as_rank(0, 4), pytest.raises(ValueError, match="multiple of num_key_value_heads"):
        QKVParallelLinear(8, 2, 8, 3)


def test_vocab_parallel_embedding_and_head_with_padding():
    torch.manual_seed(0)
    vocab, hidden = 11, 4  # 11 rows over 2 ranks: 6 + 5, the last rank's 6th row is padding
    table = torch.randn(vocab, hidden)
    ids = torch.tensor([0, 5, 6, 10, 3])
    h = torch.randn(3, hidden)
    embs = build(2, lambda: VocabParallelEmbedding(vocab, hidden))
    heads = build(2, lambda: ParallelLMHead(vocab, hidden))
    summed, logits = 0, []
    for r, (emb, head) in enumerate(zip(embs, heads)):
        load(emb, "weight", table)
        load(head, "weight", table)
        assert emb.weight.shape == (6, hidden) and emb.weight.full_shape == (vocab, hidden)
        outside = (ids < emb.vocab_start) | (ids >= emb.vocab_end)
        local = torch.where(outside, 0, ids - emb.vocab_start)
        summed = summed + F.embedding(local, emb.weight).masked_fill(outside.unsqueeze(-1), 0)
        logits.append(F.linear(h, head.weight))
    torch.testing.assert_close(heads[1].weight.data[5], torch.zeros(hidden))  # padding row
    torch.testing.assert_close(summed, F.embedding(ids, table))
    torch.testing.assert_close(torch.cat(logits, -1)[:, :vocab], F.linear(h, table))


def test_one_rank_layers_are_plain_linear():
    torch.manual_seed(0)
    x, w, b = torch.randn(3, 4), torch.randn(6, 4), torch.randn(6)
    for layer in (ColumnParallelLinear(4, 6, bias=True), RowParallelLinear(4, 6, bias=True)):
        load(layer, "weight", w)
        load(layer, "bias", b)
        assert layer.weight.shape == layer.weight.full_shape
        torch.testing.assert_close(layer(x), F.linear(x, w, b))


def test_dummy_weights_shard_the_one_rank_tensors(tiny_model_factory):
    """--load-format dummy under TP draws the full tensor with the same seed and shards it: rank r's parameters
    are slices of what TP=1 builds."""
    from tokenmill.config.engine_args import create_engine_config
    from tokenmill.models.loader import load_model
    from tokenmill.attention.registry import get_attention_backend
    d = tiny_model_factory("qwen2")
    backend = get_attention_backend("", torch.device("cpu"))

    def model_for(rank: int, tp: int):
        cfg = create_engine_config(model=d, load_format="dummy", max_model_len=64)
        with as_rank(rank, tp):
            return dict(load_model(cfg, torch.device("cpu"), backend).named_parameters())

    full = model_for(0, 1)
    shards = [model_for(r, 2) for r in range(2)]
    name = "model.layers.0.self_attn.qkv_proj.weight"
    q, k, v = full[name].split([64, 32, 32])
    for r in range(2):
        torch.testing.assert_close(shards[r][name], torch.cat([q[32 * r:32 * r + 32], k[16 * r:16 * r + 16],
                                                               v[16 * r:16 * r + 16]]))
        down = "model.layers.1.mlp.down_proj.weight"
        torch.testing.assert_close(shards[r][down], full[down][:, 64 * r:64 * r + 64])
        emb = "model.embed_tokens.weight"
        n = full[emb].shape[0] // 2
        torch.testing.assert_close(shards[r][emb], full[emb][n * r:n * (r + 1)])
        torch.testing.assert_close(shards[r]["model.norm.weight"], full["model.norm.weight"])
