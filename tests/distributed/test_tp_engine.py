"""Tensor parallelism end to end on CPU (gloo, 2 ranks): TP=2 must give TP=1's greedy tokens and close logprobs,
through the mp executor and under torchrun (external_launcher); a dead worker must stop the engine with an error
naming it; impossible layouts fail at start-up with the numbers."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from tests.distributed.engine_outputs import ENGINE, assert_matches_reference, reference_cache, shutdown
from tests.distributed.engine_outputs import generate as _generate_outputs
from tokenmill import LLM, SamplingParams

# A broken collective hangs rather than fails: bound every test well below the suite's default.
pytestmark = pytest.mark.timeout(180)

PROMPTS = ["Hello, my name is", "The quick brown fox jumps over the lazy dog because it", "深度学习的优势是什么？"]
MAX_TOKENS = 8
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def generate_outputs(llm: LLM):
    return _generate_outputs(llm, PROMPTS, MAX_TOKENS)


@pytest.fixture(scope="module")
def models(tiny_model_factory, tiny_qwen3_1kv):
    return {"llama": tiny_model_factory("llama"), "qwen2": tiny_model_factory("qwen2"),
            "qwen3_1kv": tiny_qwen3_1kv}


@pytest.fixture(scope="module")
def reference(models):
    """TP=1 results per model, computed once."""
    return reference_cache(models, PROMPTS, MAX_TOKENS)


@pytest.fixture(scope="module")
def tp_llm(models):
    """arch -> a TP=2 engine (mp executor). One process holds one TP engine at a time, so asking for another
    model shuts the previous one down; the kill test reuses the last parity test's engine."""
    live: dict[str, LLM] = {}
    threads = torch.get_num_threads()

    def get(arch: str) -> LLM:
        if arch not in live:
            for llm in live.values():
                shutdown(llm)
            live.clear()
            live[arch] = LLM(models[arch], tensor_parallel_size=2, **ENGINE)
        return live[arch]
    get.threads_before = threads
    yield get
    for llm in live.values():
        shutdown(llm)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3_1kv"])
def test_tp2_matches_tp1(reference, tp_llm, arch):
    llm = tp_llm(arch)
    # The TP=1 reference is built while the TP=2 engine lives in this process: it must neither shard nor talk.
    ref_greedy, ref_seeded, ref_plp = reference(arch)
    ex = llm.llm_engine.engine_core.executor
    assert type(ex).__name__ == "MultiprocExecutor" and len(ex.workers) == 1
    runner = ex.driver.runner
    attn = runner.model.model.layers[0].self_attn
    # Per-rank heads: half the query heads; half the KV heads, or the single KV head replicated on both.
    assert attn.num_heads == 2 and runner.num_kv_heads == attn.num_kv_heads == 1
    assert attn.qkv_proj.kv_replicas == (2 if arch == "qwen3_1kv" else 1)
    greedy, seeded, plp = generate_outputs(llm)
    assert_matches_reference((greedy, seeded, plp), (ref_greedy, ref_seeded, ref_plp))


def test_killed_worker_stops_the_engine_with_the_rank(tp_llm):
    from tokenmill.executor.multiproc import WorkerDiedError
    llm = tp_llm("qwen3_1kv")
    engine = llm.llm_engine
    ex = engine.engine_core.executor
    try:
        engine.add_request("long", PROMPTS[0], SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))
        for _ in range(3):
            engine.step()
        pid = ex.workers[0].pid
        os.kill(pid, signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(WorkerDiedError, match=rf"rank 1 \(pid {pid}\) was killed by SIGKILL"):
            while time.monotonic() - start < 60:
                engine.step()
        assert time.monotonic() - start < 10
        with pytest.raises(WorkerDiedError, match="rank 1"):  # the engine stays stopped
            llm.generate(PROMPTS[:1], SamplingParams(max_tokens=2), use_tqdm=False)
        assert ex.workers[0].proc.poll() is not None
    finally:
        shutdown(llm)
    assert torch.get_num_threads() == tp_llm.threads_before  # rank 0's CPU thread split is undone on shutdown


def test_external_launcher_under_torchrun(models, reference, tmp_path):
    from tokenmill.distributed import get_open_port
    out = tmp_path / "tokens.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
           str(get_open_port()), os.path.join(os.path.dirname(__file__), "torchrun_generate.py"), models["qwen2"],
           str(out), json.dumps(PROMPTS), str(MAX_TOKENS)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(out.read_text()) == [tokens for tokens, _ in reference("qwen2")[0]]


def test_world_larger_than_visible_gpus_fails_naming_both(models, monkeypatch):
    from tokenmill.config.engine_args import create_engine_config
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ValueError, match="needs 4 CUDA devices, but torch sees 1"):
        create_engine_config(model=models["llama"], device="cuda", tensor_parallel_size=4)


