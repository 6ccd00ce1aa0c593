"""Launch configurations of the skinny GEMM (tokenmill/kernels/triton_gemv.py), and which products take it.

Which decode products run on the gemv instead of cuBLAS is a measurement of one GPU model, so it is data: one JSON
file per device name in tokenmill/kernels/configs/ (`device_file_name`), written by `tokenmill bench kernels` and
loaded once per device (`table_for`). Each entry names a product (rows, N, K, prologue, weight) and the launch
config that beat cuBLAS there. `rows` is a bucket: a product of m rows uses the entry of the next power of two >= m
(at most 16). The prologue is None (a plain product), "rmsnorm" (the RMSNorm, with the residual add when there is
one, folded in before the product) or "silu_mul" (down_proj's SiLU-and-mul folded in). The weight is None (the
activations' bf16 / fp16) or "fp8" (float8 e4m3 with one scale per row, a plain product: the FP8 linear method's
decode path, which has no cuBLAS alternative, so its entries are the measured config against the gemv's untuned
one).

A device without a file gets an empty table (one info line says so): every product stays on cuBLAS, which is correct
everywhere; the gemv then runs only where it is called explicitly or forced by TOKENMILL_GEMV=always, with
`default_config`'s heuristic, which fits any shape.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import os
import re
import types
from typing import Any, Mapping

import torch
import triton

from tokenmill import envs
from tokenmill.logger import init_logger

logger = init_logger(__name__)

CONFIG_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs")
PROLOGUES = (None, "rmsnorm", "silu_mul")
WEIGHTS = (None, "fp8")
MAX_ROWS = 16                  # the gemv's largest row bucket (triton_gemv.MAX_M)
FORMAT_VERSION = 1


@dataclasses.dataclass(frozen=True)
class GemvConfig:
    """One launch configuration, valid for every shape (checked here). split_k is the requested number of K splits;
    the launch uses ceil(K / k_per_split) with k_per_split rounded up to a multiple of block_k, so it may use
    fewer."""

    block_n: int = 64
    block_k: int = 128
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3
    use_dot: bool = True
    prefetch: bool = False      # two W tiles in flight per program, both first ones before the PDL wait
    acc2d: bool = False         # FMA path: reduce over K every step (fewer registers, more programs per SM)
    xprefetch: bool = False     # x (and the prologue's residual / norm weight) loaded one K step ahead

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if type(v) is not (bool if f.type in ("bool", bool) else int):
                raise TypeError(f"GemvConfig.{f.name} must be a{' bool' if f.type in ('bool', bool) else 'n int'}, "
                                f"got {v!r}")
        for name in ("block_n", "block_k"):
            v = getattr(self, name)
            if v < 1 or v & (v - 1):
                raise ValueError(f"GemvConfig.{name} must be a power of two, got {v}")
            if self.use_dot and v < 16:
                raise ValueError(f"GemvConfig.{name} must be >= 16 with use_dot=True (tl.dot), got {v}")
        if self.split_k < 1:
            raise ValueError(f"GemvConfig.split_k must be >= 1, got {self.split_k}")
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"GemvConfig.num_warps must be 1, 2, 4, 8 or 16, got {self.num_warps}")
        if self.num_stages < 1:
            raise ValueError(f"GemvConfig.num_stages must be >= 1, got {self.num_stages}")
        if self.acc2d and self.use_dot:
            raise ValueError("GemvConfig.acc2d applies to the FMA path: it needs use_dot=False")


Key = tuple[int, int, int, "str | None", "str | None"]       # (rows bucket, N, K, prologue, weight)


@dataclasses.dataclass(frozen=True)
class GemvEntry:
    """A product's measured config, with the timings that chose it (microseconds per call; informational)."""

    config: GemvConfig
    cublas_us: float | None = None
    gemv_us: float | None = None
    note: str | None = None


