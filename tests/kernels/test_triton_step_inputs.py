"""A small decode graph's first kernel: it copies the host ring's slot k mod S into the graph's device buffers on
its k-th run (placeholder ids taken from the previous step's draw), and the draw writes its ids back to that slot.
On CUDA the ring is pinned host memory read and written by the kernels in place."""
from __future__ import annotations

import torch

from tests.kernels.kernel_check import DEV
from tokenmill.kernels.triton_sampling import race_argmax
from tokenmill.kernels.triton_step_inputs import HostStepIO


def _buffers(width: int):
    vec = torch.full((6, 24), -7, dtype=torch.long, device=DEV)     # wider than the ring, as the graph's arena is
    seq = torch.full((24,), -7, dtype=torch.int32, device=DEV)
    temp = torch.full((24,), -7.0, dtype=torch.float32, device=DEV)
    flag = torch.full((1,), -7, dtype=torch.int32, device=DEV)
    return vec, seq, temp, flag


def _fill(io: HostStepIO, slot: int, g: torch.Generator, n: int, flag: int) -> None:
    io.ints[slot, :7, :n] = torch.randint(-1, 1 << 40, (7, n), generator=g)
    io.ints[slot, 3, :n] = torch.randint(-1, 3, (n,), generator=g)        # placeholder sources (-1: none)
    io.ints[slot, 6, :n] %= 1 << 20                                        # context lengths fit int32
    io.ints[slot, 7, 0] = flag
    io.temps[slot, :n] = torch.rand(n, generator=g) + 0.1


def test_each_run_loads_the_next_slot():
    g = torch.Generator().manual_seed(0)
    io = HostStepIO(16, DEV)
    prev = torch.tensor([111, 222, 333], device=DEV)
    vec, seq, temp, flag = _buffers(16)
    for step, (size, n) in enumerate([(4, 3), (16, 16), (1, 1), (8, 5), (2, 2), (4, 4)]):
        slot = io.next_slot()
        assert slot == step % io.NUM_SLOTS
        _fill(io, slot, g, n, flag=step % 2)
        io.ints[slot, :7, n:size] = torch.tensor([0, 0, -1, -1, 0, 0, 0]).unsqueeze(1)   # padding, as the host
        io.temps[slot, n:size] = 1.0
        before = vec.clone()
        io.load(size, vec, seq, temp, flag, prev)
        host = io.ints[slot]
        src = host[3, :size]
        ids = torch.where(src >= 0, prev.cpu()[src.clamp_min(0)], host[0, :size])
        assert torch.equal(vec[0, :size].cpu(), ids)
        assert torch.equal(vec[1:6, :size].cpu(), host[1:6, :size])
        assert torch.equal(vec[:, size:].cpu(), before[:, size:].cpu())                  # nothing past size
        assert torch.equal(seq[:size].cpu(), host[6, :size].to(torch.int32))
        assert torch.equal(temp[:size].cpu(), io.temps[slot, :size])
        assert flag.item() == step % 2 and io.slot.item() == slot and io.counter.item() == step + 1


def test_sync_sets_the_device_counter_to_the_host_count():
    io = HostStepIO(16, DEV)
    vec, seq, temp, flag = _buffers(16)
    prev = torch.zeros(1, dtype=torch.long, device=DEV)
    for _ in range(3):                     # runs outside the engine's loop (capture's warm-up, tools)
        io.load(1, vec, seq, temp, flag, prev)
    io.sync()
    assert io.counter.item() == 0
    io.next_slot()
    io.next_slot()
    io.sync()
    io.load(1, vec, seq, temp, flag, prev)
    assert io.slot.item() == 2


def test_untouched_slots_are_inert():
    """Capture's warm-up runs read slots the host never filled: no KV slot, no placeholder, the draw off."""
    io = HostStepIO(16, DEV)
    vec, seq, temp, flag = _buffers(16)
    io.load(16, vec, seq, temp, flag, torch.zeros(1, dtype=torch.long, device=DEV))
    assert (vec[2, :16] == -1).all() and (vec[3, :16] == -1).all() and (seq[:16] == 0).all()
    assert flag.item() == 0 and (temp[:16] == 1.0).all()


def test_draw_writes_its_ids_to_the_slot():
    g = torch.Generator().manual_seed(3)
    io = HostStepIO(16, DEV)
    logits = torch.randn(3, 3000, generator=g).to(DEV)
    seeds, pos = torch.tensor([5, 6, 7], device=DEV), torch.tensor([1, 2, 3], device=DEV)
    flag = torch.ones(1, dtype=torch.int32, device=DEV)
    io.slot.fill_(2)
    out = race_argmax(logits, seeds, pos, out=torch.empty(3, dtype=torch.long, device=DEV), flag=flag,
                      host_out=io.out, host_slot=io.slot)
    if DEV.type == "cuda":
        torch.cuda.synchronize()
    assert torch.equal(io.out[2, :3], out.cpu())
    assert (io.out[[0, 1, 3]] == 0).all() and (io.out[2, 3:] == 0).all()
    flag.zero_()                           # the draw is off: the slot keeps its contents
    io.slot.fill_(0)
    race_argmax(logits, seeds, pos, out=out, flag=flag, host_out=io.out, host_slot=io.slot)
    if DEV.type == "cuda":
        torch.cuda.synchronize()
    assert (io.out[0] == 0).all()
