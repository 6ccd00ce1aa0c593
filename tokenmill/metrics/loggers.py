"""Engine statistics: Prometheus metrics (vLLM's metric names, so existing dashboards work) and a periodic log line."""
from __future__ import annotations

import time

from tokenmill.engine.messages import SchedulerStats, combine_scheduler_stats
from tokenmill.logger import init_logger

logger = init_logger(__name__)

_LATENCY_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
_TPOT_BUCKETS = [0.001, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
                 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0]
_METRICS = None


def _metrics():
    """Created once per process: prometheus_client refuses to register a name twice. Gauges keep the most recent
    value of a live process when several API server processes share the metrics (prometheus multiprocess mode)."""
    global _METRICS
    if _METRICS is None:
        from prometheus_client import Counter, Gauge, Histogram
        labels = ["model_name", "engine"]
        mode = "livemostrecent"
        _METRICS = dict(
            running=Gauge("vllm:num_requests_running", "Requests in the running batch.", labels,
                          multiprocess_mode=mode),
            waiting=Gauge("vllm:num_requests_waiting", "Requests waiting to be scheduled.", labels,
                          multiprocess_mode=mode),
            kv_usage=Gauge("vllm:kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0-1).", labels,
                           multiprocess_mode=mode),
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


class _EngineStats:
    """The metrics of one engine core (one `engine` label value) and what its log line needs."""

    def __init__(self, model_name: str, engine: int) -> None:
        self.labels = (model_name, str(engine))
        self.m = {k: (v.labels(*self.labels) if k != "success" else v) for k, v in _metrics().items()}
        self.prompt_since = self.gen_since = 0
        self.prev_queries = self.prev_hits = self.prev_preempt = 0
        self.window_queries = self.window_hits = 0
        self.last: SchedulerStats | None = None


class StatLogger:
    """Feeds Prometheus from every engine step and, unless disabled, logs a summary line every `interval_s`.

    Every metric carries the labels `model_name` and `engine` (the data-parallel rank), as vLLM's do, and the
    scheduler stats are kept per engine; `last` sums them over the engines (KV usage: the mean). With several API
    server processes only one of them (`record_engine_counters=True`) turns the engines' cumulative prefix-cache and
    preemption counts into counter increments, so they are not counted once per process.
    """

    def __init__(self, model_name: str, log_interval_s: float | None = 10.0, num_engines: int = 1,
                 record_engine_counters: bool = True) -> None:
        self.model_name = model_name
        self.interval = log_interval_s
        self.engines = [_EngineStats(model_name, e) for e in range(num_engines)]
        self.record_engine_counters = record_engine_counters
        self._last_log = time.monotonic()

    @property
    def last(self) -> SchedulerStats | None:
        return combine_scheduler_stats([e.last for e in self.engines if e.last is not None])

    def engine_stats(self, engine: int) -> SchedulerStats | None:
        return self.engines[engine].last

    def record_step(self, stats: SchedulerStats | None, iteration, engine: int = 0) -> None:
        e = self.engines[engine]
        m = e.m
        if stats is not None:
            m["running"].set(stats.num_running_reqs)
            m["waiting"].set(stats.num_waiting_reqs)
            m["kv_usage"].set(stats.kv_cache_usage)
            dq, dh = stats.prefix_cache_queries - e.prev_queries, stats.prefix_cache_hits - e.prev_hits
            dp = stats.num_preemptions - e.prev_preempt
            if dq > 0:
                if self.record_engine_counters:
                    m["prefix_queries"].inc(dq)
                e.window_queries += dq
            if dh > 0:
                if self.record_engine_counters:
                    m["prefix_hits"].inc(dh)
                e.window_hits += dh
            if dp > 0 and self.record_engine_counters:
                m["preemptions"].inc(dp)
            e.prev_queries, e.prev_hits = stats.prefix_cache_queries, stats.prefix_cache_hits
            e.prev_preempt = stats.num_preemptions
            e.last = stats
        if iteration is not None:
            if iteration.num_prompt_tokens:
                m["prompt_tokens"].inc(iteration.num_prompt_tokens)
            if iteration.num_generation_tokens:
                m["generation_tokens"].inc(iteration.num_generation_tokens)
            e.prompt_since += iteration.num_prompt_tokens
            e.gen_since += iteration.num_generation_tokens
            for t in iteration.time_to_first_tokens_s:
                m["ttft"].observe(t)
            for t in iteration.e2e_latencies_s:
                m["e2e"].observe(t)
            for reason, n in iteration.finish_reasons.items():
                m["success"].labels(*e.labels, reason).inc(n)
        self.maybe_log()

    def record_finished(self, metrics, engine: int = 0) -> None:
        """Per finished request: time per output token after the first."""
        if metrics is None or not metrics.first_token_time or not metrics.last_token_time:
            return
        n = metrics.num_generation_tokens
        if n > 1:
            self.engines[engine].m["tpot"].observe((metrics.last_token_time - metrics.first_token_time) / (n - 1))

    def maybe_log(self, force: bool = False) -> None:
        if self.interval is None:
            return
        now = time.monotonic()
        dt = now - self._last_log
        if not force and dt < self.interval:
            return
        for i, e in enumerate(self.engines):
            s = e.last or SchedulerStats()
            hit_rate = 100.0 * e.window_hits / e.window_queries if e.window_queries else 0.0
            prefix = f"Engine {i:03d}: " if len(self.engines) > 1 else ""
            logger.info("%sAvg prompt throughput: %.1f tokens/s, Avg generation throughput: %.1f tokens/s, "
                        "Running: %d reqs, Waiting: %d reqs, KV cache usage: %.1f%%, Prefix cache hit rate: %.1f%%",
                        prefix, e.prompt_since / dt, e.gen_since / dt, s.num_running_reqs, s.num_waiting_reqs,
                        100 * s.kv_cache_usage, hit_rate)
            e.prompt_since = e.gen_since = 0
            e.window_queries = e.window_hits = 0
        self._last_log = now
