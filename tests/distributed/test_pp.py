"""Pipeline parallelism end to end on CPU (gloo): PP=2 (2 processes) and TP=2 x PP=2 (4 processes) must give
TP=1's greedy tokens, with more than one micro-batch in flight; stops and aborts of requests in flight leave the
stages consistent; torchrun (external_launcher) runs PP=2 too; impossible layouts fail at start-up."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.distributed.engine_outputs import ENGINE, assert_matches_reference, reference_cache, shutdown
from tests.distributed.engine_outputs import generate as _generate_outputs
from tokenmill import LLM, SamplingParams
from tokenmill.distributed.pp import PPMissingLayer, pp_layer_range

# A broken pipeline hangs rather than fails: bound every test well below the suite's default.
pytestmark = pytest.mark.timeout(180)

# More prompts than one micro-batch takes (each takes ceil(unfinished / pp)), so several are in flight.
PROMPTS = ["Hello, my name is", "The quick brown fox jumps over the lazy dog because it", "深度学习的优势是什么？",
           "One, two, three,", "In 1492 Columbus", "def fib(n):"]
MAX_TOKENS = 8
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def generate_outputs(llm: LLM):
    return _generate_outputs(llm, PROMPTS, MAX_TOKENS)


@pytest.fixture(scope="module")
def models(tiny_model_factory):
    # llama: untied LM head; qwen2: tied, so the last stage holds its own copy of the embedding table.
    return {"llama": tiny_model_factory("llama"), "qwen2": tiny_model_factory("qwen2")}


@pytest.fixture(scope="module")
def reference(models):
    """TP=1 results per model, computed once."""
    return reference_cache(models, PROMPTS, MAX_TOKENS)


@pytest.fixture(scope="module")
def pp_llm(models):
    """(arch, tp, pp) -> an engine on the mp executor; one lives at a time (one world per process)."""
    live: dict[tuple, LLM] = {}

    def get(arch: str, tp: int, pp: int) -> LLM:
        key = (arch, tp, pp)
        if key not in live:
            for llm in live.values():
                shutdown(llm)
            live.clear()
            live[key] = LLM(models[arch], tensor_parallel_size=tp, pipeline_parallel_size=pp, **ENGINE)
        return live[key]
    yield get
    for llm in live.values():
        shutdown(llm)


def test_layer_split():
    assert [pp_layer_range(2, r, 2) for r in range(2)] == [(0, 1), (1, 2)]
    assert [pp_layer_range(5, r, 2) for r in range(2)] == [(0, 3), (3, 5)]
    assert [pp_layer_range(10, r, 4) for r in range(4)] == [(0, 2), (2, 5), (5, 8), (8, 10)]
    assert pp_layer_range(7, 0, 1) == (0, 7)
    with pytest.raises(ValueError, match=r"num_hidden_layers \(2\) is smaller than pipeline_parallel_size \(3\)"):
        pp_layer_range(2, 0, 3)


@pytest.mark.parametrize("arch,tp,pp", [("llama", 1, 2), ("qwen2", 1, 2), ("llama", 2, 2)])
def test_pipeline_matches_tp1(reference, pp_llm, arch, tp, pp):
    llm = pp_llm(arch, tp, pp)
    ref_greedy, ref_seeded, ref_plp = reference(arch)
    core = llm.llm_engine.engine_core
    ex = core.executor
    assert type(ex).__name__ == "MultiprocExecutor" and len(ex.workers) == tp * pp - 1
    assert core.max_concurrent_batches == pp and not core.async_scheduling
    # The driver is stage 0: it holds the embedding and layer 0 only, and no KV cache for layer 1.
    runner = ex.driver.runner
    model = runner.model
    assert isinstance(model.model.layers[1], PPMissingLayer) and isinstance(model.model.norm, PPMissingLayer)
    assert isinstance(model.lm_head, PPMissingLayer)
    assert not any(n.startswith(("model.layers.1.", "lm_head.", "model.norm.")) for n, _ in model.named_parameters())
    assert runner.kv_caches[0].numel() > 0 and runner.kv_caches[1].numel() == 0
    core.max_batches_in_flight = 0
    greedy, seeded, plp = generate_outputs(llm)
    assert core.max_batches_in_flight == pp  # the pipeline was full at least once
    assert_matches_reference((greedy, seeded, plp), (ref_greedy, ref_seeded, ref_plp))


def test_stop_and_abort_in_flight(reference, pp_llm):
    """A request stopped by a stop token, one capped by max_tokens and one aborted while its batch is in flight:
    the others still get TP=1's tokens, every KV block comes back, and the engine keeps serving correctly."""
    ref = [t for t, _ in reference("llama")[0]]
    llm = pp_llm("llama", 1, 2)
    engine, core = llm.llm_engine, llm.llm_engine.engine_core
    stop_at = ref[1][3]
    engine.add_request("long", PROMPTS[0], SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))
    engine.add_request("stop", PROMPTS[1], SamplingParams(temperature=0, max_tokens=MAX_TOKENS,
                                                          stop_token_ids=[stop_at]))
    engine.add_request("short", PROMPTS[2], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    engine.add_request("other", PROMPTS[3], SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))
    final, aborted = {}, False
    for _ in range(200):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
        in_flight = {rid for sched, _ in core._batches for rid in sched.num_scheduled_tokens}
        if not aborted and "long" in in_flight and len(final) >= 1:
            engine.abort_request("long")
            aborted = True
    assert aborted
    assert "long" not in final or final["long"].outputs[0].finish_reason == "abort"
    stop = final["stop"].outputs[0]
    assert stop.token_ids == ref[1][:ref[1].index(stop_at) + 1] and stop.finish_reason == "stop"
    assert final["short"].outputs[0].token_ids == ref[2][:3]
    assert final["other"].outputs[0].token_ids == ref[3]
    sched = core.scheduler
    assert not sched.has_unfinished_requests() and not core._batches
    assert sched.kv.num_free_blocks() == sched.kv.num_blocks
    # The stages forgot the finished requests and the engine still matches TP=1 afterwards.
    greedy, _, _ = generate_outputs(llm)
    assert [t for t, _ in greedy] == ref


