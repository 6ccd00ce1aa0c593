"""DPLoadBalancer: least (waiting + running + routed since the last report), with prefix-cache affinity."""
from __future__ import annotations

from tokenmill.core.messages import SchedulerStats
from tokenmill.engine.load_balancer import DPLoadBalancer

BS = 4


def stats(waiting: int, running: int) -> SchedulerStats:
    return SchedulerStats(num_waiting_reqs=waiting, num_running_reqs=running)


def prompt(prefix: int, length: int = 3 * BS) -> list[int]:
    """Prompts that share their first blocks when they share `prefix`; the tail differs per call."""
    prompt.counter += 1
    head = [1000 + prefix] * (length - 1)
    return head + [prompt.counter]


prompt.counter = 0


def test_queue_length_picks_least_loaded_and_counts_routed_requests():
    lb = DPLoadBalancer(3, BS, affinity_blocks=0)
    lb.record_stats(0, stats(waiting=4, running=2))
    lb.record_stats(1, stats(waiting=0, running=3))
    lb.record_stats(2, stats(waiting=1, running=1))
    assert [lb.load(e) for e in range(3)] == [6, 3, 2]
    assert lb.choose([1, 2]) == 2  # loads become 6, 3, 3
    assert lb.choose([1, 2]) == 1  # a tie goes to the lowest index: 6, 4, 3
    assert lb.choose([1, 2]) == 2  # 6, 4, 4
    assert lb.choose([5], num_seqs=3) == 1 and lb.load(1) == 7  # n=3 sequences count three times
    # A new report replaces the estimate: what was routed is in the engine's own numbers from then on.
    lb.record_stats(1, stats(waiting=1, running=0))
    assert lb.load(1) == 1 and lb.choose([9]) == 1


def test_a_burst_on_idle_engines_alternates():
    lb = DPLoadBalancer(2, BS, affinity_blocks=0)
    assert [lb.choose([i]) for i in range(6)] == [0, 1, 0, 1, 0, 1]


def test_affinity_keeps_a_shared_prefix_on_one_engine_until_it_is_clearly_busier():
    lb = DPLoadBalancer(2, BS, affinity_blocks=2, slack=2, slack_frac=0.25)
    assert lb.choose(prompt(7)) == 0
    # Same first blocks: stays on engine 0 while load(0) <= min_load + max(2, 0.25 * min_load).
    assert [lb.choose(prompt(7)) for _ in range(2)] == [0, 0]
    assert (lb.load(0), lb.load(1)) == (3, 0)
    # 3 > 0 + 2: clearly busier, so the next one goes to engine 1, and the prefix points there from now on.
    assert lb.choose(prompt(7)) == 1
    assert lb.choose(prompt(7)) == 1  # loads 3, 2
    assert lb.choose(prompt(8)) == 1  # another prefix: load alone decides (2 < 3)
    # The slack grows with the load: at min_load 20, an engine 5 requests busier keeps its prefix, 6 is too many.
    lb.record_stats(0, stats(0, 25))
    lb.record_stats(1, stats(0, 20))
    for h in lb.prefix_hashes(prompt(9)):
        lb._recent[h] = 0
    assert lb.choose(prompt(9)) == 0  # 25 <= 20 + max(2, 5); engine 0 now counts 26
    assert lb.choose(prompt(9)) == 1  # 26 > 25


def test_longest_shared_prefix_wins_and_short_prompts_have_no_affinity():
    lb = DPLoadBalancer(2, BS, affinity_blocks=3)
    a = [1] * BS + [2] * BS + [3] * BS
    b = [1] * BS + [9] * BS + [9] * BS
    ha, hb = lb.prefix_hashes(a), lb.prefix_hashes(b)
    assert len(ha) == 3 and ha[0] == hb[0] and ha[1:] != hb[1:]
    for h in ha:
        lb._recent[h] = 0
    for h in hb:  # b's first block (shared with a) now points at engine 1
        lb._recent[h] = 1
    assert lb.affine_engine(ha) == 0  # a's whole chain is on engine 0
    assert lb.affine_engine(lb.prefix_hashes([1] * BS + [2] * BS + [7] * BS)) == 0  # 2 blocks on 0 beat 1 on 1
    assert lb.affine_engine(lb.prefix_hashes([1] * BS + [5] * BS)) == 1  # only the first block matches
    assert lb.affine_engine(lb.prefix_hashes([4] * BS)) is None
    # Shorter than one block: nothing the prefix cache could share, so no affinity and nothing remembered.
    assert lb.prefix_hashes([1] * (BS - 1)) == []
    before = len(lb._recent)
    lb.choose([5] * (BS - 1))
    assert len(lb._recent) == before
    # Only the first affinity_blocks blocks count.
    assert len(lb.prefix_hashes([3] * (10 * BS))) == 3


def test_affinity_memory_is_bounded_and_can_be_off():
    lb = DPLoadBalancer(2, BS, affinity_blocks=1, capacity=8)
    for i in range(50):
        lb.choose([i] * BS)
    assert len(lb._recent) == 8
    off = DPLoadBalancer(2, BS, affinity_blocks=0)
    assert [off.choose([1] * BS) for _ in range(4)] == [0, 1, 0, 1]
