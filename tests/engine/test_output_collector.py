"""RequestOutputCollector: DELTA outputs that pile up merge into one; others replace; errors come last."""
import asyncio

from tokenmill.engine.output_collector import RequestOutputCollector
from tokenmill.outputs import CompletionOutput, Logprob, RequestOutput


def out(parts, finished=False, prompt_lp=None, cached=0):
    return RequestOutput("r", "p", [1, 2], prompt_lp, [
        CompletionOutput(i, text, list(ids), cum, [{t: Logprob(-0.5)} for t in ids], reason)
        for i, text, ids, cum, reason in parts], finished, num_cached_tokens=cached)


def test_pending_delta_outputs_merge_per_sequence():
    async def run():
        c = RequestOutputCollector(delta=True)
        c.put_nowait(out([(0, "He", [5], -0.5, None)], prompt_lp=[None, {2: Logprob(-1.0)}]))
        c.put_nowait(out([(1, "A", [9], -0.5, None)]))                       # n=2: the other sequence
        c.put_nowait(out([(0, "llo", [6, 7], -1.5, "stop"), (1, "B", [8], -1.0, "length")], finished=True,
                         cached=16))
        got = await c.get()
        assert got.finished and got.num_cached_tokens == 16 and got.prompt_logprobs is not None
        s0, s1 = got.outputs
        assert (s0.index, s0.text, s0.token_ids, s0.cumulative_logprob, s0.finish_reason) == \
            (0, "Hello", [5, 6, 7], -1.5, "stop")
        assert [list(lp) for lp in s0.logprobs] == [[5], [6], [7]]
        assert (s1.index, s1.text, s1.token_ids, s1.finish_reason) == (1, "AB", [9, 8], "length")
    asyncio.run(run())


def test_consumer_in_step_gets_each_output_and_error_after_pending():
    async def run():
        c = RequestOutputCollector(delta=True)
        waiter = asyncio.ensure_future(c.get())
        await asyncio.sleep(0)
        c.put_nowait(out([(0, "a", [1], -0.1, None)]))
        assert (await waiter).outputs[0].text == "a"
        c.put_nowait(out([(0, "b", [2], -0.2, None)]))
        c.put_nowait(RuntimeError("engine died"))
        assert (await c.get()).outputs[0].text == "b"
        err = await c.get()
        assert isinstance(err, RuntimeError)
    asyncio.run(run())


def test_cumulative_outputs_replace():
    async def run():
        c = RequestOutputCollector(delta=False)
        c.put_nowait(out([(0, "a", [1], -0.1, None)]))
        c.put_nowait(out([(0, "ab", [1, 2], -0.3, None)]))
        got = await c.get()
        assert got.outputs[0].text == "ab" and got.outputs[0].token_ids == [1, 2]
    asyncio.run(run())
