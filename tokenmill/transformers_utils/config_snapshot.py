"""A transformers config's values as a plain object, so that most processes never import transformers for it.

The engine-core and worker processes read the HF config (sizes, RoPE settings, layer types) but never call into
transformers with it. Unpickling the config as its transformers class would import transformers there: the package
walks its model folders and a config module pulls in the auto-model tables and torch.distributed.tensor, seconds of
`tokenmill serve`'s start-up on a slow filesystem, on the path to the first request. `ModelConfig` pickles a
`ConfigSnapshot` of its config instead (config/model.py), and `get_hf_config` returns one, cached on disk
(`cached_snapshot`), so that the API server too builds the engine config without transformers on a later start.
transformers loads only where a feature calls into it (a RoPE type tokenmill takes from transformers, a tokenizer).

A snapshot holds every public value the config answers for (attributes, properties, `attribute_map` aliases, the
instance's private values), its sub-configs as snapshots, `get_text_config()` and `to_dict()`. The config's methods
and class-valued attributes are not copied: reading one unpickles the transformers config and answers from it.
"""
from __future__ import annotations

import copy
import logging
import pickle
import warnings
from typing import Any, Callable

import torch

# The snapshot's own bookkeeping, never taken from a config.
_INTERNAL = frozenset({"_class_name", "_pickled", "_hf", "_delegated", "_text_config", "_as_dict"})
_PLAIN = (type(None), bool, int, float, complex, str, bytes, torch.dtype)


class ConfigSnapshot:
    """Plain attributes copied from a transformers config; `get_text_config()` returns the text part's snapshot
    (this one for a config without parts), `to_dict()` a copy of the config's own `to_dict()`. Contract: for every
    name a snapshot holds, its value equals (sub-configs: snapshots of) what the config returned for that name."""

    def __init__(self, class_name: str, values: dict[str, Any], as_dict: dict[str, Any],
                 text_config: ConfigSnapshot | None, pickled: bytes, delegated: frozenset[str]) -> None:
        self.__dict__.update(values)
        self.__dict__["_delegated"] = delegated
        self.__dict__["_class_name"] = class_name
        self.__dict__["_pickled"] = pickled
        self.__dict__["_hf"] = None
        self.__dict__["_as_dict"] = as_dict
        self.__dict__["_text_config"] = text_config

    def get_text_config(self, decoder: bool | None = None, encoder: bool | None = None) -> ConfigSnapshot:
        return self if self._text_config is None else self._text_config

    def to_dict(self) -> dict[str, Any]:
        return copy.deepcopy(self._as_dict)

    def hf_object(self) -> Any:
        """The transformers config itself, unpickled on first use (this imports transformers): for code that
        calls into transformers with it, such as transformers' RoPE initialisers."""
        if self._hf is None:
            self.__dict__["_hf"] = pickle.loads(self._pickled)
        return self._hf

    def __getattr__(self, name: str) -> Any:
        # Only for names not held: the config's methods (to_json_string, save_pretrained...) and class-valued
        # attributes come from the transformers config itself; any other name is missing, as on the config.
        if name in self.__dict__.get("_delegated", ()):
            return getattr(self.hf_object(), name)
        raise AttributeError(f"{self.__dict__.get('_class_name', 'ConfigSnapshot')!s} has no attribute {name!r}")

    def __getstate__(self) -> dict[str, Any]:
        return dict(self.__dict__, _hf=None)  # what crosses a process boundary stays free of transformers

    @property
    def class_name(self) -> str:
        """The transformers class the snapshot was taken from (for messages)."""
        return self._class_name

    def __repr__(self) -> str:
        return f"ConfigSnapshot({self.__dict__.get('_class_name')}, model_type={self.__dict__.get('model_type')!r})"


def hf_config_object(config: Any) -> Any:
    """The transformers config behind `config` (a snapshot's `hf_object()`, else `config` itself)."""
    return config.hf_object() if isinstance(config, ConfigSnapshot) else config


def _is_config(value: Any) -> bool:
    return (not isinstance(value, (type, ConfigSnapshot)) and hasattr(value, "to_dict")
            and hasattr(value, "get_text_config"))


def _plain(value: Any, memo: dict[int, ConfigSnapshot]) -> tuple[bool, Any]:
    """(True, the value as plain data or a snapshot) or (False, None) for what a snapshot leaves out."""
    if isinstance(value, _PLAIN):
        return True, value
    if isinstance(value, ConfigSnapshot):
        return True, value
    if _is_config(value):
        return True, snapshot(value, memo)
    if isinstance(value, (list, tuple, set, frozenset)):
        items = [_plain(v, memo) for v in value]
        if not all(ok for ok, _ in items):
            return False, None
        return True, type(value)(v for _, v in items)
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            ok_k, k2 = _plain(k, memo)
            ok_v, v2 = _plain(v, memo)
            if not (ok_k and ok_v):
                return False, None
            out[k2] = v2
        return True, out
    to_dict = getattr(value, "to_dict", None)  # a quantization config object: its dict, as the engine reads it
    if callable(to_dict) and not isinstance(value, type):
        try:
            return _plain(to_dict(), memo)
        except Exception:  # noqa: BLE001 - not a dict-able value: leave it out
            return False, None
    return False, None


