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


@dataclass
class _Window:
    seconds: float = 0.0
    tokens: int = 0
    steps: int = 0
    batch: int = 0  # summed requests per step (mean = batch / steps)

    def add(self, seconds: float, tokens: int, batch: int) -> None:
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
    switches: int = 0             # mode changes (diagnostics, tests)

    def speculating(self, num_running: int) -> bool:
        limit = self.disable_by_batch_size
        if limit is not None and num_running > limit:
            return False
        return self.spec_mode or not self.enabled

    def idle(self) -> None:
        self._last, self._skip = None, True

    def observe(self, now: float, tokens: int, batch: int, speculated: bool, counted: bool) -> None:
        last, self._last = self._last, now
        skip, self._skip = self._skip, False
        if not self.enabled or last is None or skip or not counted or speculated != self.spec_mode or tokens <= 0:
            return
        self._current.add(now - last, tokens, batch)
        if self._exploring:
            if self._current.steps >= WINDOW or self._clearly_worse():
                self._best[self.spec_mode] = self._current
                self._decide()
        else:
            self._since_choice += 1
            if self._current.steps >= WINDOW:  # the chosen mode's figure stays fresh
                self._best[self.spec_mode] = self._current
                self._current = _Window()
                if self._losing():
                    # It no longer beats the other mode's latest figure (the prompts changed): look again now.
                    self._period = MIN_PERIOD
                    self._switch(explore=True)
                    return
            if self._since_choice >= self._period:
                self._switch(explore=True)

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


def _comparable(a: _Window | None, b: _Window | None) -> bool:
    if a is None or b is None:
        return False
    lo, hi = sorted((a.mean_batch, b.mean_batch))
    return hi <= lo * BATCH_DRIFT
