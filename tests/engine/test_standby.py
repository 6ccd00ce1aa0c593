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


def test_the_engine_config_unpickles_after_the_standby_imports_without_transformers(tmp_path):
    """The engine's config reaches the standby after the API server built it, on the critical path of `tokenmill
    serve`'s start: unpickling it must import nothing heavy, transformers least of all (its package init and a config
    module's imports took seconds on a GPU host). ModelConfig pickles its HF config as a snapshot of plain values."""
    import os
    import pickle
    import subprocess
    import sys

    import tokenmill
    from tokenmill.config.engine_args import create_engine_config
    model = os.path.join(os.path.dirname(tokenmill.__file__), "model_configs", "llama-3-8b")
    config = create_engine_config(model=model, load_format="dummy", max_model_len=2048, device="cpu")
    blob = tmp_path / "config.pkl"
    blob.write_bytes(pickle.dumps(config))
    code = ("import multiprocessing, pickle, sys\n"
            "from tokenmill.engine import standby\n"
            "recv, send = multiprocessing.Pipe(duplex=False)\n"
            "send.close()\n"
            "standby._standby_main(recv)  # imports, then returns: the pipe is closed\n"
            "print('imported transformers:', 'transformers' in sys.modules)\n"
            "before = set(sys.modules)\n"
            f"config = pickle.loads(open({str(blob)!r}, 'rb').read())\n"
            "text = config.model_config.get_text_config()\n"
            "print('after:', text.hidden_size, text.num_key_value_heads, text.rope_parameters['rope_theta'])\n"
            "print('new:', ' '.join(sorted(set(sys.modules) - before)))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    lines = dict(line.split(":", 1) for line in out.stdout.splitlines() if ":" in line)
    assert lines["imported transformers"].strip() == "False"
    assert lines["after"].split() == ["4096", "8", "500000.0"]
    new = lines["new"].split()
    assert not [m for m in new if m.split(".")[0] == "transformers"], new
    assert len(new) < 20, new
