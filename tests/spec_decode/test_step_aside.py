"""The speculation gate (spec_decode/step_aside.py): it runs whichever of speculative and plain decoding it measures
faster per output token, trying the other now and then, and the engine switches between the two (speculative
steps synchronous, plain ones overlapped with async scheduling) without changing a token."""
from __future__ import annotations

import pytest

from tests.spec_decode.conftest import cycle_prompt, make_llm
from tests.spec_decode.test_greedy_exact import generate, ids, spec_counts
from tokenmill.sampling_params import SamplingParams
from tokenmill.spec_decode.step_aside import (CLEAR_STEPS, MAX_PERIOD, SHADOW_MIN_SAMPLES, SHADOW_MIN_STEPS, WINDOW,
                                             SpeculationGate)


def _drive(gate: SpeculationGate, steps: int, spec_cost: float, spec_tokens: float, batch=lambda i: 4):
    """Run `steps` pure decode steps on a simulated clock: a plain step takes 1.0 and yields one token per
    request; a speculative one verifies 3 drafts per request, takes spec_cost and yields spec_tokens per request.
    Returns the speculative steps' share."""
    now, spec_steps = 0.0, 0
    for i in range(steps):
        b = batch(i)
        spec = gate.speculating(b)
        now += spec_cost if spec else 1.0
        spec_steps += spec
        gate.observe(now, round((spec_tokens if spec else 1) * b), b, spec, counted=True, drafts=3 * b if spec else 0)
    return spec_steps / steps


def test_speculation_that_does_not_pay_is_stepped_aside():
    # nothing accepted, a verify step 1.45x a plain one (the H200's bs1 figure for ngram at 0% acceptance)
    gate = SpeculationGate()
    share = _drive(gate, 20000, spec_cost=1.45, spec_tokens=1.0)
    assert not gate.spec_mode and share < 0.03
    # once settled, it looks back only every MAX_PERIOD steps, for one window
    late = _drive(gate, 4 * MAX_PERIOD, spec_cost=1.45, spec_tokens=1.0)
    assert late <= 1.5 * WINDOW / MAX_PERIOD


def test_a_clearly_worse_mode_is_tried_for_two_steps_only():
    """Verifying at a batch too large to pay (4x a plain step, nothing accepted): after the first window, each
    look back at speculation costs CLEAR_STEPS steps (+1, the switch)."""
    gate = SpeculationGate()
    _drive(gate, 3 * MAX_PERIOD, spec_cost=4.0, spec_tokens=1.0)
    late = _drive(gate, 8 * MAX_PERIOD, spec_cost=4.0, spec_tokens=1.0)
    assert 0 < late <= 8 * (CLEAR_STEPS + 1) / (8 * MAX_PERIOD)
    # plain decoding clearly worse (drafts accepted): its look-backs are as short
    gate = SpeculationGate()
    _drive(gate, 3 * MAX_PERIOD, spec_cost=1.2, spec_tokens=3.0)
    late = _drive(gate, 8 * MAX_PERIOD, spec_cost=1.2, spec_tokens=3.0)
    assert 1 - late <= 8 * (CLEAR_STEPS + 1) / (8 * MAX_PERIOD)


def test_speculation_that_pays_is_kept():
    gate = SpeculationGate()
    share = _drive(gate, 20000, spec_cost=1.4, spec_tokens=3.0)
    assert gate.spec_mode and share > 0.97


def test_a_tie_goes_to_plain_decoding_and_a_change_is_followed():
    gate = SpeculationGate()
    _drive(gate, 3000, spec_cost=1.0, spec_tokens=1.0)   # no gain: decode without drafts
    assert not gate.spec_mode
    _drive(gate, 3000, spec_cost=1.2, spec_tokens=3.0)   # the prompts turned repetitive: drafts pay now
    assert gate.spec_mode


