"""When speculation does not pay, the engine decodes without it: a gate that measures both ways of decoding.

Whether verifying drafts beats plain decoding depends on the acceptance (the prompts, the drafter), on what a
verify step costs next to a plain one (the model, the batch, the device), and on what plain decoding gains from
overlapping the host with the device (async scheduling, which a speculative step cannot do: its drafts need its
tokens). None of these is known in advance, so the gate measures the quantity that matters, seconds per output
token, over windows of pure decode steps (no prefill in them) in each mode, and runs the faster mode. The slower
one is tried again for a short window now and then (cut to two steps when it is clearly slower), at an interval
that doubles while the choice stands (so a settled choice costs a fraction of a percent), and that starts short
again when the choice changes, when the batch size moved away from what the last measurements saw, or when the
chosen mode's own fresh figure stops beating the other's latest (the prompts changed).

Decoding without drafts, the gate would be blind to the acceptance coming back (a request starts quoting its
prompt) until its next look. Where drafts cost only a lookup (ngram, suffix) and the steps are not overlapped
anyway, the engine keeps proposing without verifying (core/shadow_drafts.py) and the gate predicts the
speculative figure from that acceptance and what a verified draft has cost (averaged over the speculative
windows, the latest weighing most): speculation is measured again as
soon as the prediction beats plain decoding, and while it does not, the timed looks back are put off (up to the
longest interval, when the speculative step time itself is measured again).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from tokenmill.logger import init_logger

logger = init_logger(__name__)

# Counted steps per measurement window, and the exploitation intervals between windows of the other mode.
WINDOW = 8
MIN_PERIOD = 32
MAX_PERIOD = 1024
# Speculation must be this much faster per token to be chosen: on a near tie, plain decoding (no slower).
MARGIN = 0.03
# Windows whose mean batch sizes differ by more than this factor are not compared.
BATCH_DRIFT = 1.5
# A window cut short: once it has this many steps and runs this much slower per token than the other mode's
# latest figure, the verdict is in (trying a clearly worse mode costs 2 steps, not a window). Speculative steps
# need the larger ratio: at batch 1 the tokens a step keeps vary from 1 to k + 1, so two steps say little about
# the acceptance, only about a step that costs several plain ones.
CLEAR_STEPS = 2
CLEAR_RATIO = {False: 1.25, True: 2.0}
# The chosen mode's fresh window must lose to the other mode's latest figure by this much to be looked at again
# before its interval ends (more than a window's noise).
RECHECK_MARGIN = 0.10
# Unverified drafts' would-be verify steps needed before their prediction is acted on, and plain steps run since
# the last switch (a prediction that the measurement then contradicts costs at most one window in two).
SHADOW_MIN_SAMPLES = 4
SHADOW_MIN_STEPS = WINDOW
# What a verified draft adds to a step is averaged over the speculative windows, each older one weighing this much
# less than the next: one window timed cheap by noise must not price drafts at nothing.
DRAFT_COST_DECAY = 0.7


@dataclass
class _Window:
    seconds: float = 0.0
    tokens: int = 0
    steps: int = 0
    batch: int = 0  # summed requests per step (mean = batch / steps)
    drafts: int = 0  # summed draft tokens verified

    def add(self, seconds: float, tokens: int, batch: int, drafts: int = 0) -> None:
        self.drafts += drafts
        self.seconds += seconds
        self.tokens += tokens
        self.steps += 1
        self.batch += batch

    @property
    def per_token(self) -> float:
        return self.seconds / max(self.tokens, 1)

    @property
    def mean_batch(self) -> float:
        return self.batch / max(self.steps, 1)


@dataclass
class SpeculationGate:
    """Chooses, before each step, whether it speculates (`speculating`), from the steps it is told about.

    Contract: `observe(now, tokens, batch, speculated, counted)` once per finished step (now: a monotonic clock
    reading when its outputs are in; tokens: output tokens it produced; batch: requests it ran; counted: a pure
    decode step, whose time per token is comparable); `idle()` when the engine ran out of work (the next interval
    is not a step's). The first interval after a switch of mode is not measured (it holds the switch itself).
    The gate starts speculating; above `disable_by_batch_size` running requests it never speculates.
    """
    disable_by_batch_size: int | None = None
    enabled: bool = True
    spec_mode: bool = True
    _last: float | None = None
    _current: _Window = field(default_factory=_Window)   # the mode being measured or run now
    _best: dict = field(default_factory=dict)            # mode -> its latest full window
    _exploring: bool = True       # measuring a window (True) or running the chosen mode (False)
    _period: int = MIN_PERIOD
    _since_choice: int = 0        # counted steps run in the chosen mode since the last choice
    _skip: bool = True            # the next interval holds a mode switch or an idle gap
    _chosen: bool = True          # the latest choice (speculate or not)
    _plain_steps: int = 0         # counted steps decoded without drafts since the last switch
    _shadow_says_plain: bool = False  # the latest prediction from unverified drafts, since the last switch
    _draft_cost: float = 0.0      # decayed sum over speculative windows of drafts x (extra step time per draft
    _draft_weight: float = 0.0    # as a share of a plain step), and of their drafts
    _unpriced: _Window | None = None  # a speculative window still waiting for a plain figure to compare with
    switches: int = 0             # mode changes (diagnostics, tests)

    def speculating(self, num_running: int) -> bool:
        limit = self.disable_by_batch_size
        if limit is not None and num_running > limit:
            return False
        return self.spec_mode or not self.enabled

    def wants_shadow(self, num_running: int) -> bool:
        """Whether unverified drafts would inform the next choice: decoding without drafts by choice (not above
        the batch limit), with a speculative figure to predict from."""
        limit = self.disable_by_batch_size
        return (self.enabled and not self.spec_mode and True in self._best
                and (limit is None or num_running <= limit))

    def observe_shadow(self, tokens_per_step: float, drafts_per_step: float, samples: int) -> None:
        """Decoding without drafts: the unverified drafts would have made `tokens_per_step` tokens per request per
        verify step, verifying `drafts_per_step` drafts each (over `samples` would-be steps). A verify step is
        priced as a plain step plus, per draft, what verified drafts have cost beyond plain steps (`_store`: a
        decayed average over the speculative windows; the latest window's whole step time before any is priced);
        speculation is measured again now when that prediction beats plain decoding by MARGIN."""
        if self.spec_mode or samples < SHADOW_MIN_SAMPLES or self._plain_steps < SHADOW_MIN_STEPS:
            return
        spec, plain = self._best.get(True), self._best.get(False)
        if not _comparable(spec, plain) or not spec.steps or not plain.steps:
            return
        # A plain step at the speculative window's batch, and what each draft verified adds to it.
        base = plain.seconds / plain.steps * spec.mean_batch / plain.mean_batch
        if self._draft_weight:
            per_draft = max(self._draft_cost / self._draft_weight, 0.0) * base
            step = base + per_draft * drafts_per_step * spec.mean_batch
        else:
            step = spec.seconds / spec.steps
        # Verifying drafts never makes a step cheaper than a plain one: a window that verified none (no lookup
        # matched) measured a plain step, and its noise alone must not predict a gain.
        step = max(step, base)
        predicted = step / (tokens_per_step * spec.mean_batch)
        self._shadow_says_plain = predicted >= plain.per_token * (1 - MARGIN)
        if not self._shadow_says_plain:
            logger.debug("Speculation gate: unverified drafts yield %.2f tokens a step, predicting %.4f ms per token "
                         "against %.4f without: speculating again", tokens_per_step, predicted * 1e3,
                         plain.per_token * 1e3)
            self._period = MIN_PERIOD
            self._switch(explore=True)

    def idle(self) -> None:
        self._last, self._skip = None, True

    def observe(self, now: float, tokens: int, batch: int, speculated: bool, counted: bool, drafts: int = 0) -> None:
        last, self._last = self._last, now
        skip, self._skip = self._skip, False
        if not self.enabled or last is None or skip or not counted or speculated != self.spec_mode or tokens <= 0:
            return
        self._current.add(now - last, tokens, batch, drafts)
        if not speculated:
            self._plain_steps += 1
        if self._exploring:
            if self._current.steps >= WINDOW or self._clearly_worse():
                self._store(self._current)
                self._decide()
        else:
            self._since_choice += 1
            if self._current.steps >= WINDOW:  # the chosen mode's figure stays fresh
                self._store(self._current)
                self._current = _Window()
                if self._losing():
                    # It no longer beats the other mode's latest figure (the prompts changed): look again now.
                    self._period = MIN_PERIOD
                    self._switch(explore=True)
                    return
            if self._since_choice >= self._period:
                if self._shadow_says_plain and self._period < MAX_PERIOD:
                    # Unverified drafts keep showing that speculation would not pay: no need to measure it now.
                    self._since_choice, self._period = 0, self._period * 2
                else:
                    self._switch(explore=True)

    def _store(self, window: _Window) -> None:
        """Keep a finished window as its mode's latest figure. A speculative one that verified drafts also adds to
        what a draft costs, measured against the plain figure nearest in time (the latest one, or the next one
        when there is none yet) as a share of a plain step, so that the average holds while the machine's speed
        drifts."""
        self._best[self.spec_mode] = window
        if self.spec_mode:
            self._unpriced = window
        if self._unpriced is not None:
            self._price_drafts(self._unpriced)

    def _price_drafts(self, window: _Window) -> None:
        plain = self._best.get(False)
        if not window.drafts:
            self._unpriced = None
            return
        if not _comparable(window, plain) or not plain.steps:
            return
        self._unpriced = None
        base = plain.seconds / plain.steps * window.mean_batch / plain.mean_batch
        extra = (window.seconds / window.steps - base) / base / (window.drafts / window.steps)
        self._draft_cost = self._draft_cost * DRAFT_COST_DECAY + extra * window.drafts
        self._draft_weight = self._draft_weight * DRAFT_COST_DECAY + window.drafts

    def _clearly_worse(self) -> bool:
        cur, other = self._current, self._best.get(not self.spec_mode)
        return (cur.steps >= CLEAR_STEPS and _comparable(cur, other)
                and cur.per_token > other.per_token * CLEAR_RATIO[self.spec_mode])

    def _losing(self) -> bool:
        mine, other = self._best.get(self.spec_mode), self._best.get(not self.spec_mode)
        return _comparable(mine, other) and mine.per_token > other.per_token * (1 + RECHECK_MARGIN)

    def _preferred(self) -> bool | None:
        """Whether the latest figures favour speculating (None: no comparable pair)."""
        spec, plain = self._best.get(True), self._best.get(False)
        if not _comparable(spec, plain):
            return None
        return spec.per_token < plain.per_token * (1 - MARGIN)

    def _decide(self) -> None:
        """After a measurement window: run the faster mode (or measure the other one first)."""
        choice = self._preferred()
        if choice is None:
            self._period = MIN_PERIOD
            self._switch(explore=True)
            return
        spec, plain = self._best[True], self._best[False]
        logger.debug("Speculation gate: %.4f ms per token speculating, %.4f without (batch %.1f / %.1f): %s",
                     spec.per_token * 1e3, plain.per_token * 1e3, spec.mean_batch, plain.mean_batch,
                     "speculate" if choice else "decode without drafts")
        # The same choice as before doubles the time until the next look; a new one starts it short again.
        self._period = min(self._period * 2, MAX_PERIOD) if choice == self._chosen else MIN_PERIOD
        self._chosen = choice
        if choice != self.spec_mode:
            self._switch(explore=False)
        else:
            self._exploring, self._since_choice, self._current = False, 0, _Window()

    def _switch(self, explore: bool) -> None:
        self.spec_mode = not self.spec_mode
        self.switches += 1
        self._exploring, self._since_choice, self._current, self._skip = explore, 0, _Window(), True
        self._plain_steps, self._shadow_says_plain = 0, False


def _comparable(a: _Window | None, b: _Window | None) -> bool:
    if a is None or b is None:
        return False
    lo, hi = sorted((a.mean_batch, b.mean_batch))
    return hi <= lo * BATCH_DRIFT
