"""What drafts would have gained while speculation stands aside: drafts proposed but not verified, scored against
the tokens the requests then produce.

While the engine decodes without drafts (spec_decode/step_aside.py chose it), a cheap drafter (ngram, suffix: no
model of its own) can keep proposing at the cost of a lookup. Each request's proposal is held and compared with the
tokens that follow, one step at a time, exactly as verification would compare them: the run of matching drafts is
what a verify step would have accepted. So the gate sees the acceptance coming back (a quoting passage starts) as it
happens instead of after a blind interval, and speculates again only when the drafts would pay.
"""
from __future__ import annotations

from collections import deque

# Would-be verify steps kept (the latest ones: the estimate follows the text being generated now).
HISTORY = 16


class ShadowDrafts:
    """Scores unverified drafts per request.

    Contract: `step(req_id, tokens, next_drafts)` once per request per shadow step with the tokens it produced and
    the drafts proposed after them; `forget(req_id)` when it leaves; `reset()` when speculation resumes (the
    history describes plain decoding's stretch). `tokens_per_step()` is the mean tokens a verify step would have
    produced over the latest HISTORY would-be steps (1 + the accepted drafts; a step with no proposal counts 1),
    `drafts_per_step()` the mean drafts it would have verified, `samples` how many steps they rest on.
    """

    def __init__(self, history: int = HISTORY) -> None:
        self._pending: dict[str, tuple[list[int], int]] = {}   # req id -> (its drafts, how many matched so far)
        self._outcomes: deque[tuple[int, int]] = deque(maxlen=history)  # (drafts, accepted) per would-be step
        self._drafted = self._accepted = 0  # their sums

    @property
    def active(self) -> bool:
        return bool(self._pending or self._outcomes)

    @property
    def samples(self) -> int:
        return len(self._outcomes)

    def tokens_per_step(self) -> float:
        return 1.0 + self._accepted / max(len(self._outcomes), 1)

    def drafts_per_step(self) -> float:
        return self._drafted / max(len(self._outcomes), 1)

    def _record(self, drafted: int, accepted: int) -> None:
        if len(self._outcomes) == self._outcomes.maxlen:
            d, a = self._outcomes[0]
            self._drafted, self._accepted = self._drafted - d, self._accepted - a
        self._outcomes.append((drafted, accepted))
        self._drafted, self._accepted = self._drafted + drafted, self._accepted + accepted

    def step(self, req_id: str, tokens: list[int], next_drafts: list[int] | None) -> None:
        pending = self._pending.pop(req_id, None)
        for t in tokens:
            if pending is None:
                break
            drafts, matched = pending
            if matched < len(drafts) and t == drafts[matched]:
                pending = (drafts, matched + 1)
            else:  # a mismatch, or the token after a fully matched run (the verify step's own draw)
                self._record(len(drafts), matched)
                pending = None
        if pending is not None:
            self._pending[req_id] = pending
        elif next_drafts is not None:
            # A new would-be verify step starts after these tokens; without a proposal it would have run plain.
            if next_drafts:
                self._pending[req_id] = (list(next_drafts), 0)
            else:
                self._record(0, 0)

    def forget(self, req_id: str) -> None:
        self._pending.pop(req_id, None)

    def reset(self) -> None:
        self._pending.clear()
        self._outcomes.clear()
        self._drafted = self._accepted = 0