def test_flags_parse_and_unsupported_layouts_are_rejected(models):
    from tokenmill.config.args import parse_serve_args
    from tokenmill.config.engine_args import create_engine_config
    kwargs, _ = parse_serve_args([models["llama"], "-tp", "4", "--distributed-executor-backend", "mp",
                                  "--disable-custom-all-reduce", "-n", "1", "-r", "0", "--master-addr", "10.1.2.3",
                                  "--master-port", "1234", "--distributed-timeout-seconds", "60"])
    assert kwargs == dict(model=models["llama"], tensor_parallel_size=4, distributed_executor_backend="mp",
                          disable_custom_all_reduce=True, nnodes=1, node_rank=0, master_addr="10.1.2.3",
                          master_port=1234, distributed_timeout_seconds=60)
    pc = create_engine_config(model=models["llama"], tensor_parallel_size=2).parallel_config
    assert pc.distributed_executor_backend == "mp" and pc.world_size == 2
    for bad, match in [(dict(pipeline_parallel_size=3), r"pipeline_parallel_size \(3\) is larger"),
                       (dict(nnodes=2, node_rank=1, distributed_executor_backend="ray"),
                        "nnodes=2 does not apply to distributed_executor_backend='ray'"),
                       (dict(tensor_parallel_size=2, data_parallel_size=2, distributed_executor_backend="ray"),
                        "ray' with data_parallel_size=2 is not supported yet"),
                       (dict(nnodes=2, node_rank=1), "nnodes=2.* not supported yet.*external_launcher"),
                       (dict(tensor_parallel_size=2, distributed_executor_backend="uni"), "uni.*2 ranks"),
                       (dict(node_rank=1), "node_rank")]:
        with pytest.raises(ValueError, match=match):
            create_engine_config(model=models["llama"], **bad)


def test_head_count_that_does_not_split_fails_before_any_process_starts(models):
    with pytest.raises(ValueError, match=r"num_attention_heads \(4\) is not divisible by tensor_parallel_size "
                                         r"\(3\)"):
        LLM(models["llama"], tensor_parallel_size=3, **ENGINE)


def test_a_rank_that_fails_at_start_up_reports_its_own_error(models, monkeypatch):
    """A start-up error every rank hits (here: a KV cache too small for max_model_len) surfaces as rank 0's own
    exception, not as a dead-worker report, and leaves no worker behind."""
    before = _children()
    with pytest.raises(ValueError, match="max_model_len=256 needs 16 blocks"):
        LLM(models["llama"], tensor_parallel_size=2, **dict(ENGINE, num_gpu_blocks_override=4))
    assert _children() <= before


def _children() -> set[int]:
    import glob
    pids = set()
    for path in glob.glob(f"/proc/{os.getpid()}/task/*/children"):
        with open(path) as f:
            pids.update(int(p) for p in f.read().split())
    return pids


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_tp2_on_two_gpus_matches_tp1(models):
    kw = dict(ENGINE, device="cuda", dtype="float32")
    prompts = PROMPTS
    sp = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    ref = [o.outputs[0].token_ids for o in LLM(models["llama"], **kw).generate(prompts, sp, use_tqdm=False)]
    llm = LLM(models["llama"], tensor_parallel_size=2, **kw)
    try:
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
    finally:
        shutdown(llm)
    assert got == ref