def test_a_collapse_in_acceptance_is_noticed_within_a_window_or_two():
    """Quoting prompts, then ordinary chat: the choice to speculate had settled into its longest interval, yet the
    engine decodes without drafts soon after the drafts stop being accepted."""
    gate = SpeculationGate()
    _drive(gate, 4 * MAX_PERIOD, spec_cost=1.4, spec_tokens=3.0)
    assert gate.spec_mode and gate._period == MAX_PERIOD
    share = _drive(gate, 400, spec_cost=1.4, spec_tokens=1.0)
    # one fresh window shows it, one plain window confirms it; then looks back at 32, 64, 128 steps
    assert gate._chosen is False and share <= 0.1


def test_windows_of_different_batch_sizes_are_not_compared():
    """A speculative window at batch 1 and a plain one at batch 8 say nothing about each other: measure again."""
    gate = SpeculationGate()
    _drive(gate, WINDOW + 1, spec_cost=1.45, spec_tokens=1.0, batch=lambda i: 1)
    assert not gate.spec_mode                              # measuring plain decoding now
    _drive(gate, WINDOW + 1, spec_cost=1.45, spec_tokens=1.0, batch=lambda i: 8)   # (+1: the switch)
    assert gate.spec_mode                                   # not comparable: speculation is measured again


def test_the_batch_size_limit_and_the_off_switch():
    gate = SpeculationGate(disable_by_batch_size=4)
    assert gate.speculating(4) and not gate.speculating(5)
    off = SpeculationGate(enabled=False)
    _drive(off, 2000, spec_cost=3.0, spec_tokens=1.0)
    assert off.speculating(64) and off.switches == 0


def test_intervals_that_are_not_steps_are_not_measured():
    gate = SpeculationGate()
    gate.observe(0.0, 4, 4, True, counted=True)            # the first reading only starts the clock
    gate.observe(1.0, 4, 4, True, counted=False)           # a step with prefill in it
    gate.idle()
    gate.observe(100.0, 4, 4, True, counted=True)          # after an idle gap
    assert gate._current.steps == 0


def _settle_on_plain(gate: SpeculationGate) -> None:
    """Speculation measured slower (nothing accepted, a verify step 1.2x a plain one): decoding without drafts."""
    _drive(gate, 200, spec_cost=1.2, spec_tokens=1.0)
    assert not gate.spec_mode and gate.wants_shadow(4)


def test_unverified_drafts_that_would_pay_bring_speculation_back_at_once():
    gate = SpeculationGate()
    _settle_on_plain(gate)
    switches = gate.switches
    # drafts proposed meanwhile would have kept 2 tokens a step: 1.2 / 2 per token beats 1.0
    gate.observe_shadow(2.0, 3.0, SHADOW_MIN_SAMPLES)
    assert gate.spec_mode and gate.switches == switches + 1 and gate._exploring


def test_a_would_be_step_is_priced_by_its_drafts():
    """The speculative window verified 3 drafts a request for 0.2 of a plain step; drafts proposed now are 1 a
    request, accepted often enough for 1.19 tokens a step: 1.067 / 1.19 per token beats plain decoding, though the
    window's full step time (1.2 / 1.19) would not."""
    gate = SpeculationGate()
    _settle_on_plain(gate)
    gate.observe_shadow(1.19, 3.0, SHADOW_MIN_SAMPLES)
    assert not gate.spec_mode
    gate.observe_shadow(1.19, 1.0, SHADOW_MIN_SAMPLES)
    assert gate.spec_mode


