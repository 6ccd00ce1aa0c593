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
