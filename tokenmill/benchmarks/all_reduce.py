"""`tokenmill bench all-reduce`: tensor-parallel all-reduce latency on this host's GPUs (CUDA, 2+ GPUs).

For each message size, every rank captures CALLS back-to-back all-reduces of a bf16 tensor in one CUDA graph (as
a decode step issues them) and times the graph's replays: NCCL against the one-shot symmetric-memory kernel that
`tokenmill/distributed/symm_all_reduce.py` uses for messages up to its MAX_BYTES. Each call is followed by a
scaling kernel (keeps the values bounded), timed in both. Prints microseconds per call and the symmetric
kernel's largest deviation from NCCL's sum; the crossover says where MAX_BYTES belongs.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

from tokenmill.benchmarks.offline_common import require_cuda, write_json


def make_parser(prog: str = "tokenmill bench all-reduce") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world-size", type=int, default=2, help="GPUs (ranks) to reduce over (default 2).")
    p.add_argument("--sizes-kb", type=parse_sizes, default=parse_sizes("8,16,64,256,512,1024,2048,4096"),
                   help="Comma-separated message sizes in KiB (default 8,16,64,256,512,1024,2048,4096).")
    p.add_argument("--calls", type=int, default=64, help="All-reduces captured per graph (default 64).")
    p.add_argument("--replays", type=int, default=20, help="Timed replays per graph (default 20).")
    p.add_argument("--port", type=int, default=29517, help="Rendezvous port on 127.0.0.1.")
    p.add_argument("--output-json", default=None, help="Write the rows here as JSON.")
    return p


def parse_sizes(text: str) -> list[int]:
    """'8,16,64' -> [8, 16, 64]; each a positive multiple of 1 KiB that holds whole bf16 elements."""
    try:
        sizes = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma-separated list of integers: {text!r}") from None
    if not sizes or min(sizes) <= 0:
        raise argparse.ArgumentTypeError(f"sizes must be positive KiB counts, got {text!r}")
    return sizes


def _time_graph(fn, x, calls: int, replays: int) -> float:
    import torch
    import torch.distributed as dist
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside the capture (NCCL and symm-mem set up lazily)
        for _ in range(3):
            fn(x)
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = x
        for _ in range(calls):
            y = fn(y) * 0.5
    g.replay()
    torch.cuda.synchronize()
    dist.barrier()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        g.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / (replays * calls)


def _rank(rank: int, args: argparse.Namespace, result_path: str) -> None:
    import torch
    import torch.distributed as dist
    from tokenmill import envs
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port))
    # The engine's workers run with NVLink multicast off unless the user chose otherwise; so do these ranks.
    os.environ.setdefault(envs.NCCL_NVLS_ENABLE_NAME, "0")
    os.environ.setdefault(envs.TORCH_SYMM_MEM_DISABLE_MULTICAST_NAME, "1")
    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    dist.init_process_group("nccl", rank=rank, world_size=args.world_size, device_id=dev)
    from tokenmill.distributed.symm_all_reduce import SymmetricAllReduce
    fast = SymmetricAllReduce(dist.group.WORLD, dev, max_bytes=max(args.sizes_kb) << 10)

    def nccl(x):
        dist.all_reduce(x)
        return x

    rows = []
    for kb in args.sizes_kb:
        x = torch.randn((kb << 10) // 2, dtype=torch.bfloat16, device=dev)
        ref = x.float().clone()
        dist.all_reduce(ref)
        err = (fast.reduce(x).float() - ref).abs().max().item()
        rows.append({"kb": kb, "nccl_us": _time_graph(nccl, x.clone(), args.calls, args.replays),
                     "symm_us": _time_graph(fast.reduce, x.clone(), args.calls, args.replays), "max_abs_err": err})
    if rank == 0:
        with open(result_path, "w") as f:
            json.dump(rows, f)
    dist.barrier()
    os._exit(0)  # NCCL's teardown after graph capture can hang (pytorch/pytorch#115388); the process ends here


def format_rows(rows: list[dict]) -> str:
    lines = [f"{'KiB':>6} {'NCCL us':>9} {'symmetric us':>13} {'max abs err':>12}"]
    lines += [f"{r['kb']:>6} {r['nccl_us']:>9.2f} {r['symm_us']:>13.2f} {r['max_abs_err']:>12.3g}" for r in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict]:
    parser = make_parser()
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    if args.world_size < 2:
        parser.error(f"--world-size must be at least 2, got {args.world_size}")
    if args.calls < 1 or args.replays < 1:
        parser.error("--calls and --replays must be positive")
    require_cuda(parser.prog, args.world_size)
    import tempfile

    import torch.multiprocessing as mp
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "rows.json")
        mp.spawn(_rank, args=(args, path), nprocs=args.world_size, join=True)
        with open(path) as f:
            rows = json.load(f)
    print(format_rows(rows))
    write_json(args.output_json, {"world_size": args.world_size, "calls": args.calls, "rows": rows})
    return rows


if __name__ == "__main__":
    main()