def test_one_speculative_window_timed_cheap_by_noise_does_not_price_drafts_at_nothing():
    """Verifying 3 drafts a request costs 0.2 of a plain step (the windows that settled on plain decoding); then
    one speculative window runs no slower than plain decoding (noise). Drafts that would keep 1.1 tokens a step are
    still priced from every window (over 1.1 plain steps a step: no gain), where the latest window alone (1.0 / 1.1
    per token) would bring speculation back."""
    gate = SpeculationGate()
    _settle_on_plain(gate)
    assert gate._draft_cost / gate._draft_weight == pytest.approx(0.2 / 12)   # 12 drafts a step
    now = gate._last
    gate._switch(explore=True)
    for _ in range(WINDOW + 1):                # the first interval after the switch is not measured
        now += 1.0
        gate.observe(now, 4, 4, True, counted=True, drafts=12)
    assert not gate.spec_mode and 0.1 / 12 < gate._draft_cost / gate._draft_weight < 0.2 / 12
    for _ in range(SHADOW_MIN_STEPS + 1):
        now += 1.0
        gate.observe(now, 4, 4, False, counted=True)
    switches = gate.switches
    gate.observe_shadow(1.1, 3.0, SHADOW_MIN_SAMPLES)
    assert not gate.spec_mode and gate.switches == switches
    gate.observe_shadow(1.4, 3.0, SHADOW_MIN_SAMPLES)   # drafts that keep more: worth measuring again
    assert gate.spec_mode


def test_unverified_drafts_that_would_not_pay_change_nothing():
    gate = SpeculationGate()
    _settle_on_plain(gate)
    switches = gate.switches
    gate.observe_shadow(1.2, 3.0, 100)                     # 1.2 / 1.2 = 1.0 per token: no gain
    gate.observe_shadow(3.0, 3.0, SHADOW_MIN_SAMPLES - 1)  # too few would-be steps to go on
    assert not gate.spec_mode and gate.switches == switches


def test_a_speculative_window_without_drafts_predicts_no_gain_from_drafts_that_keep_nothing():
    """Speculating, no lookup matched: the window timed would-be plain steps. Plain decoding chosen, its next
    window runs 8% slower by noise; the drafts proposed since keep nothing (1.0 token a step): no reason to
    speculate again."""
    gate = SpeculationGate()
    now = 0.0
    for spec, cost in [(True, 1.0)] * (WINDOW + 1) + [(False, 0.95)] * (WINDOW + 1) + [(False, 1.08)] * WINDOW:
        assert gate.speculating(1) == spec
        now += cost
        gate.observe(now, 1, 1, spec, counted=True, drafts=0)
    assert not gate.spec_mode and gate._best[False].per_token == pytest.approx(1.08)
    switches = gate.switches
    gate.observe_shadow(1.0, 3.0, 100)
    assert not gate.spec_mode and gate.switches == switches
    gate.observe_shadow(1.5, 3.0, 100)   # drafts that would keep tokens: worth measuring again
    assert gate.spec_mode


def test_while_unverified_drafts_say_it_would_not_pay_speculation_is_not_timed_again():
    """Plain decoding settled, the drafts still proposed keep showing no gain: the periodic looks at speculation
    are put off (the interval doubling) until the longest interval, where its step time is measured again."""
    gate = SpeculationGate()
    _settle_on_plain(gate)
    now, spec_steps = gate._last, 0
    for _ in range(2 * MAX_PERIOD):
        spec = gate.speculating(4)
        now += 1.2 if spec else 1.0
        spec_steps += spec
        gate.observe(now, 4, 4, spec, counted=True)
        if not spec:
            gate.observe_shadow(1.0, 3.0, 16)
    assert not gate.spec_mode and 0 < spec_steps <= WINDOW + 1     # one look (without the drafts: four)


def test_no_shadow_without_a_speculative_figure_or_above_the_batch_limit():
    gate = SpeculationGate()
    assert not gate.wants_shadow(4)                        # speculating
    gate.spec_mode = False
    assert not gate.wants_shadow(4)                        # nothing to predict the speculative step time from
    limited = SpeculationGate(disable_by_batch_size=2)
    _drive(limited, 200, spec_cost=1.2, spec_tokens=1.0, batch=lambda i: 2)
    assert not limited.spec_mode and limited.wants_shadow(2) and not limited.wants_shadow(3)


