"""Unverified drafts (core/shadow_drafts.py): scored against the tokens that follow exactly as a verify step
would have scored them."""
from __future__ import annotations

from tokenmill.core.shadow_drafts import ShadowDrafts


def test_a_run_of_matches_ends_at_the_first_mismatch():
    s = ShadowDrafts()
    s.step("a", [10], [11, 12, 13])           # proposed after 10
    s.step("a", [11], [99])                   # matches the first draft; the pending run continues (99 unused)
    s.step("a", [12], [98])
    assert s.samples == 0
    s.step("a", [7], [8, 9])                  # 13 expected: a verify step would have kept 11, 12 and drawn 7
    assert s.samples == 1 and s.tokens_per_step() == 3.0
    s.step("a", [5], [])                      # 8 expected: nothing accepted; no proposal after 5
    assert s.samples == 3 and abs(s.tokens_per_step() - (3 + 1 + 1) / 3) < 1e-12   # no proposal: one token


def test_a_fully_matched_run_ends_with_the_verify_steps_own_draw():
    s = ShadowDrafts()
    s.step("a", [1], [2, 3])
    s.step("a", [2], None)
    s.step("a", [3], None)
    assert s.samples == 0                     # all drafts matched: the next token is the verify step's own draw
    s.step("a", [4], None)
    assert s.samples == 1 and s.tokens_per_step() == 3.0


def test_requests_are_scored_apart_and_forgotten():
    s = ShadowDrafts(history=2)
    s.step("a", [1], [2])
    s.step("b", [5], [6])
    s.step("b", [6], [0])
    s.step("a", [9], [0])                     # a's 2 rejected, b's 6 accepted: runs are per request
    assert s.samples == 1
    s.forget("b")
    s.step("b", [7], [1])                     # b's pending run is gone: nothing scored, a new run starts
    assert s.samples == 1 and s.active
    s.step("a", [3], [0])
    s.step("a", [3], [0])
    assert s.samples == 2                     # the history keeps the latest would-be steps only
    s.reset()
    assert not s.active and s.tokens_per_step() == 1.0