class GemvTable:
    """The products that take the gemv on one device, each with its launch config: `prefer` answers where a product
    goes (a config, or None for cuBLAS), `tuned` gives a shape's measured config for the heuristic to use. Entries
    are fixed at construction (read-only); a table compares and hashes by identity (it keys default_config's cache)."""

    def __init__(self, entries: dict[Key, GemvEntry] | None = None, device: str | None = None,
                 measured: str | None = None):
        self.entries: Mapping[Key, GemvEntry] = types.MappingProxyType(dict(entries or {}))
        self.device, self.measured = device, measured
        for key in self.entries:
            check_key(key)
        tuned: dict[tuple[int, int, int], GemvConfig] = {}
        # A plain product's own config first; where only fused forms were measured, the first fused one's. An fp8
        # weight's config streams half the bytes per K step: it says nothing of a bf16 product's.
        for (m, n, k, pro, wt), e in sorted(self.entries.items(), key=lambda kv: PROLOGUES.index(kv[0][3])):
            if wt is None:
                tuned.setdefault((m, n, k), e.config)
        self._tuned = tuned

    def prefer(self, m: int, n: int, k: int, prologue: str | None = None,
               weight: str | None = None) -> GemvConfig | None:
        """The measured-faster config of this product, or None: cuBLAS (with the prologue as its own kernel), or
        for an fp8 weight the gemv's untuned config."""
        hit = self.entries.get((m_bucket(m), n, k, prologue, weight))
        return None if hit is None else hit.config

    def tuned(self, m: int, n: int, k: int) -> GemvConfig | None:
        return self._tuned.get((m_bucket(m), n, k))

    def __len__(self) -> int:
        return len(self.entries)

    def __repr__(self) -> str:
        return f"GemvTable({self.device or 'no device'}, {len(self)} entries)"


def m_bucket(m: int) -> int:
    return 1 << max(0, m - 1).bit_length()


def check_key(key) -> None:
    if not isinstance(key, tuple) or len(key) != 5:
        raise ValueError(f"gemv table: a key is (rows, n, k, prologue, weight), got {key!r}")
    m, n, k, pro, wt = key
    if type(m) is not int or m < 1 or m > MAX_ROWS or m & (m - 1):
        raise ValueError(f"gemv table: rows must be a power of two in 1..{MAX_ROWS}, got {m!r}")
    for name, v in (("n", n), ("k", k)):
        if type(v) is not int or v < 1:
            raise ValueError(f"gemv table: {name} must be a positive int, got {v!r}")
    if pro not in PROLOGUES:
        raise ValueError(f"gemv table: prologue must be one of {PROLOGUES}, got {pro!r}")
    if wt not in WEIGHTS:
        raise ValueError(f"gemv table: weight must be one of {WEIGHTS}, got {wt!r}")
    if wt is not None and pro is not None:
        raise ValueError(f"gemv table: an {wt} weight's entry is a plain product (prologue null), got {pro!r}")


# ------------------------------------------------------------------------------------------------ JSON files
def device_file_name(device_name: str) -> str:
    """'NVIDIA H200' -> 'NVIDIA_H200.json': the device name with every run of other characters than letters,
    digits, '.' and '-' as one '_'."""
    return re.sub(r"[^A-Za-z0-9.\-]+", "_", device_name.strip()).strip("_") + ".json"


_ENTRY_FIELDS = {"rows", "n", "k", "prologue", "weight", "config", "cublas_us", "gemv_us", "note"}
_TOP_FIELDS = {"version", "device", "measured", "gemv"}


def table_to_json(table: GemvTable) -> dict[str, Any]:
    entries = []
    for (m, n, k, pro, wt), e in sorted(table.entries.items(), key=lambda kv: (
            WEIGHTS.index(kv[0][4]), kv[0][2], kv[0][1], PROLOGUES.index(kv[0][3]), kv[0][0])):
        row = {"rows": m, "n": n, "k": k, "prologue": pro, "config": dataclasses.asdict(e.config)}
        if wt is not None:
            row["weight"] = wt
        for name in ("cublas_us", "gemv_us", "note"):
            if getattr(e, name) is not None:
                row[name] = getattr(e, name)
        entries.append(row)
    return {"version": FORMAT_VERSION, "device": table.device, "measured": table.measured, "gemv": entries}


def table_from_json(data: Any, source: str = "gemv table") -> GemvTable:
    """The table a JSON document describes; ValueError naming `source` and the entry for anything malformed."""
    if not isinstance(data, dict) or data.get("version") != FORMAT_VERSION:
        raise ValueError(f"{source}: expected an object with \"version\": {FORMAT_VERSION}")
    unknown = set(data) - _TOP_FIELDS
    if unknown or not isinstance(data.get("gemv"), list):
        raise ValueError(f"{source}: needs a \"gemv\" list"
                         + (f"; unknown fields {sorted(unknown)}" if unknown else ""))
    entries: dict[Key, GemvEntry] = {}
    for i, row in enumerate(data["gemv"]):
        where = f"{source}: gemv entry {i}"
        if not isinstance(row, dict):
            raise ValueError(f"{where}: expected an object, got {row!r}")
        missing, unknown = {"rows", "n", "k", "prologue", "config"} - set(row), set(row) - _ENTRY_FIELDS
        if missing or unknown:
            raise ValueError(f"{where}: " + "; ".join(
                s for s in (f"missing {sorted(missing)}" if missing else "",
                            f"unknown fields {sorted(unknown)}" if unknown else "") if s))
        key = (row["rows"], row["n"], row["k"], row["prologue"], row.get("weight"))
        try:
            check_key(key)
            if not isinstance(row["config"], dict):
                raise ValueError(f"config must be an object, got {row['config']!r}")
            cfg = GemvConfig(**row["config"])
        except (TypeError, ValueError) as e:
            raise ValueError(f"{where}: {e}") from None
        if key in entries:
            raise ValueError(f"{where}: a second entry for {key}")
        times = {name: row.get(name) for name in ("cublas_us", "gemv_us")}
        for name, v in times.items():
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))):
                raise ValueError(f"{where}: {name} must be a number, got {v!r}")
        entries[key] = GemvEntry(cfg, note=row.get("note"), **times)
    return GemvTable(entries, device=data.get("device"), measured=data.get("measured"))


