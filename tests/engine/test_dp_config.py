"""Data-parallel flags: parsing, defaults, validation, socket addresses and device slices (no processes)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from tokenmill import envs
from tokenmill.config import ParallelConfig
from tokenmill.config.args import parse_serve_args
from tokenmill.config.frontend import FrontendConfig
from tokenmill.engine.launcher import check_devices, devices_for_rank, make_addresses


def test_vllm_flags_parse_with_short_aliases():
    engine, fe = parse_serve_args("m -dp 4 -dpl 2 -dpr 2 -dpa 10.0.0.1 -dpp 13345 --headless".split())
    assert engine == {"model": "m", "data_parallel_size": 4, "data_parallel_size_local": 2,
                      "data_parallel_start_rank": 2, "data_parallel_address": "10.0.0.1",
                      "data_parallel_rpc_port": 13345}
    assert fe.headless and fe.api_server_count == 1
    engine, fe = parse_serve_args("m --data-parallel-size 2 --api-server-count 3".split())
    assert engine["data_parallel_size"] == 2 and fe.api_server_count == 3


def test_unset_fields_resolve_like_vllm_and_bad_ranks_fail():
    pc = ParallelConfig(data_parallel_size=4)
    assert (pc.data_parallel_size_local, pc.data_parallel_start_rank, pc.data_parallel_address,
            pc.data_parallel_rpc_port) == (4, 0, "127.0.0.1", 29550)
    assert ParallelConfig(data_parallel_size=4, data_parallel_start_rank=3).data_parallel_size_local == 1
    assert ParallelConfig(data_parallel_size=2, data_parallel_size_local=0).data_parallel_size_local == 0
    for kwargs, name in ((dict(data_parallel_size=0), "data_parallel_size"),
                         (dict(data_parallel_size=2, data_parallel_start_rank=2), "data_parallel_start_rank"),
                         (dict(data_parallel_size=2, data_parallel_start_rank=1, data_parallel_size_local=2),
                          "data_parallel_size_local"),
                         (dict(data_parallel_rpc_port=70000), "data_parallel_rpc_port")):
        with pytest.raises(ValueError, match=name):
            ParallelConfig(**kwargs)


def test_frontend_combinations_that_cannot_work_are_rejected():
    with pytest.raises(ValueError, match="uds"):
        FrontendConfig(api_server_count=2, uds="/tmp/tm.sock")
    with pytest.raises(ValueError, match="headless runs no API server"):
        FrontendConfig(headless=True, api_server_count=2)
    with pytest.raises(ValueError, match="api_server_count"):
        FrontendConfig(api_server_count=0)


def test_head_needs_start_rank_zero_and_a_headless_node_needs_an_engine(tiny_model_factory):
    from tokenmill.config.engine_args import create_engine_config
    from tokenmill.engine.headless import HeadlessNode
    from tokenmill.engine.launcher import EngineManager
    model = tiny_model_factory("llama")
    cfg = create_engine_config(model=model, data_parallel_size=2, data_parallel_start_rank=1,
                               data_parallel_size_local=1)
    with pytest.raises(ValueError, match="data_parallel_start_rank=1 is for --headless nodes"):
        EngineManager(cfg, make_addresses(cfg.parallel_config, 1))
    cfg = create_engine_config(model=model, data_parallel_size=2, data_parallel_size_local=0)
    with pytest.raises(ValueError, match="would run no engine core"):
        HeadlessNode(cfg)
    node = HeadlessNode(create_engine_config(model=model, data_parallel_size=2, data_parallel_start_rank=1,
                                             data_parallel_address="10.1.2.3", data_parallel_rpc_port=1234))
    assert list(node.ranks) == [1] and node.handshake == "tcp://10.1.2.3:1234"


def test_addresses_are_ipc_on_one_node_and_tcp_across_nodes():
    local = make_addresses(ParallelConfig(data_parallel_size=2), num_clients=3)
    assert local.handshake.startswith("ipc://") and local.tmp_dir
    assert len(local.inputs) == 3 and all(len(per) == 2 for per in local.inputs) and len(local.outputs) == 3
    assert len({a for per in local.inputs for a in per} | set(local.outputs)) == 3 * 2 + 3
    import shutil
    shutil.rmtree(local.tmp_dir)
    multi = make_addresses(ParallelConfig(data_parallel_size=2, data_parallel_size_local=1,
                                          data_parallel_rpc_port=23456), num_clients=1)
    assert multi.handshake == "tcp://127.0.0.1:23456" and multi.tmp_dir is None
    assert all(a.startswith("tcp://127.0.0.1:") for a in multi.inputs[0] + multi.outputs)
    with pytest.raises(ValueError, match="data_parallel_address"):
        make_addresses(ParallelConfig(data_parallel_size=2, data_parallel_size_local=1,
                                      data_parallel_address="203.0.113.9"), num_clients=1)


def test_each_local_engine_gets_its_own_devices():
    assert devices_for_rank(0, 1, ["0", "1", "2", "3"]) == "0"
    assert devices_for_rank(1, 2, ["4", "5", "6", "7"]) == "6,7"
    cfg = SimpleNamespace(device_config=SimpleNamespace(device="cuda"),
                          parallel_config=SimpleNamespace(world_size=2))
    with envs.override(CUDA_VISIBLE_DEVICES="3,5,7"):
        assert check_devices(cfg, 1) == ["3", "5", "7"]
        with pytest.raises(ValueError, match=r"2 engine cores x 2 device\(s\) each need 4 CUDA devices on this "
                                             r"node, but 3 are visible \(3,5,7\)"):
            check_devices(cfg, 2)
    assert check_devices(SimpleNamespace(device_config=SimpleNamespace(device="cpu")), 2) is None


def test_handshake_welcomes_each_rank_once_and_ignores_garbage(tiny_model_factory):
    """The head's side of the start-up protocol, driven by hand (no engine processes: all ranks are 'remote')."""
    import msgspec
    import zmq

    from tests.entrypoints.openai.server_utils import free_port
    from tokenmill.config.engine_args import create_engine_config
    from tokenmill.engine.core_proc import HELLO, NODE_HELLO, READY, REJECT, WELCOME
    from tokenmill.engine.launcher import EngineManager
    cfg = create_engine_config(model=tiny_model_factory("llama"), data_parallel_size=2, data_parallel_size_local=0,
                               data_parallel_rpc_port=free_port())
    manager = EngineManager(cfg, make_addresses(cfg.parallel_config, 2))
    ctx = zmq.Context()
    socks = []

    def ask(kind: bytes, msg) -> tuple[bytes, dict]:
        sock = ctx.socket(zmq.DEALER)
        sock.connect(manager.addresses.handshake)
        socks.append(sock)
        sock.send_multipart([kind, msgspec.msgpack.encode(msg)])
        for _ in range(100):
            manager.poll(20)
            if sock.poll(10):
                reply_kind, payload = sock.recv_multipart()
                return reply_kind, msgspec.msgpack.decode(payload)
        raise AssertionError("no reply")

    try:
        assert ask(NODE_HELLO, {"ranks": [0, 1], "host": "n1"})[0] == WELCOME
        kind, msg = ask(NODE_HELLO, {"ranks": [1], "host": "n2"})
        assert kind == REJECT and "ranks [1] already run elsewhere" in msg["error"]
        assert "outside 0..1" in ask(NODE_HELLO, {"ranks": [5], "host": "n3"})[1]["error"]
        kind, msg = ask(HELLO, {"rank": 1, "pid": 1, "host": "n1"})
        assert kind == WELCOME and msg["inputs"] == [per[1] for per in manager.addresses.inputs]
        assert msg["outputs"] == manager.addresses.outputs and len(msg["outputs"]) == 2
        kind, msg = ask(HELLO, {"rank": 1, "pid": 2, "host": "n1"})
        assert kind == REJECT and "already has an engine core" in msg["error"]
        garbage = ctx.socket(zmq.DEALER)
        garbage.connect(manager.addresses.handshake)
        socks.append(garbage)
        garbage.send_multipart([b"??", b"\xc1"])
        garbage.send(b"one frame")
        assert ask(HELLO, {"rank": 0, "pid": 3, "host": "n1"})[0] == WELCOME  # still serving
        socks[-1].send_multipart([READY, msgspec.msgpack.encode({"rank": 0, "num_blocks": 7})])
        socks[3].send_multipart([READY, msgspec.msgpack.encode({"rank": 1, "num_blocks": 9})])
        for _ in range(100):
            manager.poll(20)
            if manager.all_ready():
                break
        assert manager.ready == {0: 7, 1: 9} and manager.failure() is None
    finally:
        for sock in socks:
            sock.close(linger=0)
        ctx.term()
        manager.shutdown()
