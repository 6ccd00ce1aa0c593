"""The graphs' step-input staging (worker/cuda_graph.py), checked on the CPU with the real first kernel (Triton's
interpreter): every graph size and kind takes its inputs from the host ring, padding is inert, slots rotate, the
block table is copied only when it changed, and the graphs share one logits buffer. (Capture and replay need CUDA:
tests/gpu.)"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from tokenmill.config.compilation import CompilationConfig
from tokenmill.worker.cuda_graph import SAMPLE_IN_GRAPH_MAX_SIZE, CudaGraphRunner, GraphKey

SIZES = [1, 2, 4, 8, 16, 24]
# On a CUDA machine the load kernel runs compiled, reading the pinned ring through the device's mapping.
DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _runner(verify_sizes=None, mixed=((16, 8),), vocab=0, layer_group=None) -> CudaGraphRunner:
    cg = CudaGraphRunner(None, [], SIZES, max_model_len=64, max_blocks_per_req=4, device=DEV,
                         mixed_sizes=list(mixed), vocab_size=vocab, verify_sizes=verify_sizes,
                         layer_group=layer_group)
    cg.graphs = {(s, q): None for q, sizes in cg.sizes_by_q.items() for s in sizes}   # as if captured
    cg.mixed_graphs = {t: None for t, _ in mixed}
    cg.prev_sampled[:3] = torch.tensor([111, 222, 333])
    return cg


@pytest.fixture
def runner():
    return _runner()


def _replay(cg: CudaGraphRunner, key: GraphKey) -> None:
    """What the graph's replay does first: its kernel takes the next slot into the device buffers."""
    cg.load_step_inputs(key)


def test_decode_inputs_land_in_their_buffers(runner):
    race = (np.array([7, 8, 9]), np.array([1, 2, 3]), np.array([0.5, 1.0, 2.0], dtype=np.float32))
    key = runner.load(np.array([5, 0, 0]), np.array([10, 11, 12]), np.array([100, 101, 102]), np.arange(4),
                      np.array([11, 12, 13]), np.array([[1, 2], [3, 4], [5, 6]], dtype=np.int32),
                      fix_src=np.array([-1, 0, 1]), race=race)
    assert key == (4, 1) and runner.last_io_slot == 0 and runner.draws(key)
    _replay(runner, key)
    assert runner.input_ids[:4].tolist() == [5, 111, 222, 0]          # placeholders from the previous step's ids
    assert runner.positions[:4].tolist() == [10, 11, 12, 0]
    assert runner.slot_mapping[:4].tolist() == [100, 101, 102, -1]    # the padding row stores nothing
    assert runner.seq_lens[:4].tolist() == [11, 12, 13, 0]            # ... and attends to nothing
    assert runner.query_start_loc[:5].tolist() == [0, 1, 2, 3, 4]
    assert runner.race_seeds[:4].tolist() == [7, 8, 9, 0] and runner.race_pos[:3].tolist() == [1, 2, 3]
    assert runner.race_temp[:4].tolist() == [0.5, 1.0, 2.0, 1.0] and runner.race_flag.item() == 1
    assert runner.block_table[:3, :2].tolist() == [[1, 2], [3, 4], [5, 6]]
    # The next step without the draw (a row that is not plain): the flag goes off, no placeholders left.
    key = runner.load(np.array([9]), np.array([13]), np.array([103]), np.arange(2), np.array([14]),
                      np.array([[1, 2]], dtype=np.int32))
    _replay(runner, key)
    assert key == (1, 1) and runner.race_flag.item() == 0 and runner.input_ids[0].item() == 9
    assert runner.seq_lens[0].item() == 14 and runner.host_io.counter.item() == runner.host_io.count == 2


def test_every_decode_size_uses_the_ring_and_slots_rotate(runner):
    io = runner.host_io
    for step, n in enumerate([17, 3, 24, 1, 9]):
        key = runner.load(np.arange(n) + 3, np.arange(n), np.arange(n), np.arange(n + 1), np.arange(n) + 1,
                          np.zeros((n, 1), np.int32))
        assert runner.last_io_slot == step % io.NUM_SLOTS and key.q == 1 and key.size >= n
        _replay(runner, key)
        assert runner.input_ids[:n].tolist() == list(range(3, n + 3))
        assert runner.seq_lens[:key.size].tolist() == list(range(1, n + 1)) + [0] * (key.size - n)
        assert runner.slot_mapping[n:key.size].tolist() == [-1] * (key.size - n)
        assert io.slot.item() == step % io.NUM_SLOTS


