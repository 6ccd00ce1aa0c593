"""The decode graphs' input staging (worker/cuda_graph.py), checked on the CPU: one buffer holds every per-step
input at fixed offsets, padding rows are inert, the block table is copied only when it changed, and only the small
decode graphs take the in-graph draw. (Capture and replay need CUDA: tests/gpu.)"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from tokenmill.worker.cuda_graph import SAMPLE_IN_GRAPH_MAX_SIZE, CudaGraphRunner


@pytest.fixture
def runner():
    cg = CudaGraphRunner(None, [], [1, 2, 4, 8, 16, 24], max_model_len=64, max_blocks_per_req=4,
                         device=torch.device("cpu"), mixed_sizes=[(16, 8)])
    cg.graphs = {s: None for s in cg.sizes}   # as if captured
    return cg


def test_decode_inputs_land_in_their_buffers(runner):
    race = (np.array([7, 8, 9]), np.array([1, 2, 3]), np.array([0.5, 1.0, 2.0], dtype=np.float32))
    size = runner.load_inputs(np.array([5, 6, 7]), np.array([10, 11, 12]), np.array([100, 101, 102]),
                              np.array([11, 12, 13]), np.array([[1, 2], [3, 4], [5, 6]], dtype=np.int32),
                              np.array([-1, 0, 1]), race)
    assert size == 4
    assert runner.input_ids[:4].tolist() == [5, 6, 7, 0] and runner.positions[:4].tolist() == [10, 11, 12, 0]
    assert runner.slot_mapping[:4].tolist() == [100, 101, 102, -1]      # the padding row stores nothing
    assert runner.fix_src[:4].tolist() == [-1, 0, 1, -1]
    assert runner.seq_lens[:4].tolist() == [11, 12, 13, 0]               # ... and attends to nothing
    assert runner.race_seeds[:3].tolist() == [7, 8, 9] and runner.race_pos[:3].tolist() == [1, 2, 3]
    assert runner.race_temp[:4].tolist() == [0.5, 1.0, 2.0, 1.0] and runner.race_flag.item() == 1
    assert runner.block_table[:3, :2].tolist() == [[1, 2], [3, 4], [5, 6]]
    # The next step without the draw (a row that is not plain): the flag goes off, no placeholders.
    runner.load_inputs(np.array([9]), np.array([13]), np.array([103]), np.array([14]),
                       np.array([[1, 2]], dtype=np.int32))
    assert runner.race_flag.item() == 0 and runner.fix_src[0].item() == -1 and runner.seq_lens[0].item() == 14


def test_block_table_copied_only_when_changed(runner, monkeypatch):
    import tokenmill.worker.cuda_graph as cgm
    copies = []
    bt = np.array([[4, 5], [6, 7]], dtype=np.int32)
    args = (np.array([1, 2]), np.array([3, 4]), np.array([5, 6]), np.array([7, 8]))
    orig = cgm._pinned
    monkeypatch.setattr(cgm, "_pinned", lambda a: copies.append(a.copy()) or orig(a))
    runner.load_inputs(*args, bt)
    runner.load_inputs(*args, bt.copy())
    assert len(copies) == 1
    bt[1, 1] = 9                                   # a request moved to a new block
    runner.load_inputs(*args, bt)
    assert len(copies) == 2 and runner.block_table[1, 1].item() == 9
    runner.load_inputs(*args, bt[:, :1].copy())    # a narrower table that the device already holds
    assert len(copies) == 2


def test_mixed_load_keeps_its_layout(runner):
    runner.load_mixed(16, np.arange(9) + 100, np.arange(9), np.arange(9) + 50, np.array([0, 3, 4, 9]),
                      np.array([10, 5, 5]), np.array([[7, 8], [9, 9], [1, 1]], dtype=np.int32),
                      np.array([-1] * 8 + [2]))
    assert runner.input_ids[:10].tolist() == list(range(100, 109)) + [0]
    assert runner.slot_mapping[9:16].tolist() == [-1] * 7
    assert runner.fix_src[:10].tolist() == [-1] * 8 + [2, -1]
    assert runner.mixed_ints[:9].tolist() == [0, 3, 4, 9, 9, 9, 9, 9, 9]
    assert runner.block_table[:3, :2].tolist() == [[7, 8], [9, 9], [1, 1]]


def test_only_small_decode_graphs_sample(runner):
    assert runner.can_sample(1, 1) and runner.can_sample(SAMPLE_IN_GRAPH_MAX_SIZE, SAMPLE_IN_GRAPH_MAX_SIZE)
    assert not runner.can_sample(SAMPLE_IN_GRAPH_MAX_SIZE + 1, SAMPLE_IN_GRAPH_MAX_SIZE + 1)
    assert not runner.can_sample(3, 5)             # not a decode batch
    with pytest.raises(ValueError, match="does not sample"):
        n = SAMPLE_IN_GRAPH_MAX_SIZE + 1
        runner.load_inputs(np.arange(n), np.arange(n), np.arange(n), np.arange(n), np.zeros((n, 1), np.int32),
                           None, (np.arange(n), np.arange(n), np.ones(n, np.float32)))


@pytest.fixture
def io_runner():
    cg = CudaGraphRunner(None, [], [1, 2, 4, 8, 16, 24], max_model_len=64, max_blocks_per_req=4,
                         device=torch.device("cpu"), mixed_sizes=[(16, 8)], host_io=True)
    cg.graphs = {s: None for s in cg.sizes}
    return cg


def test_small_decode_graphs_take_their_inputs_from_the_host_ring(io_runner):
    """Decode graphs of up to SAMPLE_IN_GRAPH_MAX_SIZE rows: the step's inputs go to the next slot of the host
    ring (the graph's first kernel copies them, tests/kernels/test_triton_step_inputs.py), padding rows inert."""
    io = io_runner.host_io
    race = (np.array([7, 8, 9]), np.array([1, 2, 3]), np.array([0.5, 1.0, 2.0], dtype=np.float32))
    arena_before = io_runner._arena.clone()
    size = io_runner.load_inputs(np.array([5, 6, 7]), np.array([10, 11, 12]), np.array([100, 101, 102]),
                                 np.array([11, 12, 13]), np.array([[1, 2], [3, 4], [5, 6]], dtype=np.int32),
                                 np.array([-1, 0, 1]), race)
    assert size == 4 and io_runner.last_io_slot == 0
    assert torch.equal(io_runner._arena, arena_before)       # no copy into the device buffers
    v = io.ints[0, :, :4].tolist()
    assert v[:7] == [[5, 6, 7, 0], [10, 11, 12, 0], [100, 101, 102, -1], [-1, 0, 1, -1], [7, 8, 9, 0],
                     [1, 2, 3, 0], [11, 12, 13, 0]]
    assert v[7][0] == 1 and io.temps[0, :4].tolist() == [0.5, 1.0, 2.0, 1.0]
    assert io_runner.block_table[:3, :2].tolist() == [[1, 2], [3, 4], [5, 6]]   # the block table still copied
    io_runner.load_inputs(np.array([9]), np.array([13]), np.array([103]), np.array([14]),
                          np.array([[1, 2]], dtype=np.int32))
    assert io_runner.last_io_slot == 1 and io.ints[1, 7, 0].item() == 0 and io.ints[1, 3, 0].item() == -1
    for want in (2, 3, 0):
        io_runner.load_inputs(np.array([9]), np.array([13]), np.array([103]), np.array([14]),
                              np.array([[1, 2]], dtype=np.int32))
        assert io_runner.last_io_slot == want


def test_larger_decode_graphs_keep_the_device_copy(io_runner):
    n = SAMPLE_IN_GRAPH_MAX_SIZE + 1
    size = io_runner.load_inputs(np.arange(n) + 3, np.arange(n), np.arange(n), np.arange(n) + 1,
                                 np.zeros((n, 1), np.int32))
    assert size == 24 and io_runner.last_io_slot is None and io_runner.host_io.count == 0
    assert io_runner.input_ids[:n].tolist() == list(range(3, n + 3))


def test_a_mixed_batch_has_no_host_io_slot(io_runner):
    io_runner.mixed_graphs = {16: None}
    bt = np.array([[1, 2]], dtype=np.int32)
    assert io_runner.load(np.array([4]), np.array([5]), np.array([6]), np.array([0, 1]), np.array([6]), bt) \
        == (False, 1)
    assert io_runner.last_io_slot == 0
    assert io_runner.load(np.arange(3), np.arange(3), np.arange(3), np.array([0, 3]), np.array([3]), bt) == (True, 16)
    assert io_runner.last_io_slot is None and io_runner.host_io.count == 1
