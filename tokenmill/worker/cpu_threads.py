"""How many intra-op threads a CPU worker runs and on which cores (vLLM's VLLM_CPU_OMP_THREADS_BIND).

On a small machine the engine shares its cores with the API server process (HTTP, tokenize, detokenize) and the
client. OpenMP threads spin at their barriers, so a thread descheduled by another process can stall a product; yet
end to end the engine's share of every core wins: `tokenmill serve` on 2 cores with chat clients on the same
machine (64-token answers) measured 33.2-33.8 completion tok/s for one stream with 2 engine threads against
31.0-31.7 with 1, 120-121 against 89-94 at 16 streams and 173 against 127 at 32. So `auto` uses every CPU, beside an
API server as offline.

VLLM_CPU_OMP_THREADS_BIND:
- `auto` (default): this process's allowed CPUs, split evenly between the ranks; threads = that share; no
  pinning.
- `nobind`: torch's own thread count, no pinning.
- a CPU list such as `0-1` or `0,2,4` (ranks separated by `|`: `0-1|2-3`): the rank is pinned to its list
  (os.sched_setaffinity) and runs one thread per CPU in it.
TOKENMILL_CPU_NUM_THREADS > 0 sets the thread count in every mode.
"""
from __future__ import annotations

import os

import torch

from tokenmill import envs

# Set by the engine-core process entry point: an API server process runs beside this engine on the same CPUs (said
# in the start-up line).
FRONTEND_SHARES_CPUS = False


def parse_cpu_list(text: str) -> list[int]:
    """'0-2,5' -> [0, 1, 2, 5]; ValueError naming VLLM_CPU_OMP_THREADS_BIND for anything else."""
    cpus: list[int] = []
    try:
        for part in text.split(","):
            lo, dash, hi = part.strip().partition("-")
            first, last = int(lo), int(hi if dash else lo)
            if first < 0 or last < first:
                raise ValueError
            cpus.extend(range(first, last + 1))
    except ValueError:
        raise ValueError(f"VLLM_CPU_OMP_THREADS_BIND={text!r}: expected auto, nobind or a CPU list such as 0-1 or "
                         "0,2,4 (ranks separated by |)") from None
    return sorted(set(cpus))


def _allowed_cpus() -> list[int]:
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def configure_cpu_threads(rank: int = 0, world_size: int = 1) -> str:
    """Apply VLLM_CPU_OMP_THREADS_BIND / TOKENMILL_CPU_NUM_THREADS to this process; returns the start-up log line."""
    bind = envs.VLLM_CPU_OMP_THREADS_BIND.strip() or "auto"
    forced = envs.TOKENMILL_CPU_NUM_THREADS
    pinned = None
    if bind == "nobind":
        threads, why = forced or torch.get_num_threads(), "torch's default"
    elif bind == "auto":
        cpus = _allowed_cpus()
        share = max(1, len(cpus) // max(world_size, 1))
        threads = forced or share
        why = f"{len(cpus)} CPUs / {world_size} rank(s)" + (", shared with the API server" if FRONTEND_SHARES_CPUS
                                                              else "")
    else:
        lists = bind.split("|")
        if len(lists) != world_size:
            raise ValueError(f"VLLM_CPU_OMP_THREADS_BIND={bind!r} names {len(lists)} CPU list(s) for {world_size} "
                             "rank(s); give one list per rank, separated by |")
        pinned = parse_cpu_list(lists[rank])
        allowed = set(_allowed_cpus())
        if not set(pinned) <= allowed:
            raise ValueError(f"VLLM_CPU_OMP_THREADS_BIND={bind!r}: CPUs {sorted(set(pinned) - allowed)} are not "
                             f"available to this process (allowed: {sorted(allowed)})")
        os.sched_setaffinity(0, pinned)
        threads, why = forced or len(pinned), f"pinned to CPUs {pinned}"
    if forced:
        why += f", TOKENMILL_CPU_NUM_THREADS={forced}"
    torch.set_num_threads(threads)
    return (f"CPU rank {rank}: {threads} intra-op thread(s) (VLLM_CPU_OMP_THREADS_BIND={bind}: {why})"
            + ("" if pinned is not None else ", not pinned"))