def test_external_launcher_pipeline_under_torchrun(models, reference, tmp_path):
    from tokenmill.distributed import get_open_port
    out = tmp_path / "tokens.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
           str(get_open_port()), os.path.join(os.path.dirname(__file__), "torchrun_generate.py"), models["qwen2"],
           str(out), json.dumps(PROMPTS), str(MAX_TOKENS), "1", "2"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, "\n".join(ln for ln in proc.stderr.splitlines() if " INFO " not in ln)[-4000:]
    assert json.loads(out.read_text()) == [tokens for tokens, _ in reference("qwen2")[0]]


def test_bad_pipeline_layouts_fail_at_start_up(models):
    from tokenmill.config.args import parse_serve_args
    from tokenmill.config.engine_args import create_engine_config
    kwargs, _ = parse_serve_args([models["llama"], "-pp", "2", "-tp", "2"])
    assert kwargs == dict(model=models["llama"], pipeline_parallel_size=2, tensor_parallel_size=2)
    cfg = create_engine_config(model=models["llama"], pipeline_parallel_size=2)
    assert cfg.parallel_config.world_size == 2 and cfg.scheduler_config.async_scheduling is False
    with pytest.raises(ValueError, match="async_scheduling=True cannot be combined with pipeline_parallel_size=2"):
        create_engine_config(model=models["llama"], pipeline_parallel_size=2, async_scheduling=True)
    with pytest.raises(ValueError, match=r"pipeline_parallel_size \(3\) is larger than the model's "
                                         r"num_hidden_layers \(2\)"):
        create_engine_config(model=models["llama"], pipeline_parallel_size=3)
    with pytest.raises(ValueError, match="pipeline_parallel_size=2.* not supported yet.*not on ray"):
        create_engine_config(model=models["llama"], pipeline_parallel_size=2, distributed_executor_backend="ray")
