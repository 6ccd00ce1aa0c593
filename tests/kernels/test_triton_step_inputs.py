"""The graphs' first kernel: it copies the host ring's slot k mod S into the graph's device buffers on its k-th run
(placeholder ids taken from the previous step's sampled ids), and the draw writes its ids back to that slot. On
CUDA the ring is pinned host memory read and written by the kernels in place."""
from __future__ import annotations

import pytest
import torch

from tests.kernels.kernel_check import DEV
from tokenmill.kernels.triton_sampling import race_argmax
from tokenmill.kernels.triton_step_inputs import (CTX, FLAG, IDS, LAST, QSL, RPOS, SEEDS, SLOTS, SRC, HostStepIO)

WIDTH = 320   # wider than the kernel's 256-column block: the loops take two rounds


def _buffers():
    """Device buffers wider than any load below, filled with a sentinel, as the graph runner's are."""
    tok = torch.full((3, WIDTH + 8), -7, dtype=torch.long, device=DEV)
    req = torch.full((3, WIDTH + 8), -7, dtype=torch.long, device=DEV)
    qsl = torch.full((WIDTH + 8,), -7, dtype=torch.int32, device=DEV)
    seq = torch.full((WIDTH + 8,), -7, dtype=torch.int32, device=DEV)
    temp = torch.full((WIDTH + 8,), -7.0, dtype=torch.float32, device=DEV)
    flag = torch.full((1,), -7, dtype=torch.int32, device=DEV)
    return tok, req, qsl, seq, temp, flag


def _fill(io: HostStepIO, slot: int, g: torch.Generator, flag: int) -> None:
    io.ints[slot] = torch.randint(-1, 1 << 40, io.ints[slot].shape, generator=g)
    io.ints[slot, SRC] = torch.randint(-1, 3, (io.width,), generator=g)       # placeholder sources (-1: none)
    io.ints[slot, CTX] %= 1 << 20                                              # context lengths fit int32
    io.ints[slot, QSL] %= 1 << 20
    io.ints[slot, FLAG, 0] = flag
    io.temps[slot] = torch.rand(io.width, generator=g) + 0.1


@pytest.mark.parametrize("sizes", [[(4, 3), (16, 16), (1, 1), (300, 8), (2, 2), (5, 300)]])
def test_each_run_loads_the_next_slot(sizes):
    g = torch.Generator().manual_seed(0)
    io = HostStepIO(WIDTH + 1, 16, DEV)
    prev = torch.tensor([111, 222, 333], device=DEV)
    tok, req, qsl, seq, temp, flag = _buffers()
    for step, (tokens, reqs) in enumerate(sizes):
        slot = io.next_slot()
        assert slot == step % io.NUM_SLOTS
        _fill(io, slot, g, flag=step % 2)
        before = [x.clone() for x in (tok, req, qsl, seq, temp)]
        io.load(tokens, reqs, tok, req, qsl, seq, temp, flag, prev)
        host = io.ints[slot]
        src = host[SRC, :tokens]
        ids = torch.where(src >= 0, prev.cpu()[src.clamp_min(0)], host[IDS, :tokens])
        assert torch.equal(tok[0, :tokens].cpu(), ids)
        assert torch.equal(tok[1:, :tokens].cpu(), host[IDS + 1:SLOTS + 1, :tokens])
        assert torch.equal(req[0, :reqs].cpu(), host[SEEDS, :reqs]) and torch.equal(req[1, :reqs].cpu(),
                                                                                     host[RPOS, :reqs])
        assert torch.equal(req[2, :reqs].cpu(), host[LAST, :reqs])
        assert torch.equal(seq[:reqs].cpu(), host[CTX, :reqs].to(torch.int32))
        assert torch.equal(qsl[:reqs + 1].cpu(), host[QSL, :reqs + 1].to(torch.int32))
        assert torch.equal(temp[:reqs].cpu(), io.temps[slot, :reqs])
        # nothing past the graph's own columns
        for now, was, n in zip((tok, req, qsl, seq, temp), before, (tokens, reqs, reqs + 1, reqs, reqs)):
            assert torch.equal(now[..., n:].cpu(), was[..., n:].cpu())
        assert flag.item() == step % 2 and io.slot.item() == slot and io.counter.item() == step + 1


def test_sync_sets_the_device_counter_to_the_host_count():
    io = HostStepIO(16, 16, DEV)
    bufs = _buffers()
    prev = torch.zeros(1, dtype=torch.long, device=DEV)
    for _ in range(3):                     # runs outside the engine's loop (capture's warm-up, tools)
        io.load(1, 1, *bufs, prev)
    io.sync()
    assert io.counter.item() == 0
    io.next_slot()
    io.next_slot()
    io.sync()
    io.load(1, 1, *bufs, prev)
    assert io.slot.item() == 2


def test_untouched_slots_are_inert():
    """Capture's warm-up runs read slots the host never filled: no KV slot, no context, the draw off, one query
    token per request."""
    io = HostStepIO(16, 16, DEV)
    tok, req, qsl, seq, temp, flag = _buffers()
    io.load(16, 15, tok, req, qsl, seq, temp, flag, torch.zeros(1, dtype=torch.long, device=DEV))
    assert (tok[0, :16] == 0).all() and (tok[2, :16] == -1).all() and (seq[:15] == 0).all()
    assert flag.item() == 0 and (temp[:15] == 1.0).all() and qsl[:16].tolist() == list(range(16))


def test_draw_writes_its_ids_to_the_slot():
    g = torch.Generator().manual_seed(3)
    io = HostStepIO(16, 16, DEV)
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


_COMPILE = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from tokenmill.kernels.triton_step_inputs import _load_step_kernel
sig = {"ring_ptr": "*i64", "temps_ring_ptr": "*fp32", "counter_ptr": "*i64", "slot_ptr": "*i64", "tok_ptr": "*i64",
       "tok_stride": "i32", "req_ptr": "*i64", "req_stride": "i32", "qsl_ptr": "*i32", "seq_ptr": "*i32",
       "temp_ptr": "*fp32", "flag_ptr": "*i32", "prev_ptr": "*i64", "tokens": "i32", "reqs": "i32",
       "span": "i32", "NUM_SLOTS": "constexpr", "WIDTH": "constexpr", "BLOCK": "constexpr"}
src = ASTSource(fn=_load_step_kernel, signature=sig, constexprs={"NUM_SLOTS": 4, "WIDTH": 513, "BLOCK": 256})
print(sorted(triton.compile(src, target=GPUTarget("cuda", 90, 32)).asm))
"""


def test_the_kernel_compiles_for_sm90():
    """The interpreter accepts code the compiler rejects: compile for an H100/H200 target too (on the CPU, in a
    process without the interpreter; where this triton cannot, the test says so and skips)."""
    import os
    import subprocess
    import sys
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-c", _COMPILE], env=env, capture_output=True, text=True, timeout=300)
    if r.returncode != 0 and ("ImportError" in r.stderr or "ptxas" in r.stderr):
        pytest.skip(f"no sm_90 compile here: {r.stderr.strip().splitlines()[-1]}")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "ttgir" in r.stdout
