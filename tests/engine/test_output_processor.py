"""OutputProcessor: output kinds, n > 1 aggregation, stop strings, logprobs shapes, prompt logprobs, abort."""
from __future__ import annotations

import queue

import pytest

from tokenmill.core.messages import EngineCoreOutput, EngineCoreRequest, FinishReason, LogprobsLists
from tokenmill.engine.logprobs import TokenTextCache, make_logprob_dicts
from tokenmill.engine.output_processor import OutputProcessor
from tokenmill.outputs import Logprob
from tokenmill.sampling_params import RequestOutputKind, SamplingParams

CUM, DELTA, FINAL = RequestOutputKind.CUMULATIVE, RequestOutputKind.DELTA, RequestOutputKind.FINAL_ONLY




PROMPT = "Tell me a story."


def add(op, tok, parent_id="req", n=1, q=None, prompt=PROMPT, **kw):
    params = SamplingParams(n=n, **kw)
    ids = tok.encode(prompt)
    children = [parent_id] if n == 1 else [f"{i}_{parent_id}" for i in range(n)]
    for i, cid in enumerate(children):
        op.add_request(EngineCoreRequest(cid, ids, params, arrival_time=100.0), prompt, parent_id, i, n, queue=q)
    return children


def lp_rows(ids, k=3, vocab=1000):
    """Fake logprob rows: chosen token first, then a top-k that sometimes contains it."""
    token_ids, lps, ranks = [], [], []
    for j, t in enumerate(ids):
        top = [t] + [(t + 1 + m) % vocab for m in range(k - 1)] if j % 2 == 0 else [(t + 1 + m) % vocab
                                                                                     for m in range(k)]
        token_ids.append([t] + top)
        lps.append([-0.5 - j] + [-0.1 * (m + 1) for m in range(k)])
        ranks.append(1 if j % 2 == 0 else k + 2)
    return LogprobsLists(token_ids, lps, ranks)


def run(op, child, ids, finish=FinishReason.LENGTH, chunk=2, logprobs=False, stop_reason=None):
    """Feeds `ids` for one child in chunks; returns every RequestOutput and every abort id."""
    outs, aborts = [], []
    for i in range(0, len(ids), chunk):
        new = ids[i:i + chunk]
        last = i + chunk >= len(ids)
        eco = EngineCoreOutput(child, new, new_logprobs=lp_rows(new) if logprobs else None,
                               finish_reason=finish if last else None, stop_reason=stop_reason if last else None)
        res = op.process_outputs([eco])
        outs += res.request_outputs
        aborts += res.reqs_to_abort
    return outs, aborts


def test_cumulative_delta_final_agree(tokenizer):
    text = "Once upon a time, 在一个遥远的地方 🐉 lived a dragon."
    ids = tokenizer.encode(text)
    got = {}
    for kind in (CUM, DELTA, FINAL):
        op = OutputProcessor(tokenizer)
        add(op, tokenizer, output_kind=kind, logprobs=2)
        outs, _ = run(op, "req", ids, logprobs=True)
        got[kind] = outs
        assert not op.has_unfinished_requests() and op.get_num_unfinished_requests() == 0
    cum, delta, final = got[CUM][-1], got[DELTA], got[FINAL]
    assert len(final) == 1 and final[0].finished and len(got[CUM]) == len(delta) > 1
    assert cum.outputs[0].text == text == final[0].outputs[0].text
    assert "".join(o.outputs[0].text for o in delta) == text
    assert sum((o.outputs[0].token_ids for o in delta), []) == ids == cum.outputs[0].token_ids
    assert sum((o.outputs[0].logprobs for o in delta), []) == cum.outputs[0].logprobs
    assert [o.finished for o in delta] == [False] * (len(delta) - 1) + [True]
    c = cum.outputs[0]
    assert (c.finish_reason, c.stop_reason, cum.request_id, cum.prompt) == ("length", None, "req", PROMPT)
    assert cum.prompt_token_ids == tokenizer.encode(PROMPT)
    assert c.cumulative_logprob == pytest.approx(sum(next(iter(d.values())).logprob for d in c.logprobs))
    m = cum.metrics
    assert m.arrival_time == 100.0 and m.first_token_time <= m.last_token_time <= m.finished_time
    assert m.num_generation_tokens == len(ids)


def test_earlier_cumulative_outputs_are_not_mutated(tokenizer):
    op = OutputProcessor(tokenizer)
    add(op, tokenizer)
    outs, _ = run(op, "req", tokenizer.encode("one two three four"), chunk=1)
    assert [len(o.outputs[0].token_ids) for o in outs] == [1, 2, 3, 4]
    assert outs[0].outputs[0].text == "one" and not outs[0].finished


