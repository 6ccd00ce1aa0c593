"""Speculative-decoding counters as vLLM names them, for Prometheus, the periodic log and `LLM.get_metrics()`."""
from __future__ import annotations

from tokenmill.core.messages import SpecDecodingStats
from tokenmill.metrics.reader import Counter, Vector

NUM_DRAFTS = "vllm:spec_decode_num_drafts"
NUM_DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens"
NUM_ACCEPTED_TOKENS = "vllm:spec_decode_num_accepted_tokens"
NUM_ACCEPTED_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"


class SpecDecodingTotals:
    """Running totals of the scheduler's SpecDecodingStats snapshots, plus a window for the periodic log.

    Contract: `observe(stats)` adds one snapshot (None is ignored); `metrics(labels)` gives the totals as vLLM's
    Counter / Vector records; `log_line()` summarises the window since the previous call and starts a new one.
    """

    def __init__(self, num_spec_tokens: int) -> None:
        self.total = SpecDecodingStats.new(num_spec_tokens)
        self.window = SpecDecodingStats.new(num_spec_tokens)

    def observe(self, stats: SpecDecodingStats | None) -> None:
        if stats is None:
            return
        for acc in (self.total, self.window):
            acc.num_drafts += stats.num_drafts
            acc.num_draft_tokens += stats.num_draft_tokens
            acc.num_accepted_tokens += stats.num_accepted_tokens
            for i, n in enumerate(stats.num_accepted_tokens_per_pos[:len(acc.num_accepted_tokens_per_pos)]):
                acc.num_accepted_tokens_per_pos[i] += n

    def metrics(self, labels: dict[str, str] | None = None) -> list[Counter | Vector]:
        labels = dict(labels or {})
        t = self.total
        return [Counter(NUM_DRAFTS, labels, t.num_drafts), Counter(NUM_DRAFT_TOKENS, labels, t.num_draft_tokens),
                Counter(NUM_ACCEPTED_TOKENS, labels, t.num_accepted_tokens),
                Vector(NUM_ACCEPTED_PER_POS, labels, list(t.num_accepted_tokens_per_pos))]

    def log_line(self) -> str | None:
        """vLLM's "SpecDecoding metrics" line over the window, or None when nothing was drafted in it."""
        w, self.window = self.window, SpecDecodingStats.new(self.window.num_spec_tokens)
        if not w.num_drafts:
            return None
        rate = 100.0 * w.num_accepted_tokens / w.num_draft_tokens if w.num_draft_tokens else 0.0
        per_pos = ", ".join(f"{n / w.num_drafts:.3f}" for n in w.num_accepted_tokens_per_pos)
        return (f"SpecDecoding metrics: Mean acceptance length: {1 + w.num_accepted_tokens / w.num_drafts:.2f}, "
                f"Accepted: {w.num_accepted_tokens} tokens, Drafted: {w.num_draft_tokens} tokens, "
                f"Per-position acceptance rate: {per_pos}, Avg Draft acceptance rate: {rate:.1f}%")


class _PromFamilies:
    """vLLM's spec-decode Prometheus families, registered once per process (prometheus_client refuses a name
    twice). Exposed with the `_total` suffix, as vLLM's are."""

    def __init__(self) -> None:
        from prometheus_client import Counter

        from tokenmill.metrics.prometheus import LABELS
        self.num_drafts = Counter(NUM_DRAFTS, "Drafts verified (a request's proposals in one step).", LABELS)
        self.num_draft_tokens = Counter(NUM_DRAFT_TOKENS, "Draft tokens verified.", LABELS)
        self.num_accepted_tokens = Counter(NUM_ACCEPTED_TOKENS, "Draft tokens accepted.", LABELS)
        self.per_pos = Counter(NUM_ACCEPTED_PER_POS, "Draft tokens accepted, by position in the draft.",
                               LABELS + ["position"])


_FAMILIES: _PromFamilies | None = None


class SpecDecodingMetrics(SpecDecodingTotals):
    """One engine's spec-decode counters in Prometheus (labels model_name, engine) plus the totals and the window
    of the periodic log. `observe(stats, prometheus=False)` keeps the totals only (an API server process that does
    not record the engine's counters)."""

    def __init__(self, num_spec_tokens: int, labels: tuple[str, str]) -> None:
        super().__init__(num_spec_tokens)
        global _FAMILIES
        if _FAMILIES is None:
            _FAMILIES = _PromFamilies()
        f = _FAMILIES
        self._drafts, self._tokens, self._accepted = (c.labels(*labels) for c in
                                                      (f.num_drafts, f.num_draft_tokens, f.num_accepted_tokens))
        self._per_pos = [f.per_pos.labels(*labels, str(i)) for i in range(num_spec_tokens)]

    def observe(self, stats: SpecDecodingStats | None, prometheus: bool = True) -> None:
        super().observe(stats)
        if stats is None or not prometheus or not stats.num_drafts:
            return
        self._drafts.inc(stats.num_drafts)
        self._tokens.inc(stats.num_draft_tokens)
        self._accepted.inc(stats.num_accepted_tokens)
        for child, n in zip(self._per_pos, stats.num_accepted_tokens_per_pos):
            if n:
                child.inc(n)
