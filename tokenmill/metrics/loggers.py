"""Engine statistics: Prometheus metrics (vLLM's metric names, so existing dashboards work) and a periodic log line."""
from __future__ import annotations

import dataclasses
import time

from tokenmill.core.messages import FinishReason, SchedulerStats, combine_scheduler_stats
from tokenmill.logger import init_logger
from tokenmill.metrics.prometheus import (PROMPT_TOKEN_SOURCES, SLEEP_STATES, WAITING_REASONS, VllmMetrics,
                                          observe_n, vllm_metrics)
from tokenmill.metrics.spec_decode import SpecDecodingMetrics
from tokenmill.metrics.stats import IterationStats

logger = init_logger(__name__)


class _EngineStats:
    """The metric children of one engine core (one `engine` label value) and what its log line needs."""

    def __init__(self, m: VllmMetrics, model_name: str, engine: int) -> None:
        labels = self.labels = (model_name, str(engine))
        for name in ("running", "waiting", "kv_usage", "prefix_queries", "prefix_hits", "preemptions",
                     "prompt_tokens", "prompt_tokens_cached", "prompt_tokens_recomputed", "generation_tokens",
                     "request_prompt_tokens", "request_generation_tokens", "iteration_tokens",
                     "max_generation_tokens", "params_n", "params_max_tokens", "prefill_kv_computed", "ttft", "itl",
                     "tpot_deprecated", "request_tpot", "e2e", "queue_time", "inference_time", "prefill_time",
                     "decode_time"):
            setattr(self, name, getattr(m, name).labels(*labels))
        self.by_source = [m.prompt_tokens_by_source.labels(*labels, s) for s in PROMPT_TOKEN_SOURCES]
        self.waiting_capacity, self.waiting_deferred = (m.waiting_by_reason.labels(*labels, r)
                                                        for r in WAITING_REASONS)
        self.success = {r: m.success.labels(*labels, str(r)) for r in FinishReason}
        self.success_family = m.success
        self.sleep_states = {s: m.sleep_state.labels(*labels, s) for s in SLEEP_STATES}
        self.set_sleep_level(0)  # every series exists from the start, as in vLLM
        self.prompt_since = self.gen_since = 0
        self.prev_queries = self.prev_hits = self.prev_preempt = 0
        self.window_queries = self.window_hits = 0
        self.last: SchedulerStats | None = None
        self.spec: SpecDecodingMetrics | None = None  # set with speculative decoding

    def set_sleep_level(self, level: int) -> None:
        """0: awake; 1: weights offloaded to host memory; 2: weights and KV cache discarded."""
        for i, gauge in enumerate(self.sleep_states.values()):
            gauge.set(1 if i == level else 0)

    def count_success(self, reason: str) -> None:
        child = self.success.get(reason)
        if child is None:
            child = self.success[reason] = self.success_family.labels(*self.labels, reason)
        child.inc()


