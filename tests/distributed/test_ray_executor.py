"""The ray executor on CPU against a local Ray cluster this module starts: TP=2 gives TP=1's greedy tokens, a
killed actor stops the engine with an error naming its rank, and a world larger than the cluster fails at start-up
with what was found. Rank placement across nodes is checked as a pure function (no multi-node cluster here)."""
from __future__ import annotations

import time

import pytest
import torch

from tests.distributed.engine_outputs import ENGINE
from tokenmill import LLM, SamplingParams
from tokenmill.executor.ray_utils import NodeResources, Placement, assign_ranks, check_world_fits

pytestmark = pytest.mark.timeout(180)

PROMPTS = ["Hello, my name is", "The quick brown fox jumps over the lazy dog because it", "深度学习的优势是什么？"]
CLUSTER_CPUS = 3  # room for TP=2 (one CPU bundle per rank) and not for TP=4


@pytest.fixture(scope="module")
def ray_cluster():
    ray = pytest.importorskip("ray", reason="Ray is optional: pip install 'tokenmill[ray]'")
    if ray.is_initialized():
        ray.shutdown()
    ray.init(address="local", num_cpus=CLUSTER_CPUS, num_gpus=torch.cuda.device_count(), include_dashboard=False,
             object_store_memory=80 * 1024 * 1024, log_to_driver=False)
    yield ray
    ray.shutdown()


@pytest.fixture(scope="module")
def model(tiny_model_factory):
    return tiny_model_factory("qwen2")


def _greedy(llm: LLM, max_tokens: int = 8) -> list[list[int]]:
    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, sp, use_tqdm=False)]


@pytest.fixture(scope="module")
def ray_llm(ray_cluster, model):
    llm = LLM(model, tensor_parallel_size=2, distributed_executor_backend="ray", **ENGINE)
    yield llm
    llm.llm_engine.engine_core.executor.shutdown()


def test_tp2_on_ray_matches_tp1(ray_llm, model, ray_cluster):
    ex = ray_llm.llm_engine.engine_core.executor
    assert type(ex).__name__ == "RayExecutor" and len(ex.actors) == 1
    # Each rank reserved one CPU bundle of the cluster.
    assert ray_cluster.available_resources().get("CPU", 0) == CLUSTER_CPUS - 2
    attn = ex.driver.runner.model.model.layers[0].self_attn
    assert attn.num_heads == 2  # rank 0 holds half the query heads: the model really is split
    got = _greedy(ray_llm)
    ref = _greedy(LLM(model, **ENGINE))
    assert got == ref


def test_world_larger_than_the_cluster_fails_naming_what_was_found(ray_cluster, model, ray_llm):
    with pytest.raises(ValueError, match=rf"= 4 ranks need 4 CPU in the Ray cluster .* but it has "
                                         rf"{CLUSTER_CPUS} CPU across 1 node"):
        LLM(model, tensor_parallel_size=4, distributed_executor_backend="ray", **ENGINE)
    assert len(_greedy(ray_llm, 2)) == len(PROMPTS)  # the running engine is unaffected


def test_killed_actor_stops_the_engine_with_the_rank(ray_llm, ray_cluster):
    from tokenmill.executor.abstract import WorkerDiedError
    engine = ray_llm.llm_engine
    ex = engine.engine_core.executor
    engine.add_request("long", PROMPTS[0], SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))
    for _ in range(3):
        engine.step()
    ray_cluster.kill(ex.actors[0])
    start = time.monotonic()
    with pytest.raises(WorkerDiedError, match=r"rank 1 \(Ray actor pid \d+ on .*\) died .*ray.kill"):
        while time.monotonic() - start < 60:
            engine.step()
    assert time.monotonic() - start < 10
    with pytest.raises(WorkerDiedError, match="rank 1"):  # the engine stays stopped
        ray_llm.generate(PROMPTS[:1], SamplingParams(max_tokens=2), use_tqdm=False)
    # Shutdown released the placement group.
    deadline = time.monotonic() + 10
    while ray_cluster.available_resources().get("CPU", 0) < CLUSTER_CPUS and time.monotonic() < deadline:
        time.sleep(0.1)
    assert ray_cluster.available_resources().get("CPU", 0) == CLUSTER_CPUS


