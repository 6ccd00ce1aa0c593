"""Recurrent-state checkpoints (prefix caching on hybrid models): which boundaries are saved, when a saved one
becomes usable, and least-recently-used eviction that never hands out a slot read in the same step."""
from __future__ import annotations

from tokenmill.core.state_checkpoints import StateCheckpoints


def test_boundaries_are_stride_multiples_and_the_prompts_last_full_block():
    c = StateCheckpoints(4, block_size=4, stride_blocks=2)
    # A 23-token prompt: full blocks end at 4, 8, ..., 20; saved at 8, 16 (every 2nd block) and 20 (the last).
    assert c.boundaries(0, 23, 23, 5) == [8, 16, 20]
    assert c.boundaries(8, 17, 23, 5) == [16]          # (start, end]: 8 itself was saved by the chunk before
    assert c.boundaries(0, 23, 23, 3) == [8, 12]       # only hashed blocks count
    assert c.boundaries(20, 30, 23, 7) == []           # output tokens are never checkpointed


def test_a_checkpoint_is_usable_from_the_next_step_and_hits_end_at_one():
    c = StateCheckpoints(4, block_size=4)
    c.begin_step()
    slot = c.reserve(b"h2")
    assert slot is not None and c.reserve(b"h2") is None   # one slot per hash
    assert c.ready(b"h2") is None                           # written by this very step's forward
    c.begin_step()
    hashes = [b"h1", b"h2", b"h3"]
    ends = c.ends_hit(hashes)
    assert [ends(n) for n in (1, 2, 3)] == [False, True, False]   # a 3-block hit shortens to 2 blocks
    assert c.ready(b"h2") == slot
    assert c.ready(b"h9") is None


def test_eviction_takes_the_least_recently_used_slot_not_read_this_step():
    c = StateCheckpoints(2, block_size=4)
    c.begin_step()
    a, b = c.reserve(b"a"), c.reserve(b"b")
    c.begin_step()
    assert c.ready(b"a") == a                 # a: read this step, so b is the one to go
    assert c.reserve(b"c") == b
    assert c.reserve(b"d") is None            # a was read and c is being written: nothing to evict this step
    c.begin_step()
    assert c.ready(b"b") is None and c.ready(b"c") == b
