"""The data behind vLLM's per-request metrics: what the scheduler reports (start record once, with the first
tokens; recomputed cached tokens; tokens per step; deferred waiting requests) and what the output processor makes
of it (phase times from the core's clock, inter-token latencies, prompt tokens by source, per-request records)."""
from __future__ import annotations

from tests.core.test_scheduler import fake_step, make_scheduler, req
from tokenmill.core.messages import EngineCoreOutput, EngineCoreRequest, FinishReason, RequestStartStats
from tokenmill.engine.output_processor import OutputProcessor
from tokenmill.metrics.prometheus import build_1_2_5_buckets
from tokenmill.sampling_params import SamplingParams


def test_start_stats_sent_once_with_the_first_tokens():
    s = make_scheduler(max_tokens_step=8)  # a 10-token prompt takes two chunks
    s.add_request(req("a", 10, max_tokens=3))
    starts, batched = [], []
    while s.has_unfinished_requests():
        _, outs = fake_step(s)
        starts += [(len(o.new_token_ids), o.start_stats) for o in outs.outputs]
        batched.append(s.make_stats().num_batched_tokens)
    assert [n for n, _ in starts] == [1, 1, 1]
    first = starts[0][1]
    assert first is not None and all(st is None for _, st in starts[1:])
    assert 0 < first.queued_ts <= first.scheduled_ts and first.num_recomputed_tokens == 0
    # tokens scheduled per step: two prefill chunks, then one decode token per step until max_tokens
    assert batched == [8, 2, 1, 1]
    assert s.make_stats().num_batched_tokens == 0  # each snapshot reports the steps since the previous one


def test_recomputed_tokens_of_a_fully_cached_prompt():
    s = make_scheduler(block_size=4)
    s.add_request(req("a", 8, max_tokens=1))
    while s.has_unfinished_requests():
        fake_step(s)
    # The same 8 tokens (two full blocks, both cached): the second block is computed again.
    s.add_request(req("b", 8, max_tokens=1))
    _, outs = fake_step(s)
    (o,) = outs.outputs
    assert o.num_cached_tokens == 4 and o.start_stats.num_recomputed_tokens == 4
    # 9 tokens: two cached blocks and one new token, nothing recomputed.
    s.add_request(req("c", 9, max_tokens=1))
    _, outs = fake_step(s)
    (o,) = outs.outputs
    assert o.num_cached_tokens == 8 and o.start_stats.num_recomputed_tokens == 0


def test_deferred_waiting_requests_are_those_held_for_their_grammar():
    s = make_scheduler()

    class Pending:  # a grammar that never finishes compiling
        def done(self):
            return False
    s.add_request(req("a", 4))
    s.requests["a"].grammar_future = Pending()
    s.structured.ready = lambda r: False
    s.add_request(req("b", 4))
    fake_step(s)
    st = s.make_stats()
    assert (st.num_waiting_reqs, st.num_deferred_reqs, st.num_running_reqs) == (1, 1, 1)


def feed(op, rid, ids, ts, finish=None, start=None, cached=0):
    return op.process_outputs([EngineCoreOutput(rid, ids, finish_reason=finish, num_cached_tokens=cached,
                                                start_stats=start)], engine_timestamp=ts)


def test_iteration_stats_from_core_times():
    op = OutputProcessor(None, log_stats=True, max_model_len=100)
    prompt = list(range(12))
    params = SamplingParams(n=2, max_tokens=None, detokenize=False)
    for i in range(2):
        op.add_request(EngineCoreRequest(f"{i}_r", prompt, params, arrival_time=0.0), None, "r", i, 2)
    start = RequestStartStats(queued_ts=9.0, scheduled_ts=9.5, num_recomputed_tokens=4)
    it = op.process_outputs([EngineCoreOutput("0_r", [5], num_cached_tokens=8, start_stats=start),
                             EngineCoreOutput("1_r", [6], start_stats=RequestStartStats(9.0, 9.75))],
                            engine_timestamp=10.0).iteration_stats
    assert it.num_prompt_tokens == 24 and it.num_generation_tokens == 2 and len(it.time_to_first_tokens_s) == 2
    assert (it.prompt_tokens_computed, it.prompt_tokens_cached, it.prompt_tokens_recomputed) == (16, 8, 4)
    assert it.inter_token_latencies_s == {}
    it = op.process_outputs([EngineCoreOutput("0_r", [7]), EngineCoreOutput("1_r", [8])],
                            engine_timestamp=10.25).iteration_stats
    assert it.inter_token_latencies_s == {0.25: 2}  # both sequences share the previous step's timestamp
    it = feed(op, "0_r", [9, 9], 11.25, FinishReason.STOP).iteration_stats
    assert it.inter_token_latencies_s == {1.0: 1} and it.n_params == []  # the request is not finished yet
    (f,) = it.finished
    assert (f.finish_reason, f.num_prompt_tokens, f.num_generation_tokens, f.num_cached_tokens) == ("stop", 12, 4, 8)
    assert f.max_tokens_param == 88  # max_tokens=None: up to max_model_len
    assert (f.queued_time, f.prefill_time, f.decode_time, f.inference_time) == (0.5, 0.5, 1.25, 1.75)
    assert f.mean_time_per_output_token == 1.25 / 3
    it = feed(op, "1_r", [], 12.0, FinishReason.LENGTH).iteration_stats
    (f,) = it.finished
    assert (f.queued_time, f.prefill_time, f.decode_time, f.num_generation_tokens) == (0.75, 0.25, 0.25, 2)
    assert it.n_params == [2] and it.max_num_generation_tokens == [4]


def test_a_request_that_never_ran_has_no_phase_times():
    op = OutputProcessor(None, log_stats=True)
    op.add_request(EngineCoreRequest("r", [1, 2], SamplingParams(max_tokens=5, detokenize=False), 0.0), None, "r",
                   0, 1)
    (f,) = feed(op, "r", [], 5.0, FinishReason.ABORT).iteration_stats.finished
    assert f.finish_reason == "abort" and f.queued_time is None and f.prefill_time is None
    assert f.mean_time_per_output_token is None and f.max_tokens_param == 5


def test_1_2_5_buckets():
    assert build_1_2_5_buckets(100) == [1, 2, 5, 10, 20, 50, 100]
    assert build_1_2_5_buckets(512)[-1] == 500 and build_1_2_5_buckets(1) == [1]