def test_a_call_that_fails_on_one_actor_stops_the_engine_with_its_traceback(ray_cluster, model):
    """An actor that raises (rather than dies) is out of step: the engine stops and reports its error."""
    from tokenmill.executor.abstract import WorkerDiedError
    llm = LLM(model, tensor_parallel_size=2, distributed_executor_backend="ray", **ENGINE)
    engine = llm.llm_engine
    ex = engine.engine_core.executor
    try:
        engine.add_request("long", PROMPTS[1], SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))
        engine.step()
        ex.actors[0].execute_method.remote("no_such_method", (), {})  # only rank 1 runs it, and fails
        start = time.monotonic()
        with pytest.raises(WorkerDiedError, match=r"(?s)rank 1 \(Ray actor .*\) failed; the engine has stopped.*"
                                                  r"Its error:.*AttributeError.*no_such_method"):
            while time.monotonic() - start < 60:
                engine.step()
        assert time.monotonic() - start < 10
    finally:
        ex.shutdown()


def test_ranks_are_numbered_per_node_and_share_the_node_gpus():
    driver = Placement("head", "10.0.0.1", ["3"])
    workers = [Placement("b", "10.0.0.2", ["1"]), Placement("head", "10.0.0.1", ["5"]),
               Placement("b", "10.0.0.2", ["0"])]
    rank0_local, out = assign_ranks(driver, workers, driver_visible=None)
    assert rank0_local == 3
    # The driver's node first (rank 1), then node b in GPU order (ranks 2, 3).
    assert [(a.rank, a.local_rank, a.visible_devices) for a in out] == [(3, 1, "0,1"), (1, 1, "3,5"), (2, 0, "0,1")]
    assert assign_ranks(driver, workers, driver_visible="7,3")[0] == 1
    with pytest.raises(RuntimeError, match="CUDA_VISIBLE_DEVICES='0,1' hides it"):
        assign_ranks(driver, workers, driver_visible="0,1")
    cpu_driver = Placement("head", "10.0.0.1", [])
    _, out = assign_ranks(cpu_driver, [Placement("b", "10.0.0.2", []), Placement("head", "10.0.0.1", [])], None)
    assert [(a.rank, a.local_rank, a.visible_devices) for a in out] == [(2, 0, None), (1, 1, None)]


def test_gpu_world_must_fit_whole_bundles_and_the_driver_node():
    bundle = {"GPU": 1.0, "CPU": 1.0}
    nodes = [NodeResources("head", "10.0.0.1", {"GPU": 4.0, "CPU": 8.0}),
             NodeResources("b", "10.0.0.2", {"GPU": 4.0, "CPU": 8.0})]
    check_world_fits(8, bundle, nodes, "head", "8 ranks")
    with pytest.raises(ValueError, match=r"need 16 GPU .* has 8 GPU across 2 node\(s\) \(node 10.0.0.1: 4 GPU"):
        check_world_fits(16, bundle, nodes, "head", "16 ranks")
    with pytest.raises(ValueError, match=r"this node \(10.0.0.3\) must hold one bundle"):
        check_world_fits(2, bundle, nodes + [NodeResources("cpu", "10.0.0.3", {"CPU": 8.0})], "cpu", "2 ranks")


def test_serving_leaves_gpu_placement_to_ray(monkeypatch):
    """The server's engine-core launcher neither hides GPUs from a ray engine core nor asks its 8 ranks to fit on
    this node (here: none visible)."""
    from types import SimpleNamespace

    from tokenmill.engine import launcher
    monkeypatch.setattr(launcher, "visible_cuda_devices", lambda: [])
    config = SimpleNamespace(device_config=SimpleNamespace(device="cuda"),
                             parallel_config=SimpleNamespace(distributed_executor_backend="ray", world_size=8))
    assert launcher.check_devices(config, 1) is None
    config.parallel_config.distributed_executor_backend = "mp"
    with pytest.raises(ValueError, match="need 8 CUDA devices on this node, but 0 are visible"):
        launcher.check_devices(config, 1)


def test_missing_ray_names_the_extra(monkeypatch):
    import builtins

    from tokenmill.executor.ray_utils import import_ray
    real = builtins.__import__

    def no_ray(name, *args, **kwargs):
        if name == "ray" or name.startswith("ray."):
            raise ImportError("No module named 'ray'")
        return real(name, *args, **kwargs)
    monkeypatch.setattr(builtins, "__import__", no_ray)
    with pytest.raises(ImportError, match=r"pip install 'tokenmill\[ray\]'"):
        import_ray()


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_tp2_on_ray_with_two_gpus_matches_tp1(ray_cluster, model):
    kw = dict(ENGINE, device="cuda", dtype="float32")
    ref = _greedy(LLM(model, **kw))
    llm = LLM(model, tensor_parallel_size=2, distributed_executor_backend="ray", **kw)
    try:
        # Rank 0's GPU is reserved too (by the bundle-holding actor), not only rank 1's.
        assert ray_cluster.available_resources().get("GPU", 0) == torch.cuda.device_count() - 2
        assert _greedy(llm) == ref
    finally:
        llm.llm_engine.engine_core.executor.shutdown()
