"""The recurrent-state slot pool: a decode CUDA graph's view (every row a decode row, slots from a device buffer,
padding rows on the scratch slot) gives a Gated DeltaNet layer the same outputs and state updates as the eager
step's view, and leaves every other slot untouched."""
from __future__ import annotations

import numpy as np
import torch
import transformers as tf

from tokenmill.distributed import ParallelState, use_parallel_state
from tokenmill.forward_context import set_forward_context
from tokenmill.layers.gated_deltanet import GatedDeltaNet
from tokenmill.worker.state_cache import GraphRecurrentStep, RecurrentStateCache


def _layer():
    cfg = tf.Qwen3_5TextConfig(hidden_size=32, linear_num_key_heads=2, linear_num_value_heads=4,
                               linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel_dim=4,
                               rms_norm_eps=1e-6)
    with use_parallel_state(ParallelState(world_size=1, rank=0, tp_size=1, tp_rank=0)):
        layer = GatedDeltaNet(cfg, 0)
    g = torch.Generator().manual_seed(0)
    for p in layer.parameters():
        p.data.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return layer


def _cache(layer, slots=6):
    cache = RecurrentStateCache({0: layer.state_shapes()}, slots, torch.float32, torch.device("cpu"))
    g = torch.Generator().manual_seed(1)
    for t in (cache.conv[0], cache.ssm[0]):
        t.copy_(torch.randn(t.shape, generator=g))
    return cache


def test_graph_view_equals_the_eager_decode_view():
    layer = _layer()
    rows = np.array([4, 1, 3])                       # batch order -> slots, not in slot order
    x = torch.randn(4, 32)                           # 3 requests and one padding row of a 4-row graph
    eager, graph = _cache(layer), _cache(layer)
    qsl = np.arange(4, dtype=np.int64)
    with set_forward_context(None, [], recurrent=eager.step(rows, qsl, np.array([5, 9, 2]))):
        want = layer(x[:3])
    view = GraphRecurrentStep(graph, max_rows=8)
    view.load(rows, 4)
    assert view.slots.tolist()[:4] == [4, 1, 3, graph.scratch_slot]
    with set_forward_context(None, [], recurrent=view.view(4)):
        got = layer(x)
    torch.testing.assert_close(got[:3], want, rtol=1e-5, atol=1e-5)
    for t_e, t_g in ((eager.conv[0], graph.conv[0]), (eager.ssm[0], graph.ssm[0])):
        torch.testing.assert_close(t_g[:-1], t_e[:-1])                  # every request slot, touched or not
    assert not torch.equal(graph.ssm[0][-1], eager.ssm[0][-1])          # the padding row wrote the scratch slot


def test_graph_slots_are_copied_only_when_the_batch_changes():
    view = GraphRecurrentStep(_cache(_layer()), max_rows=8)
    view.load(np.array([2, 0]), 2)
    view.slots.fill_(-7)   # stands in for the device buffer; an unchanged batch must not be copied again
    view.load(np.array([2, 0]), 2)
    assert view.slots[:2].tolist() == [-7, -7]
    view.load(np.array([2, 5]), 4)
    assert view.slots[:4].tolist() == [2, 5, view.scratch_slot, view.scratch_slot]
