"""The one-shot symmetric-memory all-reduce: which tensors take it (CPU), and on two GPUs that it sums like NCCL,
eagerly and replayed from a CUDA graph."""
from __future__ import annotations

import os
import socket

import pytest
import torch

from tokenmill.distributed.symm_all_reduce import (MAX_BYTES, SymmetricAllReduce, enable_symmetric_all_reduce,
                                                   group_hosts)

pytestmark = pytest.mark.timeout(180)


def _bare(device: torch.device, max_bytes: int = MAX_BYTES) -> SymmetricAllReduce:
    """The object without its symmetric buffer: enough to ask `can_reduce`."""
    ar = SymmetricAllReduce.__new__(SymmetricAllReduce)
    ar.device, ar.max_bytes = device, max_bytes
    return ar


def test_only_small_aligned_fp32_bf16_contiguous_tensors_take_the_one_shot_path():
    dev = torch.device("cpu")
    ar = _bare(dev, max_bytes=4096)
    assert ar.can_reduce(torch.zeros(8, 128, dtype=torch.bfloat16))          # 2 KiB
    assert ar.can_reduce(torch.zeros(1024, dtype=torch.float32))             # exactly max_bytes
    assert not ar.can_reduce(torch.zeros(1025, dtype=torch.float32))         # over
    assert not ar.can_reduce(torch.zeros(8, 128, dtype=torch.float16))       # the kernel has no fp16
    assert not ar.can_reduce(torch.zeros(3, dtype=torch.bfloat16))           # 6 bytes: not 16-byte aligned
    assert not ar.can_reduce(torch.zeros(0, dtype=torch.bfloat16))
    assert not ar.can_reduce(torch.zeros(128, 8, dtype=torch.bfloat16).t())  # not contiguous
    assert not _bare(torch.device("cuda", 0)).can_reduce(torch.zeros(8, dtype=torch.float32))  # other device


def test_cpu_devices_keep_the_collective_backend():
    assert enable_symmetric_all_reduce(None, None, torch.device("cpu")) is None


def _hosts_worker(rank: int, port: int, fake_host: bool, results) -> None:
    import socket as _socket

    import torch.distributed as dist
    if fake_host and rank == 1:
        _socket.gethostname = lambda: "another-node"
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    results[rank] = sorted(group_hosts(dist.group.WORLD))
    dist.destroy_process_group()


@pytest.mark.parametrize("fake_host", [False, True])
def test_group_hosts_sees_every_rank(fake_host):
    """The one-shot path needs every TP rank on this host; a group across nodes keeps NCCL."""
    import torch.multiprocessing as mp
    ctx = mp.get_context("spawn")
    with ctx.Manager() as mgr:
        results = mgr.dict()
        port = _free_port()
        procs = [ctx.Process(target=_hosts_worker, args=(r, port, fake_host, results)) for r in range(2)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(60)
        assert all(p.exitcode == 0 for p in procs)
        got = dict(results)
    assert got[0] == got[1] and len(got[0]) == (2 if fake_host else 1)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _two_gpu_worker(rank: int, port: int, results) -> None:
    import torch.distributed as dist
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), NCCL_NVLS_ENABLE="0")
    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    dist.init_process_group("nccl", rank=rank, world_size=2, device_id=dev)
    cpu = dist.new_group([0, 1], backend="gloo")
    ar = enable_symmetric_all_reduce(dist.group.WORLD, cpu, dev)
    assert ar is not None
    gen = torch.Generator(device=dev).manual_seed(1234 + rank)
    errors = []
    for shape, dtype in (((1, 4096), torch.bfloat16), ((7, 1024), torch.float32), ((128, 4096), torch.bfloat16),
                         ((3, 896), torch.float32)):
        x = torch.randn(shape, dtype=dtype, device=dev, generator=gen)
        assert ar.can_reduce(x)
        ref = x.clone()
        dist.all_reduce(ref)
        got = ar.reduce(x)
        errors.append((str(shape), str(dtype), (got.float() - ref.float()).abs().max().item(), x.data_ptr() !=
                       got.data_ptr()))
    # Replayed from a graph: new input values each replay, several reductions back to back through one buffer.
    x = torch.zeros(4, 2048, dtype=torch.bfloat16, device=dev)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        ar.reduce(x)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        a = ar.reduce(x)
        b = ar.reduce(a * 2)
    for step in range(3):
        x.copy_(torch.randn(x.shape, dtype=x.dtype, device=dev, generator=gen))
        ref_a = x.clone()
        dist.all_reduce(ref_a)
        ref_b = ref_a * 2
        dist.all_reduce(ref_b)
        g.replay()
        torch.cuda.synchronize()
        errors.append((f"graph step {step}", "torch.bfloat16", max((a.float() - ref_a.float()).abs().max().item(),
                                                         (b.float() - ref_b.float()).abs().max().item()), True))
    results[rank] = errors
    dist.barrier(cpu)
    os._exit(0)  # NCCL teardown after a graph capture can hang (pytorch#115388); the parent reads `results`


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_one_shot_all_reduce_equals_nccl_on_two_gpus():
    import torch.multiprocessing as mp
    ctx = mp.get_context("spawn")
    with ctx.Manager() as mgr:
        results = mgr.dict()
        port = _free_port()
        procs = [ctx.Process(target=_two_gpu_worker, args=(r, port, results)) for r in range(2)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(150)
        assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
        got = dict(results)
    for rank in (0, 1):
        for name, dtype, err, fresh in got[rank]:
            # Two-operand fp32 sums are order-free, so exactly NCCL's; bf16 may round once differently (1 ulp is
            # 2^-7 relative; |values| < 16 here).
            assert err <= (0.0 if "float32" in dtype else 16 * 2 ** -7), (rank, name, dtype, err)
            assert fresh, (rank, name)
