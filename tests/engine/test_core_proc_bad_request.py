"""The engine core process survives a request it cannot decode (tokenmill/engine/core_proc.py): that request ends
with an ABORT output naming the error, and the next request is served."""
from __future__ import annotations

import msgspec

from tokenmill.core.messages import EngineCoreOutputs, EngineCoreRequest, FinishReason
from tokenmill.engine import core_proc
from tokenmill.sampling_params import SamplingParams


class _Sock:
    def __init__(self) -> None:
        self.sent: list[list[bytes]] = []

    def send_multipart(self, parts) -> None:
        self.sent.append(parts)


class _Core:
    def __init__(self) -> None:
        self.added: list[EngineCoreRequest] = []

    def add_request(self, req: EngineCoreRequest) -> None:
        self.added.append(req)


def _proc():
    proc = object.__new__(core_proc.EngineCoreProc)
    proc.core, proc.outputs, proc.engine_index, proc.client_of = _Core(), [_Sock()], 0, {}
    proc.req_decoder = msgspec.msgpack.Decoder(EngineCoreRequest)
    proc.encoder = msgspec.msgpack.Encoder()
    return proc


def test_undecodable_request_is_aborted_and_the_core_keeps_serving():
    proc = _proc()
    # temperature -1 fails SamplingParams' own check, which decoding re-runs
    bad = msgspec.msgpack.encode(["bad-1", [1, 2, 3], {"temperature": -1.0}, 0.0])
    proc._handle(core_proc.ADD, [bad], 0)
    (kind, payload), = proc.outputs[0].sent
    assert kind == core_proc.OUTPUTS
    out, = msgspec.msgpack.decode(payload, type=EngineCoreOutputs).outputs
    assert out.request_id == "bad-1" and out.finish_reason == FinishReason.ABORT
    assert "temperature" in out.stop_reason
    proc._handle(core_proc.ADD, [b"\xc1"], 0)              # not even msgpack: logged, nothing to answer
    assert len(proc.outputs[0].sent) == 1
    good = EngineCoreRequest("ok-1", [1, 2], SamplingParams(max_tokens=2), 0.0)
    proc._handle(core_proc.ADD, [msgspec.msgpack.encode(good)], 0)
    assert [r.request_id for r in proc.core.added] == ["ok-1"]
    # The sequences of one user request (n > 1) come in one message and are all added before the next step; a bad
    # one among them ends only itself.
    kids = [EngineCoreRequest(f"n-{i}", [1, 2], SamplingParams(max_tokens=2), 0.0) for i in range(3)]
    proc._handle(core_proc.ADD, [msgspec.msgpack.encode(kids[0]), bad, msgspec.msgpack.encode(kids[2])], 0)
    assert [r.request_id for r in proc.core.added] == ["ok-1", "n-0", "n-2"] and len(proc.outputs[0].sent) == 2