def test_n3_aggregation_any_finish_order(tokenizer):
    seqs = {0: tokenizer.encode(" alpha beta"), 1: tokenizer.encode(" gamma delta epsilon"),
            2: tokenizer.encode(" zeta")}
    for kind in (CUM, DELTA, FINAL):
        for order in ([0, 1, 2], [2, 0, 1], [1, 2, 0]):
            op = OutputProcessor(tokenizer)
            children = add(op, tokenizer, n=3, output_kind=kind, seed=1)
            assert op.get_num_unfinished_requests() == 3
            outs = []
            # Step 1: every child gets its first token, in one batch.
            res = op.process_outputs([EngineCoreOutput(children[i], seqs[i][:1]) for i in (2, 0, 1)])
            outs += res.request_outputs
            for i in order:  # then each child runs to the end, one after the other
                rest = seqs[i][1:]
                res = op.process_outputs([EngineCoreOutput(children[i], rest, finish_reason=FinishReason.LENGTH)])
                outs += res.request_outputs
            assert all(o.request_id == "req" for o in outs)
            assert [o.finished for o in outs][-1] and not any(o.finished for o in outs[:-1])
            if kind == FINAL:
                assert len(outs) == 1
            if kind == DELTA:
                assert [c.index for c in outs[0].outputs] == [0, 1, 2]  # one output per parent, index order
                for i in range(3):
                    parts = [c for o in outs for c in o.outputs if c.index == i]
                    assert "".join(c.text for c in parts) == tokenizer.decode(seqs[i])
                    assert sum((c.token_ids for c in parts), []) == seqs[i]
            else:
                last = outs[-1]
                assert [c.index for c in last.outputs] == [0, 1, 2]
                assert [c.text for c in last.outputs] == [tokenizer.decode(seqs[i]) for i in range(3)]
                assert all(c.finish_reason == "length" for c in last.outputs)
            assert not op.has_unfinished_requests()


def test_stop_string_finishes_and_asks_core_to_abort(tokenizer):
    op = OutputProcessor(tokenizer)
    add(op, tokenizer, stop=["END"], output_kind=DELTA)
    ids = tokenizer.encode("some text END and more")
    end_at = next(i for i in range(1, len(ids) + 1) if "END" in tokenizer.decode(ids[:i]))
    res = op.process_outputs([EngineCoreOutput("req", ids[:end_at + 1])])
    assert res.reqs_to_abort == ["req"]
    (out,) = res.request_outputs
    c = out.outputs[0]
    assert out.finished and (c.finish_reason, c.stop_reason) == ("stop", "END")
    assert c.text == "some text " and c.token_ids == ids[:end_at + 1]  # ids kept as generated
    # Late outputs from the core for the stopped request are ignored.
    assert op.process_outputs([EngineCoreOutput("req", ids[end_at + 1:])]).request_outputs == []


def test_stop_string_in_the_core_s_last_step_is_not_aborted(tokenizer):
    op = OutputProcessor(tokenizer)
    add(op, tokenizer, stop=["END"])
    ids = tokenizer.encode("x END")
    res = op.process_outputs([EngineCoreOutput("req", ids, finish_reason=FinishReason.LENGTH)])
    assert res.reqs_to_abort == [] and res.request_outputs[0].outputs[0].finish_reason == "stop"


def test_eos_and_stop_token_ids(tokenizer):
    op = OutputProcessor(tokenizer)
    add(op, tokenizer, "a", skip_special_tokens=False)
    ids = tokenizer.encode("Hi!") + [tokenizer.eos_token_id]
    (out,) = op.process_outputs([EngineCoreOutput("a", ids, finish_reason=FinishReason.STOP)]).request_outputs
    c = out.outputs[0]
    assert (c.text, c.finish_reason, c.stop_reason, c.token_ids) == ("Hi!", "stop", None, ids)  # EOS text left out
    stop_id = tokenizer.encode(" there")[0]
    add(op, tokenizer, "b", stop_token_ids=[stop_id])
    ids = tokenizer.encode("Hi there")
    (out,) = op.process_outputs([EngineCoreOutput("b", ids, finish_reason=FinishReason.STOP,
                                                  stop_reason=stop_id)]).request_outputs
    assert (out.outputs[0].text, out.outputs[0].stop_reason) == ("Hi", stop_id)