def test_padding_is_inert_after_a_larger_batch(runner):
    """Every slot once held a full batch of 4 (with placeholders); a batch of 3 in the same graph turns the fourth
    column back into padding: no KV slot, no context, no placeholder (its id stays 0, not prev_sampled[0])."""
    bt = np.zeros((4, 1), np.int32)
    for _ in range(runner.host_io.NUM_SLOTS):
        _replay(runner, runner.load(np.arange(4) + 1, np.arange(4), np.arange(4) + 10, np.arange(5),
                                    np.arange(4) + 5, bt, fix_src=np.array([0, 1, 2, 0])))
    key = runner.load(np.arange(3) + 1, np.arange(3), np.arange(3) + 50, np.arange(4), np.array([1, 1, 1]), bt[:3])
    assert key == (4, 1) and runner.last_io_slot == 0
    _replay(runner, key)
    assert runner.slot_mapping[:4].tolist() == [50, 51, 52, -1] and runner.seq_lens[:4].tolist() == [1, 1, 1, 0]
    assert runner.input_ids[:4].tolist() == [1, 2, 3, 0]


def test_mixed_batches_use_the_ring_too(runner):
    key = runner.load(np.arange(9) + 100, np.arange(9), np.arange(9) + 50, np.array([0, 3, 4, 9]),
                      np.array([10, 5, 5]), np.array([[7, 8], [9, 9], [1, 1]], dtype=np.int32),
                      fix_src=np.array([-1] * 8 + [2]))
    assert key == (16, 0) and runner.last_io_slot == 0 and not runner.draws(key)
    _replay(runner, key)
    assert runner.input_ids[:10].tolist() == list(range(100, 108)) + [333, 0]
    assert runner.slot_mapping[9:16].tolist() == [-1] * 7
    assert runner.query_start_loc[:9].tolist() == [0, 3, 4, 9, 9, 9, 9, 9, 9]
    assert runner.seq_lens[:8].tolist() == [10, 5, 5, 0, 0, 0, 0, 0]
    assert runner.last_token[:8].tolist() == [2, 3, 8, 0, 0, 0, 0, 0]
    assert runner.race_flag.item() == 0
    assert runner.block_table[:3, :2].tolist() == [[7, 8], [9, 9], [1, 1]]
    # too many tokens, or prompt logprobs (allow_mixed=False): no graph, nothing loaded
    assert runner.load(np.arange(17), np.arange(17), np.arange(17), np.array([0, 17]), np.array([17]),
                       np.zeros((1, 5), np.int32)) is None
    assert runner.load(np.arange(3), np.arange(3), np.arange(3), np.array([0, 3]), np.array([3]),
                       np.zeros((1, 1), np.int32), allow_mixed=False) is None
    assert runner.last_io_slot is None and runner.host_io.count == 1


def test_uniform_graphs_of_several_tokens_per_request():
    """Key (batch size, q): three requests of two tokens run in the (4, 2) graph; padding requests have an
    empty query and no context; a batch that is not uniform goes to a mixed graph."""
    cg = _runner(verify_sizes={2: [1, 2, 4, 8]})
    assert cg.sizes_by_q == {1: SIZES, 2: [1, 2, 4, 8]}
    assert cg.logits.shape[0] == 24 and cg.input_ids.shape[0] == 24   # the largest graph's rows and tokens
    assert _runner(verify_sizes={2: [1, 2, 4, 8, 16, 24]}).input_ids.shape[0] == 48
    with pytest.raises(ValueError, match="decode sizes"):
        _runner(verify_sizes={2: [3]})
    qsl = np.array([0, 2, 4, 6])
    key = cg.load(np.arange(6) + 1, np.arange(6), np.arange(6) + 20, qsl, np.array([5, 6, 7]),
                  np.zeros((3, 2), np.int32))
    assert key == (4, 2) and cg.tokens_and_reqs(key) == (8, 4) and not cg.draws(key)
    _replay(cg, key)
    assert cg.query_start_loc[:5].tolist() == [0, 2, 4, 6, 6] and cg.seq_lens[:4].tolist() == [5, 6, 7, 0]
    assert cg.slot_mapping[:8].tolist() == list(range(20, 26)) + [-1, -1]
    md = cg._metadata(key)
    assert md.max_query_len == 2 and md.num_actual_tokens == 8 and md.seq_lens.shape[0] == 4
    assert cg.uniform_key(3, 6, np.array([0, 1, 5, 6])) is None
    assert cg.load(np.arange(6), np.arange(6), np.arange(6), np.array([0, 1, 5, 6]), np.array([1, 4, 1]),
                   np.zeros((3, 1), np.int32)) == (16, 0)
    assert cg.uniform_key(25, 50, np.arange(26) * 2) is None and cg.uniform_key(3, 9, np.arange(4) * 3) is None
    with pytest.raises(ValueError, match="does not sample"):
        cg.load(np.arange(6), np.arange(6), np.arange(6), qsl, np.array([5, 6, 7]), np.zeros((3, 1), np.int32),
                race=(np.zeros(3), np.zeros(3), np.ones(3, np.float32)))


