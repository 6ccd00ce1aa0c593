"""The scheduler taking several sampled tokens per request in one step (k + 1 when k draft tokens are verified),
checked with a fake runner: every stop condition is tested token by token, so the output ends exactly where
one-token steps end it, and the tokens past a stop are dropped (with their logprobs rows)."""
from __future__ import annotations

import pytest

from tests.core.test_scheduler import make_scheduler
from tokenmill.core.messages import EngineCoreRequest, FinishReason, LogprobsLists
from tokenmill.core.sched_output import ModelRunnerOutput
from tokenmill.sampling_params import SamplingParams

# What each request's model would emit, token after token.
STREAMS = {"stop": [5, 6, 42, 8, 9, 10, 11], "eos": [3, 99, 4, 4, 99, 5, 6, 7], "len": [20, 21, 22, 23, 24, 25, 26],
           "plain": [30, 31, 32, 33, 34, 35, 36, 37, 38]}


def _params(rid: str) -> SamplingParams:
    kw = {"stop": dict(stop_token_ids=[42], max_tokens=9), "eos": dict(min_tokens=3, max_tokens=9, logprobs=1),
          "len": dict(max_tokens=5), "plain": dict(max_tokens=8, logprobs=0)}[rid]
    sp = SamplingParams(**kw)
    sp.update_from_tokenizer(eos_token_id=99, bad_words_ids=None)
    return sp


def _run(k: int):
    """Every request to the end, each step handing each sampling request the next k tokens of its stream (and a
    logprobs row per token whose value names the token). Returns rid -> (tokens, finish reason, stop reason,
    logprob values) and the scheduler."""
    s = make_scheduler(max_model_len=64)
    for i, rid in enumerate(STREAMS):
        s.add_request(EngineCoreRequest(rid, [1, 2, 3 + i], _params(rid), float(i)))
    given = {rid: 0 for rid in STREAMS}
    got = {rid: ([], None, None, []) for rid in STREAMS}
    for _ in range(100):
        if not s.has_unfinished_requests():
            return got, s
        sched = s.schedule()
        ids, toks = [], []
        for rid in sched.num_scheduled_tokens:
            r = s.requests[rid]
            ids.append(rid)
            run = STREAMS[rid][given[rid]:given[rid] + k] if r.num_computed_tokens >= r.num_tokens else []
            given[rid] += len(run)
            toks.append(run)
        flat = [t for run in toks for t in run]
        lp = LogprobsLists([[t] for t in flat], [[-float(t)] for t in flat], [1] * len(flat))
        for o in s.update_from_output(sched, ModelRunnerOutput(ids, toks, logprobs=lp)).outputs:
            tokens, _, _, lps = got[o.request_id]
            tokens += o.new_token_ids
            if o.new_logprobs is not None:
                assert [row[0] for row in o.new_logprobs.token_ids] == o.new_token_ids   # its own rows
                lps += [row[0] for row in o.new_logprobs.logprobs]
            got[o.request_id] = (tokens, o.finish_reason, o.stop_reason, lps)
    raise AssertionError("the scheduler did not finish")


@pytest.mark.parametrize("k", [2, 3])
def test_runs_of_tokens_end_where_single_tokens_end(k):
    one, _ = _run(1)
    many, s = _run(k)
    assert many == one
    assert s.kv.num_free_blocks() == 100 and not s.running


def test_the_stop_conditions_inside_a_run():
    got, _ = _run(3)
    # the stop token is the 3rd of the first run: 8 and 9 after it are dropped
    assert got["stop"][:3] == ([5, 6, 42], FinishReason.STOP, 42)
    # EOS at output 2 is inside min_tokens=3 and does not stop; the next EOS (output 5) does, mid-run
    assert got["eos"][:3] == ([3, 99, 4, 4, 99], FinishReason.STOP, None)
    assert got["eos"][3] == [-3.0, -99.0, -4.0, -4.0, -99.0]            # logprobs rows cut with the tokens
    # max_tokens=5 falls inside the second run of 3
    assert got["len"][:2] == ([20, 21, 22, 23, 24], FinishReason.LENGTH)
    assert got["plain"][:2] == ([30, 31, 32, 33, 34, 35, 36, 37], FinishReason.LENGTH)
    assert got["plain"][3] == [-float(t) for t in range(30, 38)]


def test_a_request_that_asks_no_logprobs_skips_its_rows():
    """Rows are laid out request after request; a request without logprobs still owns its rows."""
    s = make_scheduler()
    for rid, lp in (("a", None), ("b", 0)):
        sp = SamplingParams(max_tokens=10, logprobs=lp)
        sp.update_from_tokenizer(eos_token_id=None, bad_words_ids=None)
        s.add_request(EngineCoreRequest(rid, [1, 2, 3], sp, 0.0))
    sched = s.schedule()
    lp = LogprobsLists([[7], [8], [9], [10], [11]], [[-7.0], [-8.0], [-9.0], [-10.0], [-11.0]], [1] * 5)
    outs = s.update_from_output(sched, ModelRunnerOutput(["a", "b"], [[7, 8], [9, 10, 11]], logprobs=lp)).outputs
    by_id = {o.request_id: o for o in outs}
    assert by_id["a"].new_logprobs is None and by_id["a"].new_token_ids == [7, 8]
    assert by_id["b"].new_logprobs.token_ids == [[9], [10], [11]]
    # the runner has not run the tokens that arrived: the next step computes them (the last one samples)
    sched = s.schedule()
    assert sched.num_scheduled_tokens == {"a": 2, "b": 3}
