"""Which data-parallel engine core gets a new request: the least loaded one, unless a recent request with the same
prompt prefix went to an engine that is not clearly busier (its prefix cache probably holds those blocks)."""
from __future__ import annotations

from collections import OrderedDict
from typing import Sequence

from tokenmill.core.messages import SchedulerStats


class DPLoadBalancer:
    """Routes requests over `num_engines` engine cores by queue length and prefix-cache affinity.

    Load. `load(e) = reported(e) + routed(e)`, where `reported(e)` is waiting + running from the last
    SchedulerStats engine `e` sent (`record_stats`) and `routed(e)` counts the sequences this client routed to `e`
    since that report (a report resets it: the engine had already seen them, or sees them in its next step).

    Affinity. The prompt's first `affinity_blocks` *full* blocks of `block_size` tokens are hashed as a chain
    (h1 = hash(block 1), h2 = hash(h1, block 2), ...); the `capacity` most recently routed chain hashes remember the
    engine they went to. The affine engine A is the one remembered for the longest matching chain hash. The exact
    rule of `choose`:
      - with an affine engine A and `load(A) <= min_load + max(slack, slack_frac * min_load)`, pick A;
      - otherwise pick the least-loaded engine (ties: the lowest index).
    The request's chain hashes then point at the picked engine. Prompts shorter than one block have no affinity
    (the prefix cache only shares full blocks); `affinity_blocks=0` turns affinity off.
    """

    def __init__(self, num_engines: int, block_size: int, affinity_blocks: int = 4, slack: int = 2,
                 slack_frac: float = 0.25, capacity: int = 16384) -> None:
        if num_engines < 1:
            raise ValueError("DPLoadBalancer needs at least one engine.")
        self.num_engines = num_engines
        self.block_size = block_size
        self.affinity_blocks = affinity_blocks
        self.slack, self.slack_frac = slack, slack_frac
        self.capacity = capacity
        self.reported = [0] * num_engines
        self.routed = [0] * num_engines
        self._recent: OrderedDict[int, int] = OrderedDict()  # chain hash -> engine, least recently routed first

    def load(self, engine: int) -> int:
        return self.reported[engine] + self.routed[engine]

    def record_stats(self, engine: int, stats: SchedulerStats) -> None:
        self.reported[engine] = stats.num_waiting_reqs + stats.num_running_reqs
        self.routed[engine] = 0

    def prefix_hashes(self, prompt_token_ids: Sequence[int]) -> list[int]:
        bs = self.block_size
        n = min(self.affinity_blocks, len(prompt_token_ids) // bs)
        out, h = [], 0
        for i in range(n):
            h = hash((h, tuple(prompt_token_ids[i * bs:(i + 1) * bs])))
            out.append(h)
        return out

    def affine_engine(self, hashes: list[int]) -> int | None:
        for h in reversed(hashes):  # the longest shared prefix wins
            engine = self._recent.get(h)
            if engine is not None:
                return engine
        return None

    def choose(self, prompt_token_ids: Sequence[int], num_seqs: int = 1) -> int:
        """Picks the engine for a request of `num_seqs` sequences (n > 1 shares one prompt, so one engine) and
        counts them as routed there."""
        loads = [self.load(e) for e in range(self.num_engines)]
        least = min(range(self.num_engines), key=loads.__getitem__)
        hashes = self.prefix_hashes(prompt_token_ids) if self.affinity_blocks else []
        engine = least
        affine = self.affine_engine(hashes) if hashes else None
        if affine is not None:
            min_load = loads[least]
            if loads[affine] <= min_load + max(self.slack, self.slack_frac * min_load):
                engine = affine
        for h in hashes:
            self._recent[h] = engine
            self._recent.move_to_end(h)
        while len(self._recent) > self.capacity:
            self._recent.popitem(last=False)
        self.routed[engine] += num_seqs
        return engine