def write_table(path: str, table: GemvTable) -> None:
    """The table as JSON, one entry per line (files diff entry by entry)."""
    doc = table_to_json(table)
    lines = [json.dumps(row) for row in doc.pop("gemv")]
    head = json.dumps(doc, indent=1)[:-2]
    body = ",\n  ".join(lines)
    text = f"{head},\n \"gemv\": [\n  {body}\n ]\n}}\n" if lines else f"{head},\n \"gemv\": []\n}}\n"
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)


def read_table(path: str) -> GemvTable:
    with open(path) as f:
        try:
            data = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not valid JSON ({e})") from None
    return table_from_json(data, path)


@functools.lru_cache(maxsize=None)
def load_table(device_name: str) -> GemvTable:
    """The shipped table of a device (by its torch.cuda.get_device_name()), read once; an empty one, with one
    info line, where none was measured."""
    path = os.path.join(CONFIG_DIR, device_file_name(device_name))
    if not os.path.isfile(path):
        logger.info("No measured gemv table for %s (%s): every decode product stays on cuBLAS. "
                    "`tokenmill bench kernels` measures one.", device_name, os.path.basename(path))
        return GemvTable(device=device_name)
    return read_table(path)


EMPTY_TABLE = GemvTable()


@functools.lru_cache(maxsize=None)
def _table_of_index(index: int) -> GemvTable:
    return load_table(torch.cuda.get_device_name(index))


def table_for(device: torch.device) -> GemvTable:
    """The measured table of `device`'s GPU model; the empty table off CUDA (the CPU interpreter)."""
    if device.type != "cuda":
        return EMPTY_TABLE
    return _table_of_index(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _num_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def sm_count(device: torch.device) -> int:
    """Multiprocessors of `device`; an H200's 132 elsewhere (CPU interpreter), so configs resolve the same."""
    if device.type != "cuda":
        return 132
    return _num_sms(device.index if device.index is not None else torch.cuda.current_device())


# ----------------------------------------------------------------------------------------------------- choice
def choose(m: int, n: int, k: int, prologue: str | None, device: torch.device) -> GemvConfig | None:
    """Where an eligible product of m rows (the caller checked triton_gemv.use_gemv) runs: a gemv config, or None
    for cuBLAS. TOKENMILL_GEMV=auto follows the device's table, never takes cuBLAS, always takes the gemv (the
    table's config for the shape where there is one, else the heuristic)."""
    mode = envs.TOKENMILL_GEMV
    if mode == "never" or m > MAX_ROWS:
        return None
    table = table_for(device)
    if mode == "always":
        return default_config(m, n, k, sm_count(device), table)
    return table.prefer(m, n, k, prologue)


@functools.lru_cache(maxsize=None)
def default_config(m: int, n: int, k: int, num_sms: int = 132, table: GemvTable | None = None) -> GemvConfig:
    """The table's config for this shape where it has one; else the heuristic: 64-wide N tiles and 128-deep K steps
    (tensor cores), K split until there are about two programs per SM, keeping at least one K step per split."""
    tuned = None if table is None else table.tuned(m, n, k)
    if tuned is not None:
        return tuned
    block_n, block_k = 64, min(128, max(16, triton.next_power_of_2(k)))
    n_tiles = triton.cdiv(n, block_n)
    target = 2 * num_sms
    split = 1
    if n_tiles < target:
        split = max(1, min(triton.cdiv(target, n_tiles), triton.cdiv(k, block_k), 32))
    return GemvConfig(block_n=block_n, block_k=block_k, split_k=split, num_warps=4, num_stages=3, use_dot=True)
