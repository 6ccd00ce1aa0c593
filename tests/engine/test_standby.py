"""The engine-core process `tokenmill serve` starts ahead of its config (engine/standby.py)."""
from __future__ import annotations

from tokenmill.engine import standby


def test_take_without_a_standby_returns_none():
    assert standby.take({}, ()) is None


def test_an_untaken_standby_exits_when_discarded():
    standby.prestart()
    proc, _ = standby._standby
    standby.prestart()  # once per process
    assert standby._standby[0] is proc
    standby.discard()
    assert standby._standby is None
    proc.join(60)
    assert proc.exitcode == 0
    assert standby.take({}, ()) is None


def test_unpickling_a_model_config_after_the_standby_imports_only_its_config_module(tmp_path):
    """The standby's imports are what unpickling the engine's config needs: that happens after the config arrives,
    on the critical path of `tokenmill serve`'s start (transformers.activations and torch.distributed.tensor, which
    config modules pull in through type_validators, took 0.7 s there on 2 CPU cores)."""
    import pickle
    import subprocess
    import sys

    import transformers
    blob = tmp_path / "config.pkl"
    blob.write_bytes(pickle.dumps(transformers.LlamaConfig(num_hidden_layers=2)))
    code = ("import multiprocessing, pickle, sys\n"
            "from tokenmill.engine import standby\n"
            "recv, send = multiprocessing.Pipe(duplex=False)\n"
            "send.close()\n"
            "standby._standby_main(recv)  # imports, then returns: the pipe is closed\n"
            "before = set(sys.modules)\n"
            f"pickle.loads(open({str(blob)!r}, 'rb').read())\n"
            "print(' '.join(sorted(set(sys.modules) - before)))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    new = out.stdout.split()
    assert "transformers.models.llama.configuration_llama" in new
    assert [m for m in new if not m.startswith("transformers.models.")] == []
