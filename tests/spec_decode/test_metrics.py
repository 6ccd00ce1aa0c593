"""Spec-decode counters as vLLM names them: offline through LLM.get_metrics(), in Prometheus and in the periodic
stats log line."""
from __future__ import annotations

from prometheus_client import REGISTRY

from tests.spec_decode.conftest import cycle_prompt, make_llm
from tests.spec_decode.test_greedy_exact import NGRAM
from tokenmill.core.messages import SchedulerStats, SpecDecodingStats
from tokenmill.sampling_params import SamplingParams


def test_offline_counters_agree_with_the_steps_taken(cycle_model):
    """One request alone: every step gives 1 token plus the drafts it accepted, so accepted = tokens - steps."""
    llm = make_llm(cycle_model, NGRAM)
    engine = llm.llm_engine
    engine.add_request("r", {"prompt_token_ids": cycle_prompt(700, 10)}, SamplingParams(temperature=0, max_tokens=30))
    steps, tokens = 0, 0
    while engine.has_unfinished_requests():
        outs = engine.step()
        steps += 1
        for o in outs:
            tokens = len(o.outputs[0].token_ids)
    m = {x.name: x for x in llm.get_metrics()}
    drafts, draft_tokens = m["vllm:spec_decode_num_drafts"].value, m["vllm:spec_decode_num_draft_tokens"].value
    accepted = m["vllm:spec_decode_num_accepted_tokens"].value
    per_pos = m["vllm:spec_decode_num_accepted_tokens_per_pos"].values
    assert tokens == 30 and accepted == tokens - steps and accepted > 0
    assert 0 < drafts <= steps - 1 and drafts <= draft_tokens <= 4 * drafts
    assert len(per_pos) == 4 and sum(per_pos) == accepted and per_pos == sorted(per_pos, reverse=True)
    assert all(set(x.labels) == {"model_name", "engine"} for x in m.values())


def test_no_speculation_no_counters(cycle_model):
    assert make_llm(cycle_model).get_metrics() == []   # nor any engine record before the first step


def test_engine_records_count_preemptions(cycle_model):
    """Without speculation get_metrics() has vLLM's engine records and no spec-decode counter; a KV pool too small
    for the batch shows in vllm:num_preemptions (outputs that may stop early: with ignore_eos the scheduler admits
    only what the pool holds to the end)."""
    llm = make_llm(cycle_model, num_gpu_blocks_override=16, block_size=16, max_model_len=128,
                   enable_prefix_caching=False)
    prompts = [{"prompt_token_ids": cycle_prompt(700 + i, 40)} for i in range(4)]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=60), use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [60] * 4
    m = {x.name: x for x in llm.get_metrics()}
    assert not any(name.startswith("vllm:spec_decode") for name in m)
    assert m["vllm:num_preemptions"].value > 0
    assert m["vllm:num_requests_running"].value == m["vllm:num_requests_waiting"].value == 0
    assert 0.0 <= m["vllm:kv_cache_usage_perc"].value <= 1.0


def test_prometheus_counters_and_log_line(cycle_model, tm_log):
    import logging

    from tokenmill.metrics.loggers import StatLogger
    config = make_llm(cycle_model, NGRAM).llm_engine.config
    stat = StatLogger(config, 64, log_interval_s=1000.0)
    labels = {"model_name": config.model_config.served_model_name[0], "engine": "0"}

    def value(name, **extra):
        return REGISTRY.get_sample_value(name + "_total", {**labels, **extra}) or 0.0
    before = [value("vllm:spec_decode_num_drafts"), value("vllm:spec_decode_num_draft_tokens"),
              value("vllm:spec_decode_num_accepted_tokens"),
              value("vllm:spec_decode_num_accepted_tokens_per_pos", position="0")]
    s = SpecDecodingStats.new(4)
    s.observe(4, 3)
    s.observe(4, 1)
    s.observe(2, 0)
    stat.record_step(SchedulerStats(spec_decoding_stats=s.take()), None)
    after = [value("vllm:spec_decode_num_drafts"), value("vllm:spec_decode_num_draft_tokens"),
             value("vllm:spec_decode_num_accepted_tokens"),
             value("vllm:spec_decode_num_accepted_tokens_per_pos", position="0")]
    assert [a - b for a, b in zip(after, before)] == [3, 10, 4, 2]
    with tm_log.at_level(logging.INFO, logger="tokenmill"):
        stat.maybe_log(force=True)
    line = [r.getMessage() for r in tm_log.records if "SpecDecoding metrics" in r.getMessage()]
    assert line and "Mean acceptance length: 2.33" in line[0] and "Avg Draft acceptance rate: 40.0%" in line[0]
    assert "Per-position acceptance rate: 0.667, 0.333, 0.333, 0.000" in line[0]
