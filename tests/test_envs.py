"""tokenmill/envs.py: each variable is parsed once and cached; malformed values are refused by name; tests change
values through envs.override (typed, scoped) and envs.reset."""
from __future__ import annotations

import pytest

from tokenmill import envs


@pytest.fixture
def fresh(monkeypatch):
    """The variables these tests touch start uncached, and are uncached again afterwards."""
    names = ("TOKENMILL_GC_DEBUG_MS", "TOKENMILL_STEP_TIMING", "TOKENMILL_GEMV", "TOKENMILL_API_KEY",
             "TRITON_INTERPRET")
    envs.reset(*names)
    yield monkeypatch
    monkeypatch.undo()
    envs.reset(*names)


def test_read_once_then_cached(fresh):
    fresh.setenv("TOKENMILL_GC_DEBUG_MS", "7")
    assert envs.TOKENMILL_GC_DEBUG_MS == 7
    fresh.setenv("TOKENMILL_GC_DEBUG_MS", "9")
    assert envs.TOKENMILL_GC_DEBUG_MS == 7                  # the process keeps its first reading
    envs.reset("TOKENMILL_GC_DEBUG_MS")
    assert envs.TOKENMILL_GC_DEBUG_MS == 9
    fresh.delenv("TOKENMILL_GC_DEBUG_MS")
    envs.reset()
    assert envs.TOKENMILL_GC_DEBUG_MS == 5                  # the default


@pytest.mark.parametrize("raw,want", [("1", True), ("true", True), (" Yes ", True), ("ON", True), ("0", False),
                                      ("false", False), ("no", False), ("off", False), ("", False)])
def test_booleans(fresh, raw, want):
    fresh.setenv("TOKENMILL_STEP_TIMING", raw)
    assert envs.TOKENMILL_STEP_TIMING is want


@pytest.mark.parametrize("name,raw,match", [
    ("TOKENMILL_STEP_TIMING", "2", r"TOKENMILL_STEP_TIMING='2': expected a boolean"),
    ("TOKENMILL_GC_DEBUG_MS", "5ms", r"TOKENMILL_GC_DEBUG_MS='5ms': expected an integer"),
    ("TOKENMILL_GEMV", "fast", r"TOKENMILL_GEMV='fast': choose one of auto, always, never"),
])
def test_malformed_values_name_the_variable(fresh, name, raw, match):
    fresh.setenv(name, raw)
    with pytest.raises(ValueError, match=match):
        getattr(envs, name)


def test_triton_interpret_is_read_as_triton_reads_it(fresh):
    fresh.setenv("TRITON_INTERPRET", "y")
    assert envs.TRITON_INTERPRET is False                   # Triton: only 1 / true / on are true, nothing raises
    envs.reset("TRITON_INTERPRET")
    fresh.setenv("TRITON_INTERPRET", "On")
    assert envs.TRITON_INTERPRET is True


def test_override_is_typed_and_scoped(fresh):
    fresh.setenv("TOKENMILL_GC_DEBUG_MS", "3")
    assert envs.TOKENMILL_GC_DEBUG_MS == 3
    with envs.override(TOKENMILL_GC_DEBUG_MS=0, TOKENMILL_API_KEY="k"):
        assert (envs.TOKENMILL_GC_DEBUG_MS, envs.TOKENMILL_API_KEY) == (0, "k")
        with envs.override(TOKENMILL_API_KEY=None):
            assert envs.TOKENMILL_API_KEY is None
        assert envs.TOKENMILL_API_KEY == "k"
    assert envs.TOKENMILL_GC_DEBUG_MS == 3                  # cached before: the cached value again
    fresh.setenv("TOKENMILL_API_KEY", "from-env")
    assert envs.TOKENMILL_API_KEY == "from-env"             # not cached before: read afresh afterwards
    with pytest.raises(TypeError, match="TOKENMILL_GC_DEBUG_MS takes an int, got '0'"):
        with envs.override(TOKENMILL_GC_DEBUG_MS="0"):
            pass
    with pytest.raises(TypeError, match="TOKENMILL_STEP_TIMING takes a bool"):
        with envs.override(TOKENMILL_STEP_TIMING=1):
            pass
    with pytest.raises(TypeError, match="TOKENMILL_GEMV takes a str, got None"):
        with envs.override(TOKENMILL_GEMV=None):
            pass
    assert envs.TOKENMILL_GC_DEBUG_MS == 3


def test_unknown_names_are_refused():
    with pytest.raises(AttributeError, match="TOKENMILL_NOPE"):
        envs.TOKENMILL_NOPE
    with pytest.raises(AttributeError, match=r"no variable\(s\) \['TOKENMILL_PDL'\]"):
        with envs.override(TOKENMILL_PDL=False):
            pass
    with pytest.raises(AttributeError, match="TOKENMILL_NOPE"):
        envs.reset("TOKENMILL_NOPE")
    assert "TOKENMILL_GEMV" in dir(envs) and "override" in dir(envs)
