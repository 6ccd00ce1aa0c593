"""vLLM's Prometheus metric set (V1 engine, as of vLLM 0.20): the same names, types, label names and buckets, so
Grafana dashboards and alerts written for `vllm serve` work unchanged against `tokenmill serve`.

Left out, because tokenmill has no such feature: multi-modal cache (vllm:mm_cache_*), KV connectors
(vllm:external_prefix_cache_*, vllm:kv_offload_*), and the opt-in KV residency / MFU / NaN-logits metrics behind
flags tokenmill rejects. The spec-decode counters (vllm:spec_decode_*) are registered by metrics/spec_decode.py when
speculative decoding is on. Two families of tokenmill's own, `tokenmill:kv_cache_group_blocks` and
`tokenmill:kv_cache_group_max_requests`, report the KV cache per layer group. `vllm:time_per_output_token_seconds`
(removed in vLLM 0.13, replaced by vllm:inter_token_latency_seconds) is still fed, with the same values, for
dashboards written against older vLLM. vllm:iteration_tokens_total observes the tokens the scheduler put in each
engine step (vLLM approximates that from the step's outputs: whole prompts at their first token).
"""
from __future__ import annotations

import dataclasses

LABELS = ["model_name", "engine"]
PROMPT_TOKEN_SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")
WAITING_REASONS = ("capacity", "deferred")
SLEEP_STATES = ("awake", "weights_offloaded", "discard_all")

TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0]
ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
               80.0]
REQUEST_LATENCY_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                           240.0, 480.0, 960.0, 1920.0, 7680.0]
ITERATION_TOKENS_BUCKETS = [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]
N_BUCKETS = [1, 2, 5, 10, 20]


