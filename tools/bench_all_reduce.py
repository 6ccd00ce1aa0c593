"""TP all-reduce latency on this host's first two GPUs: NCCL vs the one-shot symmetric-memory kernel, each call
replayed from a CUDA graph of 64 back-to-back all-reduces (as in a decode step). Picks symm_all_reduce.MAX_BYTES.
Usage (GPU machine): python3 tools/bench_all_reduce.py"""
from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

SIZES_KB = (8, 16, 64, 256, 512, 1024, 2048, 4096)
CALLS = 64


def _time_graph(fn, x, reps: int = 20) -> float:
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn(x)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = x
        for _ in range(CALLS):
            y = fn(y) * 0.5  # keep values bounded; the multiply is timed in both variants
    g.replay()
    torch.cuda.synchronize()
    dist.barrier()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        g.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / (reps * CALLS)


def _run(rank: int, world: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), NCCL_NVLS_ENABLE="0",
                      TORCH_SYMM_MEM_DISABLE_MULTICAST="1")
    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=dev)
    from tokenmill.distributed.symm_all_reduce import SymmetricAllReduce
    fast = SymmetricAllReduce(dist.group.WORLD, dev, max_bytes=max(SIZES_KB) << 10)
    big = fast.buffer

    def nccl(x):
        dist.all_reduce(x)
        return x

    def two_kernel(x):
        staged = big[:x.numel() * x.element_size()].view(x.dtype).view(x.shape)
        staged.copy_(x)
        return torch.ops.symm_mem.one_shot_all_reduce(staged, "sum", dist.group.WORLD.group_name)

    rows = []
    for kb in SIZES_KB:
        x = torch.randn((kb << 10) // 2, dtype=torch.bfloat16, device=dev)
        ref = x.float().clone()
        dist.all_reduce(ref)
        got = fast.reduce(x)
        err = (got.float() - ref).abs().max().item()
        rows.append((kb, _time_graph(nccl, x.clone()), _time_graph(fast.reduce, x.clone()),
                     _time_graph(two_kernel, x.clone()), err))
    if rank == 0:
        print(f"{'KB':>6} {'nccl us':>9} {'one-shot(copy) us':>18} {'copy+one-shot us':>17} {'max err':>8}")
        for kb, a, b, c, e in rows:
            print(f"{kb:>6} {a:>9.2f} {b:>18.2f} {c:>17.2f} {e:>8.3g}")
    dist.barrier()
    os._exit(0)  # NCCL teardown after graph capture can hang (pytorch#115388)


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    mp.spawn(_run, args=(2, 29517), nprocs=2, join=True)