class ScriptedGate(SpeculationGate):
    """Alternates: `on` steps speculating, then `off` steps without drafts."""

    def __init__(self, on: int, off: int) -> None:
        super().__init__()
        self.pattern, self.calls, self.seen = [True] * on + [False] * off, 0, []

    def speculating(self, num_running: int) -> bool:
        self.calls += 1
        return self.pattern[self.calls % len(self.pattern)]

    def observe(self, now, tokens, batch, speculated, counted, drafts=0) -> None:
        self.seen.append(speculated)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_switching_modes_keeps_every_token(cycle_model, async_scheduling):
    """Steps with and without drafts interleave (the plain ones overlapped when async scheduling is on): the greedy
    tokens are the plain engine's, and both kinds of step ran."""
    prompts = [cycle_prompt(7 * i + 1, 12 + 5 * i) for i in range(4)]
    sp = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    want = ids(generate(make_llm(cycle_model), sp, prompts))
    llm = make_llm(cycle_model, {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3},
                   async_scheduling=async_scheduling)
    core = llm.llm_engine.engine_core
    core.gate = gate = ScriptedGate(on=3, off=4)
    assert ids(generate(llm, sp, prompts)) == want
    drafts, accepted = spec_counts(llm)
    assert accepted > 0 and True in gate.seen and False in gate.seen


def test_the_engine_measures_its_steps_and_not_the_gaps_between_requests(cycle_model):
    llm = make_llm(cycle_model, {"method": "ngram", "num_speculative_tokens": 3, "step_aside": True})
    gate = llm.llm_engine.engine_core.gate
    seen = []
    observe = gate.observe
    gate.observe = lambda *a, **kw: (seen.append(a), observe(*a, **kw))
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    generate(llm, sp, [cycle_prompt(1, 12), cycle_prompt(8, 9)])
    # one observation per step, pure decode steps counted; once idle the clock stops (the gap is not a step)
    assert len(seen) >= 8 and sum(a[4] for a in seen) >= 6 and gate._last is None and gate._skip


def test_above_disable_by_batch_size_nothing_is_drafted(cycle_model):
    """The gate is the one place the limit is applied: above it the scheduler drafts nothing, alone it drafts."""
    llm = make_llm(cycle_model, {"method": "ngram", "num_speculative_tokens": 3, "disable_by_batch_size": 1})
    sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    generate(llm, sp, [cycle_prompt(1, 12), cycle_prompt(8, 12)])     # two running all along
    assert spec_counts(llm)[0] == 0
    generate(llm, sp, [cycle_prompt(1, 12)])
    assert spec_counts(llm)[0] > 0


def test_standing_aside_the_drafter_keeps_proposing_and_the_tokens_stay_exact(cycle_model):
    """The gate chose plain decoding: the steps verify nothing (no draft counted) yet propose drafts that are scored
    against the tokens that follow; their acceptance brings speculation back, and the greedy tokens are the plain
    engine's throughout."""
    prompts = [cycle_prompt(7 * i + 1, 12 + 5 * i) for i in range(2)]
    sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    want = ids(generate(make_llm(cycle_model), sp, prompts))
    llm = make_llm(cycle_model, {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3,
                                 "step_aside": True})
    gate = llm.llm_engine.engine_core.gate
    _settle_on_plain(gate)
    gate._period = 10 ** 9                                  # no timed look back: only the shadow can switch
    seen = []
    shadow = gate.observe_shadow
    gate.observe_shadow = lambda t, d, n: (seen.append((t, n)), shadow(t, d, n))
    assert ids(generate(llm, sp, prompts)) == want
    assert seen and max(n for _, n in seen) >= SHADOW_MIN_SAMPLES and max(t for t, _ in seen) > 1.0
    assert spec_counts(llm)[1] > 0                          # the cycle's drafts pay: speculation came back