def test_logprob_dicts_trim_and_ranks(tokenizer):
    tt = TokenTextCache(tokenizer)
    rows = LogprobsLists(token_ids=[[10, 11, 12, 13, 14], [20, 21, 20, 22, 23]],
                         logprobs=[[-3.0, -0.1, -0.2, -0.3, -0.4], [-0.2, -0.1, -0.2, -0.3, -0.4]], ranks=[7, 2])
    d = make_logprob_dicts(rows, 2, tt)
    assert list(d[0]) == [10, 11, 12] and d[0][10] == Logprob(-3.0, 7, tokenizer.decode([10]))
    assert [d[0][t].rank for t in (11, 12)] == [1, 2]
    assert list(d[1]) == [20, 21] and d[1][20].rank == 2  # chosen is in the top-2: listed once, first
    assert [list(x) for x in make_logprob_dicts(rows, 0, tt)] == [[10], [20]]
    assert [len(x) for x in make_logprob_dicts(rows, -1, tt)] == [5, 4]
    assert all(v.decoded_token is None for x in make_logprob_dicts(rows, 4, None) for v in x.values())
    assert tt(10**7) == ""  # ids past the tokenizer's vocabulary


def test_logprobs_through_processor(tokenizer):
    ids = tokenizer.encode("one two three")
    op = OutputProcessor(tokenizer)
    add(op, tokenizer, "with", logprobs=1)
    add(op, tokenizer, "without")
    add(op, tokenizer, "nodetok", logprobs=2, detokenize=False)
    res = op.process_outputs([EngineCoreOutput(r, ids, new_logprobs=lp_rows(ids, k=3),
                                               finish_reason=FinishReason.LENGTH)
                              for r in ("with", "without", "nodetok")])
    w, wo, nd = (o.outputs[0] for o in res.request_outputs)
    assert len(w.logprobs) == len(ids)
    assert [len(x) for x in w.logprobs] == [1 if j % 2 == 0 else 2 for j in range(len(ids))]
    assert w.cumulative_logprob == pytest.approx(sum(-0.5 - j for j in range(len(ids))))
    assert w.logprobs[0][ids[0]].decoded_token == tokenizer.decode([ids[0]])
    assert wo.logprobs is None and wo.cumulative_logprob is None
    assert nd.text == "" and all(v.decoded_token is None for x in nd.logprobs for v in x.values())


@pytest.mark.parametrize("kind", [CUM, DELTA, FINAL])
def test_prompt_logprobs_across_two_chunks(tokenizer, kind):
    op = OutputProcessor(tokenizer)
    add(op, tokenizer, prompt_logprobs=2, output_kind=kind)
    p = tokenizer.encode(PROMPT)
    targets = p[1:]  # position i predicts prompt token i + 1
    first, second = targets[:2], targets[2:]
    res = op.process_outputs([EngineCoreOutput("req", [], new_prompt_logprobs=lp_rows(first))])
    assert res.request_outputs == []  # a prefill chunk alone shows nothing yet
    gen = tokenizer.encode(" Once")
    outs = op.process_outputs([EngineCoreOutput("req", gen[:1], new_prompt_logprobs=lp_rows(second))]).request_outputs
    outs += op.process_outputs([EngineCoreOutput("req", gen[1:] + [5], finish_reason=FinishReason.LENGTH)]
                               ).request_outputs
    plp = outs[0].prompt_logprobs
    assert len(plp) == len(p) and plp[0] is None
    assert [next(iter(d)) for d in plp[1:]] == targets  # chosen = the actual prompt token, first
    assert all(len(d) <= 3 for d in plp[1:])
    if kind == DELTA:
        assert outs[-1].prompt_logprobs is None  # sent once
    else:
        assert outs[-1].prompt_logprobs == plp


def test_abort_parent_child_and_queue(tokenizer):
    op = OutputProcessor(tokenizer)
    q = queue.Queue()
    children = add(op, tokenizer, "p", n=3, q=q, output_kind=DELTA)
    add(op, tokenizer, "solo")
    res = op.process_outputs([EngineCoreOutput(c, tokenizer.encode(" hi")) for c in children + ["solo"]])
    assert [o.request_id for o in res.request_outputs] == ["solo"]  # "p" went to its queue
    assert q.qsize() == 1 and len(q.get_nowait().outputs) == 3
    assert op.abort_requests([children[1]]) == [children[1]]
    assert op.get_num_unfinished_requests() == 3
    assert op.abort_requests(["p", "unknown"]) == [children[0], children[2]]
    final = q.get_nowait()
    assert final.finished and {c.finish_reason for c in final.outputs} == {"abort"}
    assert op.abort_requests("solo") == ["solo"] and not op.has_unfinished_requests()
    assert op.process_outputs([EngineCoreOutput("solo", [1])]).request_outputs == []