class StatLogger:
    """Feeds vLLM's Prometheus metrics from every engine step and, unless disabled, logs a summary line every
    `interval_s`.

    Every metric carries the labels `model_name` and `engine` (the data-parallel rank), as vLLM's do, and the
    scheduler stats are kept per engine; `last` sums them over the engines (KV usage: the mean). The engines send
    their scheduler stats to every API server process, so with several of those only one
    (`record_engine_counters=True`) turns them into counter increments and per-step observations; the per-request
    metrics come from the outputs each process received for its own requests.
    """

    def __init__(self, config, num_gpu_blocks: int | None = None, log_interval_s: float | None = 10.0,
                 num_engines: int = 1, record_engine_counters: bool = True, kv_capacity: list | None = None) -> None:
        self.model_name = config.model_config.served_model_name[0]
        self.interval = log_interval_s
        m = vllm_metrics(config.model_config.max_model_len, config.cache_config)
        self.engines = [_EngineStats(m, self.model_name, e) for e in range(num_engines)]
        self.record_engine_counters = record_engine_counters
        lora = getattr(config, "lora_config", None)
        self.max_lora = lora.max_loras if lora is not None else None
        self._lora_info = m.lora_info
        info = {k: str(v) for k, v in dataclasses.asdict(config.cache_config).items()}
        info["num_gpu_blocks"] = str(num_gpu_blocks)
        for e in range(num_engines):
            m.cache_config_info.labels(**info, engine=str(e)).set(1)
            for group, blocks, requests in kv_capacity or []:  # the first engine's; DP engines are alike
                m.kv_group_blocks.labels(self.model_name, str(e), group).set(blocks)
                m.kv_group_requests.labels(self.model_name, str(e), group).set(requests)
        spec = getattr(config, "speculative_config", None)
        if spec is not None:
            for e in self.engines:
                e.spec = SpecDecodingMetrics(spec.num_speculative_tokens, e.labels)
        self._last_log = time.monotonic()

    @property
    def last(self) -> SchedulerStats | None:
        return combine_scheduler_stats([e.last for e in self.engines if e.last is not None])

    def engine_stats(self, engine: int) -> SchedulerStats | None:
        return self.engines[engine].last

    def record_step(self, stats: SchedulerStats | None, iteration: IterationStats | None, engine: int = 0) -> None:
        e = self.engines[engine]
        if stats is not None:
            self._record_scheduler(e, stats)
        if iteration is not None:
            self._record_iteration(e, iteration)
        self.maybe_log()

    def _record_scheduler(self, e: _EngineStats, stats: SchedulerStats) -> None:
        if self.max_lora is not None:  # one sample: the latest snapshot's adapters (vLLM's shape)
            self._lora_info.clear()
            self._lora_info.labels(str(self.max_lora), ",".join(sorted(stats.waiting_lora_adapters)),
                                   ",".join(sorted(stats.running_lora_adapters))).set(time.time())
        e.running.set(stats.num_running_reqs)
        e.waiting.set(stats.num_waiting_reqs)
        e.waiting_deferred.set(stats.num_deferred_reqs)
        e.waiting_capacity.set(stats.num_waiting_reqs - stats.num_deferred_reqs)
        e.kv_usage.set(stats.kv_cache_usage)
        dq, dh = stats.prefix_cache_queries - e.prev_queries, stats.prefix_cache_hits - e.prev_hits
        dp = stats.num_preemptions - e.prev_preempt
        if dq > 0:
            e.window_queries += dq
        if dh > 0:
            e.window_hits += dh
        if self.record_engine_counters:
            if dq > 0:
                e.prefix_queries.inc(dq)
            if dh > 0:
                e.prefix_hits.inc(dh)
            if dp > 0:
                e.preemptions.inc(dp)
            if stats.num_batched_tokens > 0:
                e.iteration_tokens.observe(stats.num_batched_tokens)
        e.prev_queries, e.prev_hits = stats.prefix_cache_queries, stats.prefix_cache_hits
        e.prev_preempt = stats.num_preemptions
        if e.spec is not None:
            e.spec.observe(stats.spec_decoding_stats, prometheus=self.record_engine_counters)
        e.last = stats

    def _record_iteration(self, e: _EngineStats, it: IterationStats) -> None:
        if it.num_prompt_tokens:
            e.prompt_tokens.inc(it.num_prompt_tokens)
            local_compute, local_hit, _external = e.by_source
            local_compute.inc(it.prompt_tokens_computed)
            local_hit.inc(it.prompt_tokens_cached + it.prompt_tokens_recomputed)
            e.prompt_tokens_cached.inc(it.prompt_tokens_cached)
            e.prompt_tokens_recomputed.inc(it.prompt_tokens_recomputed)
        if it.num_generation_tokens:
            e.generation_tokens.inc(it.num_generation_tokens)
        e.prompt_since += it.num_prompt_tokens
        e.gen_since += it.num_generation_tokens
        for t in it.time_to_first_tokens_s:
            e.ttft.observe(t)
        for t, n in it.inter_token_latencies_s.items():
            observe_n(e.itl, t, n)
            observe_n(e.tpot_deprecated, t, n)
        for n in it.n_params:
            e.params_n.observe(n)
        for n in it.max_num_generation_tokens:
            e.max_generation_tokens.observe(n)
        for f in it.finished:
            e.count_success(f.finish_reason)
            e.e2e.observe(f.e2e_latency)
            e.request_prompt_tokens.observe(f.num_prompt_tokens)
            e.request_generation_tokens.observe(f.num_generation_tokens)
            e.prefill_kv_computed.observe(f.num_prompt_tokens - f.num_cached_tokens)
            if f.max_tokens_param:
                e.params_max_tokens.observe(f.max_tokens_param)
            if f.queued_time is not None:
                e.queue_time.observe(f.queued_time)
            if f.prefill_time is not None:
                e.prefill_time.observe(f.prefill_time)
                e.decode_time.observe(f.decode_time)
                e.inference_time.observe(f.inference_time)
            if f.mean_time_per_output_token is not None:
                e.request_tpot.observe(f.mean_time_per_output_token)

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
            line = e.spec.log_line() if e.spec is not None else None
            if line is not None:
                logger.info("%s%s", prefix, line)
            e.prompt_since = e.gen_since = 0
            e.window_queries = e.window_hits = 0
        self._last_log = now