def test_block_table_copied_only_when_changed(runner, monkeypatch):
    import tokenmill.worker.cuda_graph as cgm
    copies = []
    bt = np.array([[4, 5], [6, 7]], dtype=np.int32)
    args = (np.array([1, 2]), np.array([3, 4]), np.array([5, 6]), np.arange(3), np.array([7, 8]))
    orig = cgm._pinned
    monkeypatch.setattr(cgm, "_pinned", lambda a: copies.append(a.copy()) or orig(a))
    runner.load(*args, bt)
    runner.load(*args, bt.copy())
    assert len(copies) == 1
    bt[1, 1] = 9                                   # a request moved to a new block
    runner.load(*args, bt)
    assert len(copies) == 2 and runner.block_table[1, 1].item() == 9
    runner.load(*args, bt[:, :1].copy())           # a narrower table that the device already holds
    assert len(copies) == 2


def test_kv_groups_get_their_own_slots_and_tables(monkeypatch):
    """A model with sliding-window layers beside full ones: each group after the first has its own slot mapping
    (padding tokens store nothing) and block table (copied only when it changed); each layer's metadata is its
    group's view of the graph's buffers."""
    import tokenmill.worker.cuda_graph as cgm
    cg = _runner(layer_group=[0, 1, 1, 0, 2])
    copies = []
    orig = cgm._pinned
    monkeypatch.setattr(cgm, "_pinned", lambda a: copies.append(a.copy()) or orig(a))
    args = (np.array([1, 2, 3]), np.array([3, 4, 5]), np.array([5, 6, 7]), np.arange(4), np.array([7, 8, 9]),
            np.array([[1], [2], [3]], dtype=np.int32))
    groups = [(np.array([40, 41, 42]), np.array([[10], [11], [12]], dtype=np.int32)),
              (np.array([50, 51, 52]), np.array([[20], [21], [22]], dtype=np.int32))]
    with pytest.raises(ValueError, match="3 KV cache groups"):
        cg.load(*args)
    key = cg.load(*args, groups=groups)
    assert key == (4, 1)
    assert cg.group_slots[:, :4].tolist() == [[40, 41, 42, -1], [50, 51, 52, -1]]
    assert cg.group_block_table[:, :3, 0].tolist() == [[10, 11, 12], [20, 21, 22]]
    n = len(copies)
    assert n == 5                                  # the block table, then each group's slots and table
    cg.load(*args, groups=[(np.array([43, 44, 45]), t.copy()) for _, t in groups])
    assert len(copies) == n + 2 and cg.group_slots[0, :3].tolist() == [43, 44, 45]   # slots only
    md = cg._metadata(key)
    layers = cg._layer_metadata(key, md)
    assert layers[0] is md and layers[3] is md and layers[1] is layers[2]
    assert layers[1].slot_mapping.data_ptr() == cg.group_slots[0].data_ptr()
    assert layers[4].block_table.data_ptr() == cg.group_block_table[1].data_ptr()
    assert layers[4].block_table.shape == (4, 4) and layers[4].slot_mapping.shape == (4,)
    assert _runner()._layer_metadata(key, md) is None


def test_only_small_decode_graphs_sample(runner):
    assert runner.can_sample(1, 1) and runner.can_sample(SAMPLE_IN_GRAPH_MAX_SIZE, SAMPLE_IN_GRAPH_MAX_SIZE)
    assert not runner.can_sample(SAMPLE_IN_GRAPH_MAX_SIZE + 1, SAMPLE_IN_GRAPH_MAX_SIZE + 1)
    assert not runner.can_sample(3, 5)             # not a decode batch
    with pytest.raises(ValueError, match="does not sample"):
        n = SAMPLE_IN_GRAPH_MAX_SIZE + 1
        runner.load(np.arange(n), np.arange(n), np.arange(n), np.arange(n + 1), np.arange(n),
                    np.zeros((n, 1), np.int32), None, None, (np.arange(n), np.arange(n), np.ones(n, np.float32)))


@pytest.mark.parametrize("max_seqs,max_tokens", [(24, 16), (8, 512), (24, 512)])
def test_one_logits_buffer_sized_as_the_profiler_reserves(max_seqs, max_tokens):
    """Every graph writes its logits into one buffer: the rows the config's graph_output_rows reserves (the
    largest graph), not the sum over graphs."""
    cc = CompilationConfig(cudagraph_capture_sizes=SIZES)
    sizes, mixed = cc.capture_sizes(max_seqs), cc.mixed_capture_sizes(max_tokens, max_seqs)
    cg = CudaGraphRunner(None, [], sizes, max_model_len=64, max_blocks_per_req=4, device=DEV,
                         mixed_sizes=mixed, vocab_size=10, dtype=torch.float16)
    rows = cc.graph_output_rows(max_seqs, max_tokens)
    assert cg.logits.shape == (rows, 10) and rows == max(sizes + [r for _, r in mixed])
    assert rows < sum(sizes) + sum(r for _, r in mixed)
    cg.graphs, cg.mixed_graphs = {(s, 1): None for s in sizes}, {t: None for t, _ in mixed}
    for key in [GraphKey(s, 1) for s in sizes] + [GraphKey(t, 0) for t, _ in mixed]:
        t, r = cg.tokens_and_reqs(key)
        assert (t if key.q else r) <= rows     # each graph's logits fit the shared buffer
