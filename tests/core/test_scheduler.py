"""Scheduler behaviour with a fake model runner (no model): budgets, chunking, preemption, abort, priority."""
from types import SimpleNamespace

import pytest

from tokenmill.config.cache import CacheConfig
from tokenmill.config.scheduler import SchedulerConfig
from tokenmill.core.messages import EngineCoreRequest, FinishReason
from tokenmill.core.sched_output import ModelRunnerOutput
from tokenmill.core.scheduler import Scheduler
from tokenmill.sampling_params import SamplingParams


def make_scheduler(num_blocks=100, block_size=4, max_tokens_step=32, max_seqs=8, max_model_len=64,
                   chunked=True, policy="fcfs", caching=True, pp=1):
    sc = SchedulerConfig(max_num_batched_tokens=max_tokens_step, max_num_seqs=max_seqs,
                         enable_chunked_prefill=chunked, scheduling_policy=policy)
    sc.finalize(max_model_len)
    cfg = SimpleNamespace(scheduler_config=sc,
                          cache_config=CacheConfig(block_size=block_size, enable_prefix_caching=caching),
                          model_config=SimpleNamespace(max_model_len=max_model_len),
                          parallel_config=SimpleNamespace(pipeline_parallel_size=pp))
    return Scheduler(cfg, num_blocks)


def req(rid, n_prompt, max_tokens=4, priority=0, t=0.0, first=0, **kw):
    sp = SamplingParams(max_tokens=max_tokens, **kw)
    sp.update_from_tokenizer(eos_token_id=None, bad_words_ids=None)
    return EngineCoreRequest(rid, list(range(first, first + n_prompt)), sp, t, priority)


def fake_step(s: Scheduler, token=7):
    out = s.schedule()
    ids, toks = [], []
    for rid, n in out.num_scheduled_tokens.items():
        r = s.requests[rid]
        ids.append(rid)
        toks.append([token] if r.num_computed_tokens >= r.num_tokens else [])
    return out, s.update_from_output(out, ModelRunnerOutput(req_ids=ids, sampled_token_ids=toks))


def run_all(s, limit=500):
    finished = {}
    for _ in range(limit):
        if not s.has_unfinished_requests():
            return finished
        _, outs = fake_step(s)
        for o in outs.outputs:
            if o.finished:
                finished[o.request_id] = o
    raise AssertionError("scheduler did not finish")


def test_budget_and_chunking():
    s = make_scheduler(max_tokens_step=16)
    s.add_request(req("a", 40))
    out = s.schedule()
    assert out.num_scheduled_tokens == {"a": 16}
    s.update_from_output(out, ModelRunnerOutput(req_ids=["a"], sampled_token_ids=[[]]))
    out = s.schedule()
    assert out.num_scheduled_tokens == {"a": 16} and out.scheduled_cached_reqs.num_computed_tokens == [16]


def test_running_first_then_waiting_and_max_num_seqs():
    s = make_scheduler(max_tokens_step=64, max_seqs=2)
    for i in range(3):
        s.add_request(req(f"r{i}", 5, first=i * 100))
    out, _ = fake_step(s)
    assert list(out.num_scheduled_tokens) == ["r0", "r1"]
    out, _ = fake_step(s)
    assert out.num_scheduled_tokens == {"r0": 1, "r1": 1}


def test_no_chunking_waits_for_whole_prompt():
    s = make_scheduler(max_tokens_step=64, chunked=False, max_model_len=64)
    s.add_request(req("a", 40))
    s.add_request(req("b", 40, first=100))
    out = s.schedule()
    assert out.num_scheduled_tokens == {"a": 40}


def test_preemption_then_everything_finishes_and_blocks_return():
    s = make_scheduler(num_blocks=8, block_size=4, max_tokens_step=64, max_model_len=32)
    for i in range(4):
        s.add_request(req(f"r{i}", 6, max_tokens=10, first=i * 50))
    finished = run_all(s)
    assert set(finished) == {f"r{i}" for i in range(4)}
    assert all(o.finish_reason == FinishReason.LENGTH for o in finished.values())
    assert s.make_stats().num_preemptions > 0
    assert s.kv.num_free_blocks() == 8
    assert all(b.ref_cnt == 0 for b in s.kv.pool.blocks)