def build_1_2_5_buckets(max_value: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to max_value (vLLM's buckets for token counts)."""
    out: list[int] = []
    scale = 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_value:
                return out
            out.append(m * scale)
        scale *= 10


def cache_config_labels(cache_config) -> list[str]:
    """The label names of vllm:cache_config_info: every CacheConfig field (vLLM's flag names) and num_gpu_blocks."""
    return [f.name for f in dataclasses.fields(cache_config)] + ["num_gpu_blocks", "engine"]


class VllmMetrics:
    """The metric families, registered once per process (prometheus_client refuses a name twice; with several API
    server processes each registers its own and multiprocess mode merges them). Token-count buckets follow the
    first engine's max_model_len, as vLLM's do.

    Gauges keep the most recent value of a live process ("livemostrecent") so that in multiprocess mode a dead API
    server's last values drop out.
    """

    def __init__(self, max_model_len: int, cache_config) -> None:
        from prometheus_client import Counter, Gauge, Histogram
        L = LABELS
        mode = "livemostrecent"

        def gauge(name: str, doc: str, extra: tuple[str, ...] = ()):
            return Gauge(name, doc, L + list(extra), multiprocess_mode=mode)

        def hist(name: str, doc: str, buckets: list):
            return Histogram(name, doc, L, buckets=buckets)

        tokens = build_1_2_5_buckets(max_model_len)
        # Scheduler state
        self.running = gauge("vllm:num_requests_running", "Requests in the running batch.")
        self.waiting = gauge("vllm:num_requests_waiting", "Requests waiting to be scheduled.")
        self.waiting_by_reason = gauge(
            "vllm:num_requests_waiting_by_reason",
            "Waiting requests by reason: capacity (no room yet) or deferred (held back by a transient constraint: "
            "a grammar still compiling).", ("reason",))
        self.sleep_state = gauge(
            "vllm:engine_sleep_state", "1 for the engine's sleep state (awake, weights_offloaded, discard_all): "
            "sleep level 1 or 2 (LLM.sleep, or POST /sleep with VLLM_SERVER_DEV_MODE=1).", ("sleep_state",))
        self.kv_usage = gauge("vllm:kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0-1).")
        self.cache_config_info = Gauge("vllm:cache_config_info", "The KV-cache configuration, as labels (value 1).",
                                       cache_config_labels(cache_config), multiprocess_mode=mode)
        # Not in vLLM: the KV cache per layer group (full attention, a sliding window), core/kv_cache_groups.py.
        self.kv_group_blocks = gauge("tokenmill:kv_cache_group_blocks", "KV-cache blocks of each layer group.",
                                     ("group",))
        self.kv_group_requests = gauge("tokenmill:kv_cache_group_max_requests",
                                       "Requests of max_model_len tokens each layer group's blocks hold at once.",
                                       ("group",))
        self.lora_info = Gauge("vllm:lora_requests_info", "LoRA adapters of the running and waiting requests "
                               "(comma-separated names) as labels, the value the time of the snapshot.",
                               ["max_lora", "waiting_lora_adapters", "running_lora_adapters"],
                               multiprocess_mode=mode)
        # Counters
        self.prefix_queries = Counter("vllm:prefix_cache_queries",
                                      "Prompt tokens looked up in the prefix cache.", L)
        self.prefix_hits = Counter("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.",
                                   L)
        self.preemptions = Counter("vllm:num_preemptions", "Requests preempted for lack of KV blocks.", L)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens of requests that started generating.", L)
        self.prompt_tokens_by_source = Counter("vllm:prompt_tokens_by_source",
                                               "Prompt tokens by where their KV came from.", L + ["source"])
        self.prompt_tokens_cached = Counter("vllm:prompt_tokens_cached",
                                            "Prompt tokens served from the prefix cache.", L)
        self.prompt_tokens_recomputed = Counter("vllm:prompt_tokens_recomputed",
                                                "Cached prompt tokens computed again (a forward needs a new token).", L)
        self.generation_tokens = Counter("vllm:generation_tokens", "Tokens generated.", L)
        self.success = Counter("vllm:request_success", "Finished requests by finish reason.",
                               L + ["finished_reason"])
        # Histograms of counts
        self.request_prompt_tokens = hist("vllm:request_prompt_tokens", "Prompt length of finished requests.",
                                          tokens)
        self.request_generation_tokens = hist("vllm:request_generation_tokens",
                                              "Tokens generated by finished requests.", tokens)
        self.iteration_tokens = hist("vllm:iteration_tokens_total", "Tokens scheduled per engine step.",
                                     ITERATION_TOKENS_BUCKETS)
        self.max_generation_tokens = hist("vllm:request_max_num_generation_tokens",
                                          "Per finished request, the tokens generated by its longest sequence.", tokens)
        self.params_n = hist("vllm:request_params_n", "The n of finished requests.", N_BUCKETS)
        self.params_max_tokens = hist("vllm:request_params_max_tokens",
                                      "The max_tokens of finished requests.", tokens)
        self.prefill_kv_computed = hist("vllm:request_prefill_kv_computed_tokens",
                                        "Prompt tokens whose KV was computed (not found in the prefix "
                                        "cache), per finished request.", tokens)
        # Histograms of timing intervals
        self.ttft = hist("vllm:time_to_first_token_seconds", "Seconds from arrival to the first generated token.",
                         TTFT_BUCKETS)
        self.itl = hist("vllm:inter_token_latency_seconds", "Seconds between consecutive outputs of a request.",
                        ITL_BUCKETS)
        self.tpot_deprecated = hist("vllm:time_per_output_token_seconds",
                                    "Deprecated alias of vllm:inter_token_latency_seconds (gone from vLLM "
                                    "0.13), kept for older dashboards.", ITL_BUCKETS)
        self.request_tpot = hist("vllm:request_time_per_output_token_seconds",
                                 "Per request: decode time / (generated tokens - 1).", ITL_BUCKETS)
        self.e2e = hist("vllm:e2e_request_latency_seconds", "Seconds from arrival to the last token.",
                        REQUEST_LATENCY_BUCKETS)
        self.queue_time = hist("vllm:request_queue_time_seconds",
                               "Seconds from reaching the engine to first being scheduled.", REQUEST_LATENCY_BUCKETS)
        self.inference_time = hist("vllm:request_inference_time_seconds",
                                   "Seconds from first scheduled to the last token.", REQUEST_LATENCY_BUCKETS)
        self.prefill_time = hist("vllm:request_prefill_time_seconds",
                                 "Seconds from first scheduled to the first token.", REQUEST_LATENCY_BUCKETS)
        self.decode_time = hist("vllm:request_decode_time_seconds",
                                "Seconds from the first token to the last.", REQUEST_LATENCY_BUCKETS)


_METRICS: VllmMetrics | None = None


def vllm_metrics(max_model_len: int, cache_config) -> VllmMetrics:
    global _METRICS
    if _METRICS is None:
        _METRICS = VllmMetrics(max_model_len, cache_config)
    return _METRICS


def observe_n(hist, value: float, n: int) -> None:
    """`n` observations of one value at the cost of one: prometheus_client has no batched observe, and inter-token
    latencies come as {value: count} per step. Falls back to n observe() calls if its internals ever change."""
    bounds = getattr(hist, "_upper_bounds", None)
    if n == 1 or bounds is None or not hasattr(hist, "_sum") or not hasattr(hist, "_buckets"):
        for _ in range(n):
            hist.observe(value)
        return
    hist._sum.inc(value * n)
    for i, bound in enumerate(bounds):
        if value <= bound:
            hist._buckets[i].inc(n)
            break