def test_core_abort_and_bad_adds(tokenizer):
    op = OutputProcessor(tokenizer)
    add(op, tokenizer)
    (out,) = op.process_outputs([EngineCoreOutput("req", [], finish_reason=FinishReason.ABORT)]).request_outputs
    assert out.finished and out.outputs[0].finish_reason == "abort" and out.outputs[0].text == ""
    add(op, tokenizer)
    with pytest.raises(ValueError):
        add(op, tokenizer)
    with pytest.raises(ValueError):
        op.add_request(EngineCoreRequest("x", [1], SamplingParams(), 0.0), None, "x", 1, 1)


def test_log_stats(tokenizer):
    op = OutputProcessor(tokenizer, log_stats=True)
    add(op, tokenizer)
    res = op.process_outputs([EngineCoreOutput("req", [1, 2, 3], finish_reason=FinishReason.LENGTH)])
    s = res.iteration_stats
    assert s.num_generation_tokens == 3 and len(s.time_to_first_tokens_s) == 1
    (f,) = s.finished
    assert f.finish_reason == "length" and f.e2e_latency >= 0 and f.num_generation_tokens == 3
    assert OutputProcessor(tokenizer).process_outputs([]).iteration_stats is None


@pytest.mark.parametrize("how", ["finish", "abort"])
def test_finished_requests_are_freed_without_a_garbage_collection(tokenizer, how):
    """A finished (or aborted) request leaves no reference cycle: its state goes as soon as the processor and the
    caller drop it, not at the next full collection (on a busy server those walked thousands of leftovers)."""
    import gc
    import weakref

    class Q(queue.SimpleQueue):
        pass

    op = OutputProcessor(tokenizer)
    q = Q()
    gone = weakref.ref(q)
    add(op, tokenizer, n=2, q=q)
    gc.disable()
    try:
        if how == "finish":
            for child in ("0_req", "1_req"):
                run(op, child, tokenizer.encode("one two"))
        else:
            op.abort_requests("req")
        assert q.qsize() > 0 and op._parents == {} and op._seqs == {}
        del q
        assert gone() is None, "a reference cycle keeps the finished request alive"
    finally:
        gc.enable()


def test_metrics_report_first_scheduling_and_queue_time(tokenizer):
    """RequestMetrics.first_scheduled_time (wall clock) and time_in_queue come from the core's start record, whose
    times are on the core's monotonic clock: moved onto the wall clock by the outputs' timestamp. With n > 1 the
    earliest sequence counts. Without a record (log_stats or not) they stay None."""
    import time

    from tokenmill.core.messages import RequestStartStats
    op = OutputProcessor(tokenizer)
    add(op, tokenizer, n=2, max_tokens=2, output_kind=FINAL)
    before = time.time()
    op.process_outputs([EngineCoreOutput("0_req", [5], start_stats=RequestStartStats(497.0, 498.0)),
                        EngineCoreOutput("1_req", [6], start_stats=RequestStartStats(497.0, 499.5))], 500.0)
    [out] = op.process_outputs([EngineCoreOutput("0_req", [7], finish_reason=FinishReason.LENGTH),
                                EngineCoreOutput("1_req", [8], finish_reason=FinishReason.LENGTH)], 501.0
                               ).request_outputs
    m = out.metrics
    assert m.time_in_queue == 1.0
    assert m.first_token_latency == pytest.approx(m.first_token_time - 100.0)  # vLLM V1's name for the TTFT
    assert before - 2.0 <= m.first_scheduled_time <= time.time() - 2.0 and m.first_scheduled_time < m.first_token_time
    op = OutputProcessor(tokenizer)
    add(op, tokenizer)
    [out] = op.process_outputs([EngineCoreOutput("req", [5], finish_reason=FinishReason.LENGTH)]).request_outputs
    assert out.metrics.first_scheduled_time is None and out.metrics.time_in_queue is None


def test_output_names_the_lora_request_it_ran_under(tokenizer):
    """RequestOutput.lora_request and CompletionOutput.lora_request, as in vLLM: the adapter of the request (None
    without one)."""
    from tokenmill.lora.request import LoRARequest
    lora = LoRARequest("sql", 1, "/adapters/sql")
    op = OutputProcessor(tokenizer)
    ids = tokenizer.encode(PROMPT)
    op.add_request(EngineCoreRequest("a", ids, SamplingParams(), 100.0, lora_request=lora), PROMPT, "a", 0, 1)
    op.add_request(EngineCoreRequest("b", ids, SamplingParams(), 100.0), PROMPT, "b", 0, 1)
    outs = op.process_outputs([EngineCoreOutput("a", [5], finish_reason=FinishReason.LENGTH),
                               EngineCoreOutput("b", [5], finish_reason=FinishReason.LENGTH)]).request_outputs
    assert {o.request_id: o.lora_request for o in outs} == {"a": lora, "b": None}
    assert {o.request_id: o.outputs[0].lora_request for o in outs} == {"a": lora, "b": None}