@pytest.mark.parametrize("kw", [{"ignore_eos": True}, {"min_tokens": 10}])
def test_requests_of_certain_length_are_admitted_only_as_the_pool_holds_them(kw):
    """Outputs certain to run to their length (ignore_eos with no stop, or min_tokens) keep blocks free for their
    growth: a request joins only when the running ones' remaining growth and its own fit the free blocks, so the
    same batch that preempts above runs without a preemption, each request holding at most 4 blocks of the 8."""
    s = make_scheduler(num_blocks=8, block_size=4, max_tokens_step=64, max_model_len=32)
    for i in range(4):
        s.add_request(req(f"r{i}", 6, max_tokens=10, first=i * 50, **kw))
    most_running = 0
    while s.has_unfinished_requests():
        fake_step(s)
        most_running = max(most_running, len(s.running))
    assert s.make_stats().num_preemptions == 0
    assert most_running == 2 and s.kv.num_free_blocks() == 8


def test_a_stop_condition_makes_the_length_uncertain():
    """With a stop token the output may end at any step: such requests join as vLLM admits them (blocks for what
    they compute now), and a pool too small for their growth preempts."""
    s = make_scheduler(num_blocks=8, block_size=4, max_tokens_step=64, max_model_len=32)
    for i in range(4):
        s.add_request(req(f"r{i}", 6, max_tokens=10, first=i * 50, ignore_eos=True, stop_token_ids=[3]))
    run_all(s)
    assert s.make_stats().num_preemptions > 0


def test_abort_anywhere_frees_blocks():
    s = make_scheduler()
    s.add_request(req("a", 10, max_tokens=50))
    s.add_request(req("b", 10, max_tokens=50, first=50))
    fake_step(s)
    s.add_request(req("c", 10, first=90))
    s.finish_requests(["a", "c", "unknown"])
    out = s.schedule()
    assert {"a", "c"} <= out.finished_req_ids
    assert list(out.num_scheduled_tokens) == ["b"]
    s.finish_requests(["b"])
    assert not s.has_unfinished_requests()
    assert s.kv.num_free_blocks() == 100


def test_prefix_hits_counted():
    s = make_scheduler(max_tokens_step=64)
    s.add_request(req("a", 20, max_tokens=1))
    run_all(s)
    s.add_request(req("b", 20, max_tokens=1))
    out = s.schedule()
    assert out.scheduled_new_reqs[0].num_computed_tokens == 16
    assert out.num_scheduled_tokens == {"b": 4}
    st = s.make_stats()
    assert st.prefix_cache_hits == 16 and st.prefix_cache_queries == 40


def test_cache_salt_isolates_prefix_cache():
    """Equal prompts share cached blocks only under equal salts (none counts as a salt of its own)."""
    s = make_scheduler(max_tokens_step=64)

    def hits(rid, salt):
        r = req(rid, 20, max_tokens=1)
        r.cache_salt = salt
        s.add_request(r)
        out = s.schedule()
        n = out.scheduled_new_reqs[0].num_computed_tokens
        s.update_from_output(out, ModelRunnerOutput(req_ids=[rid], sampled_token_ids=[[7]]))
        run_all(s)
        return n
    assert hits("a", "tenant-1") == 0
    assert hits("b", "tenant-2") == 0      # same prompt, other salt: a miss
    assert hits("c", None) == 0            # unsalted requests do not see salted blocks
    assert hits("d", "tenant-1") == 16     # same salt: the 4 full blocks are hits
    assert hits("e", None) == 16


def test_priority_policy_orders_waiting():
    s = make_scheduler(max_seqs=1, policy="priority")
    s.add_request(req("low", 4, priority=5, t=0.0))
    s.add_request(req("high", 4, priority=-1, t=1.0, first=10))
    out = s.schedule()
    assert list(out.num_scheduled_tokens) == ["high"]


def test_stop_tokens_and_min_tokens():
    s = make_scheduler()
    sp = SamplingParams(max_tokens=10, stop_token_ids=[7], min_tokens=3)
    sp.update_from_tokenizer(eos_token_id=None, bad_words_ids=None)
    s.add_request(EngineCoreRequest("a", [1, 2, 3], sp, 0.0))
    finished = run_all(s)
    o = finished["a"]
    assert o.finish_reason == FinishReason.STOP and o.stop_reason == 7
    # the fake model always emits 7: min_tokens=3 keeps it going until 3 outputs exist
    assert s.kv.num_free_blocks() == 100


