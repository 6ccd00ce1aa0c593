"""Engine statistics: Prometheus metrics (vLLM's metric names, so existing dashboards work) and a periodic log line."""
from __future__ import annotations

import time

from tokenmill.engine.messages import SchedulerStats
from tokenmill.logger import init_logger

logger = init_logger(__name__)

_LATENCY_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
_TPOT_BUCKETS = [0.001, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
                 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0]
_METRICS = None


def _metrics():
    """Created once per process: prometheus_client refuses to register a name twice."""
    global _METRICS
    if _METRICS is None:
        from prometheus_client import Counter, Gauge, Histogram
        labels = ["model_name"]
        _METRICS = dict(
            running=Gauge("vllm:num_requests_running", "Requests in the running batch.", labels),
            waiting=Gauge("vllm:num_requests_waiting", "Requests waiting to be scheduled.", labels),
            kv_usage=Gauge("vllm:kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0-1).", labels),
            prefix_queries=Counter("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                                   labels),
            prefix_hits=Counter("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.", labels),
            preemptions=Counter("vllm:num_preemptions", "Requests preempted for lack of KV blocks.", labels),
            prompt_tokens=Counter("vllm:prompt_tokens", "Prompt tokens processed.", labels),
            generation_tokens=Counter("vllm:generation_tokens", "Tokens generated.", labels),
            success=Counter("vllm:request_success", "Finished requests by finish reason.",
                            labels + ["finished_reason"]),
            ttft=Histogram("vllm:time_to_first_token_seconds", "Time to first token.", labels,
                           buckets=_LATENCY_BUCKETS),
            tpot=Histogram("vllm:time_per_output_token_seconds", "Time per output token after the first.", labels,
                           buckets=_TPOT_BUCKETS),
            e2e=Histogram("vllm:e2e_request_latency_seconds", "End-to-end request latency.", labels,
                          buckets=_LATENCY_BUCKETS),
        )
    return _METRICS


class StatLogger:
    """Feeds Prometheus from every engine step and, unless disabled, logs a summary line every `interval_s`."""

    def __init__(self, model_name: str, log_interval_s: float | None = 10.0) -> None:
        self.m = {k: (v.labels(model_name) if k != "success" else v) for k, v in _metrics().items()}
        self.model_name = model_name
        self.interval = log_interval_s
        self._last_log = time.monotonic()
        self._prompt_since = self._gen_since = 0
        self._prev_queries = self._prev_hits = self._prev_preempt = 0
        self._window_queries = self._window_hits = 0
        self.last: SchedulerStats | None = None

    def record_step(self, stats: SchedulerStats | None, iteration) -> None:
        if stats is not None:
            m = self.m
            m["running"].set(stats.num_running_reqs)
            m["waiting"].set(stats.num_waiting_reqs)
            m["kv_usage"].set(stats.kv_cache_usage)
            dq, dh = stats.prefix_cache_queries - self._prev_queries, stats.prefix_cache_hits - self._prev_hits
            dp = stats.num_preemptions - self._prev_preempt
            if dq > 0:
                m["prefix_queries"].inc(dq)
                self._window_queries += dq
            if dh > 0:
                m["prefix_hits"].inc(dh)
                self._window_hits += dh
            if dp > 0:
                m["preemptions"].inc(dp)
            self._prev_queries, self._prev_hits = stats.prefix_cache_queries, stats.prefix_cache_hits
            self._prev_preempt = stats.num_preemptions
            self.last = stats
        if iteration is not None:
            m = self.m
            if iteration.num_prompt_tokens:
                m["prompt_tokens"].inc(iteration.num_prompt_tokens)
            if iteration.num_generation_tokens:
                m["generation_tokens"].inc(iteration.num_generation_tokens)
            self._prompt_since += iteration.num_prompt_tokens
            self._gen_since += iteration.num_generation_tokens
            for t in iteration.time_to_first_tokens_s:
                m["ttft"].observe(t)
            for t in iteration.e2e_latencies_s:
                m["e2e"].observe(t)
            for reason, n in iteration.finish_reasons.items():
                m["success"].labels(self.model_name, reason).inc(n)
        self.maybe_log()

    def record_finished(self, metrics) -> None:
        """Per finished request: time per output token after the first."""
        if metrics is None or not metrics.first_token_time or not metrics.last_token_time:
            return
        n = metrics.num_generation_tokens
        if n > 1:
            self.m["tpot"].observe((metrics.last_token_time - metrics.first_token_time) / (n - 1))

    def maybe_log(self, force: bool = False) -> None:
        if self.interval is None:
            return
        now = time.monotonic()
        dt = now - self._last_log
        if not force and dt < self.interval:
            return
        s = self.last or SchedulerStats()
        hit_rate = 100.0 * self._window_hits / self._window_queries if self._window_queries else 0.0
        logger.info("Avg prompt throughput: %.1f tokens/s, Avg generation throughput: %.1f tokens/s, Running: %d "
                    "reqs, Waiting: %d reqs, KV cache usage: %.1f%%, Prefix cache hit rate: %.1f%%",
                    self._prompt_since / dt, self._gen_since / dt, s.num_running_reqs, s.num_waiting_reqs,
                    100 * s.kv_cache_usage, hit_rate)
        self._last_log = now
        self._prompt_since = self._gen_since = 0
        self._window_queries = self._window_hits = 0