def snapshot(config: Any, memo: dict[int, ConfigSnapshot] | None = None) -> ConfigSnapshot:
    """The snapshot of a transformers config (a snapshot is returned as it is). Sub-configs reached twice (a text
    config both as `text_config` and as `get_text_config()`) become one snapshot."""
    if isinstance(config, ConfigSnapshot):
        return config
    memo = {} if memo is None else memo
    if id(config) in memo:
        return memo[id(config)]
    names = {n for n in dir(config) if not n.startswith("_")}
    names.update(getattr(config, "attribute_map", None) or {})
    # The instance's own private values too (_name_or_path, _commit_hash), except where the snapshot keeps its own.
    names.update(n for n in vars(config) if n.startswith("_") and not n.startswith("__") and n not in _INTERNAL)
    snap = ConfigSnapshot.__new__(ConfigSnapshot)
    memo[id(config)] = snap
    hf_logger = logging.getLogger("transformers")
    level = hf_logger.level
    hf_logger.setLevel(logging.ERROR)  # deprecated aliases (torch_dtype, use_return_dict) log when read
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            values, text, as_dict = _read(config, names, memo)
    finally:
        hf_logger.setLevel(level)
    text_snap = None if text is config else snapshot(text, memo)
    delegated = frozenset(n for n in names if n not in values and hasattr(type(config), n))
    snap.__init__(type(config).__name__, values, as_dict, text_snap, pickle.dumps(config), delegated)
    return snap


def _read(config: Any, names: set[str], memo: dict[int, ConfigSnapshot]) -> tuple[dict[str, Any], Any, dict]:
    """The plain values of `names`, the config's text part and its dict form."""
    values: dict[str, Any] = {}
    for name in sorted(names):
        try:
            value = getattr(config, name)
        except Exception:  # noqa: BLE001 - a property that does not apply to this config
            continue
        if callable(value) and not _is_config(value):
            continue  # methods, and classes (sub_configs' values are dicts of classes: left out below)
        ok, plain = _plain(value, memo)
        if ok:
            values[name] = plain
    text = config.get_text_config() if callable(getattr(config, "get_text_config", None)) else config
    ok, as_dict = _plain(config.to_dict(), memo)
    return values, text, as_dict if ok else {}


# ------------------------------------------------------------------------------------------------------- disk cache
# Entries kept; the oldest go first (each is a few KB: a bound for machines that load many temporary models).
_CACHE_ENTRIES = 256
# Part of every key, with the source of the modules that build a snapshot: no process reads an older layout.
_FORMAT = 1


def cached_snapshot(key: list[Any] | None, build: Callable[[], ConfigSnapshot]) -> ConfigSnapshot:
    """The snapshot stored under `key` (the identity of everything the config was built from), else `build()`'s,
    stored for the next start. A start with a hit never imports transformers for the config (seconds of the API
    server's start on a slow filesystem). key None: build without caching. An unreadable entry is rebuilt, an
    unwritable cache only logs; neither is an error."""
    from tokenmill import envs
    root = envs.TOKENMILL_CACHE_DIR
    if key is None or not root:
        return build()
    import hashlib
    import importlib.metadata
    import os
    import tempfile
    versions: list[Any] = [_FORMAT]
    for dist in ("transformers", "tokenmill"):  # tokenmill run from a source tree has no distribution
        try:
            versions.append(importlib.metadata.version(dist))
        except importlib.metadata.PackageNotFoundError:
            versions.append(None)
    # The code that builds a config (GGUF fixes, overrides) and a snapshot: an edit to it is a new key, whatever the
    # version string says.
    here = os.path.dirname(os.path.abspath(__file__))
    code = hashlib.sha256()
    for name in ("config.py", "config_snapshot.py"):
        with open(os.path.join(here, name), "rb") as f:
            code.update(f.read())
    versions.append(code.hexdigest())
    digest = hashlib.sha256(repr(key + versions).encode()).hexdigest()[:32]
    folder = os.path.join(os.path.expanduser(root), "hf_configs")
    path = os.path.join(folder, f"{digest}.pkl")
    if os.path.isfile(path):
        try:
            with open(path, "rb") as f:
                snap = pickle.load(f)
            if isinstance(snap, ConfigSnapshot):
                return snap
        except Exception as e:  # noqa: BLE001 - a truncated or foreign file: rebuild it
            logging.getLogger(__name__).warning("Ignoring unreadable config cache entry %s (%s).", path, e)
    snap = build()
    try:
        os.makedirs(folder, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp-", suffix=".pkl")
        with os.fdopen(fd, "wb") as f:
            pickle.dump(snap, f, protocol=pickle.HIGHEST_PROTOCOL)
        os.replace(tmp, path)  # atomic: a concurrent reader sees the old entry or the whole new one
        entries = sorted((e for e in os.scandir(folder) if e.name.endswith(".pkl") and not e.name.startswith(".")),
                         key=lambda e: e.stat().st_mtime)
        for old in entries[:-_CACHE_ENTRIES]:
            os.unlink(old.path)
    except Exception as e:  # noqa: BLE001 - the cache is an optimisation: never fail a start over it
        logging.getLogger(__name__).info("Config cache %s not written (%s); set TOKENMILL_CACHE_DIR to cache it.",
                                         folder, e)
    return snap


def file_identity(path: str) -> list[Any]:
    """What a cache key holds for a file: its absolute path, size and modification time."""
    import os
    full = os.path.abspath(path)
    st = os.stat(full)
    return [full, st.st_size, st.st_mtime_ns]