def test_eos_stop_reason_is_none():
    s = make_scheduler()
    sp = SamplingParams(max_tokens=10)
    sp.update_from_tokenizer(eos_token_id=7, bad_words_ids=None)
    s.add_request(EngineCoreRequest("a", [1, 2, 3], sp, 0.0))
    o = run_all(s)["a"]
    assert o.finish_reason == FinishReason.STOP and o.stop_reason is None


@pytest.mark.parametrize("ignore_eos,want", [(False, None), (True, 7)])
def test_eos_named_in_stop_token_ids(ignore_eos, want):
    """vLLM checks EOS before stop_token_ids: EOS listed in both stops with stop_reason None; with ignore_eos only
    stop_token_ids can stop on it, and stop_reason is its id."""
    s = make_scheduler()
    sp = SamplingParams(max_tokens=10, stop_token_ids=[7], ignore_eos=ignore_eos)
    sp.update_from_tokenizer(eos_token_id=7, bad_words_ids=None)
    s.add_request(EngineCoreRequest("a", [1, 2, 3], sp, 0.0))
    o = run_all(s)["a"]
    assert o.finish_reason == FinishReason.STOP and o.stop_reason == want


def test_max_model_len_caps_length():
    s = make_scheduler(max_model_len=12)
    s.add_request(req("a", 10, max_tokens=100))
    o = run_all(s)["a"]
    assert o.finish_reason == FinishReason.LENGTH
    with pytest.raises(ValueError, match="max_model_len"):
        s.add_request(req("b", 13))


def test_request_needing_more_blocks_than_exist_is_rejected():
    s = make_scheduler(num_blocks=2, block_size=4, max_model_len=64)
    with pytest.raises(ValueError, match="KV blocks"):
        s.add_request(req("a", 20))


def test_pipeline_batches_are_disjoint_and_carry_new_tokens():
    """pp=2: a request whose sample is in flight is not scheduled again; each batch takes at most
    ceil(unfinished / pp) requests; a rescheduled request brings the tokens it gained (for non-sampling stages)."""
    s = make_scheduler(pp=2)
    for rid in "abc":
        s.add_request(req(rid, 4, max_tokens=3))
    first = s.schedule()
    assert list(first.num_scheduled_tokens) == ["a", "b"]  # ceil(3 / 2) requests
    second = s.schedule()
    assert list(second.num_scheduled_tokens) == ["c"]  # a and b are in flight
    assert s.schedule().is_empty  # everything is in flight
    s.update_from_output(first, ModelRunnerOutput(req_ids=["a", "b"], sampled_token_ids=[[11], [12]]))
    third = s.schedule()
    c = third.scheduled_cached_reqs
    assert c.req_ids == ["a", "b"] and c.new_token_ids == [[11], [12]]
    assert third.num_scheduled_tokens == {"a": 1, "b": 1}
    s.update_from_output(second, ModelRunnerOutput(req_ids=["c"], sampled_token_ids=[[13]]))
    fourth = s.schedule()
    assert fourth.scheduled_cached_reqs.new_token_ids == [[13]]
    # Without pipeline parallelism nothing is filled in.
    s1 = make_scheduler()
    s1.add_request(req("x", 4))
    out, _ = fake_step(s1)
    assert s1.schedule().scheduled_cached_reqs.new_token_ids == []


def test_pipeline_never_preempts_a_request_in_flight():
    """Its output would come back for a request that restarted. b runs first, then a; b's decode needs a block and
    none is free: plain fcfs would pick the last running request, a, whose sample is still in flight."""
    s = make_scheduler(num_blocks=2, pp=2, caching=False)
    s.add_request(req("b", 4, max_tokens=8))
    s.add_request(req("a", 4, max_tokens=8))
    first, second = s.schedule(), s.schedule()
    assert list(first.num_scheduled_tokens) == ["b"] and list(second.num_scheduled_tokens) == ["a"]
    s.update_from_output(first, ModelRunnerOutput(req_ids=["b"], sampled_token_ids=[[5]]))
    third = s.schedule()
    assert third.is_empty and "b" in third.finished_req_ids  # b gave up its block instead
    assert s.requests["a"].status.name == "RUNNING" and s.requests["a"].num_output_placeholders == 1
    assert s.requests["b"].status.name == "PREEMPTED"
    s.update_from_output(second, ModelRunnerOutput(req_ids=["a"], sampled_token_ids=[[6]]))
    assert s.requests["a"].output_token_ids == [6]
    assert s.schedule().num_scheduled_tokens == {"a": 1}
