"""The gemv tables as data (tokenmill/kernels/gemv_config.py, tokenmill/kernels/configs/*.json): the shipped H200
file decides exactly what the Python table it replaced decided, files round-trip and malformed ones are refused by
entry, an unknown device falls back to cuBLAS everywhere, and TOKENMILL_GEMV picks between the three policies."""
from __future__ import annotations

import json
import logging

import pytest
import torch

pytest.importorskip("triton")

from tokenmill import envs  # noqa: E402
from tokenmill.kernels import gemv_config  # noqa: E402
from tokenmill.kernels.gemv_config import GemvConfig, GemvEntry, GemvTable, default_config  # noqa: E402
from tokenmill.kernels.triton_gemv import _MAX_SPLIT_TILES, launch_plan  # noqa: E402

# The table as the Python code held it before it became tokenmill/kernels/configs/NVIDIA_H200.json:
# (rows bucket, N, K, prologue) -> (block_n, block_k, split_k, num_warps, num_stages, use_dot, prefetch, acc2d,
# xprefetch). Frozen here so that the file can only change on purpose.
PYTHON_TABLE = {
    (2, 1024, 2048, None): (32, 128, 8, 4, 3, True, False, False, False),
    (4, 1024, 2048, None): (32, 128, 8, 4, 3, True, False, False, False),
    (8, 1024, 2048, None): (32, 256, 4, 4, 3, True, False, False, False),
    (2, 1024, 3072, 'silu_mul'): (16, 256, 8, 4, 1, False, False, False, False),
    (2, 151936, 1024, None): (128, 128, 1, 4, 3, True, False, False, False),
    (4, 151936, 1024, None): (128, 128, 1, 4, 3, True, False, False, False),
    (8, 151936, 1024, None): (64, 256, 1, 4, 3, True, False, False, False),
    (1, 6144, 4096, None): (64, 128, 1, 4, 5, True, False, False, False),
    (2, 6144, 4096, None): (64, 128, 1, 4, 5, True, False, False, False),
    (2, 4096, 4096, None): (64, 128, 4, 4, 3, True, False, False, False),
    (4, 4096, 4096, None): (64, 128, 2, 4, 5, True, False, False, False),
    (8, 4096, 4096, None): (64, 128, 2, 4, 5, True, False, False, False),
    (1, 28672, 4096, None): (128, 128, 1, 8, 3, True, False, False, True),
    (1, 3072, 4096, 'rmsnorm'): (32, 128, 6, 4, 1, False, False, False, False),
    (1, 3072, 4096, None): (64, 128, 6, 4, 3, True, False, False, False),
    (1, 4096, 7168, None): (64, 128, 2, 4, 5, True, False, False, False),
    (1, 64128, 4096, None): (64, 128, 1, 4, 5, True, False, False, False),
    (1, 4096, 1024, 'rmsnorm'): (8, 1024, 1, 4, 1, False, False, True, False),
    (1, 1024, 2048, None): (4, 2048, 1, 8, 1, False, True, False, False),
    (1, 6144, 1024, 'rmsnorm'): (8, 512, 1, 4, 1, False, False, True, False),
    (1, 1024, 3072, 'silu_mul'): (4, 2048, 1, 8, 1, False, True, False, False),
    (1, 151936, 1024, None): (16, 256, 1, 4, 1, False, True, True, False),
    (1, 6144, 4096, 'rmsnorm'): (16, 512, 1, 8, 1, False, True, True, True),
    (1, 4096, 4096, None): (8, 512, 1, 4, 1, False, True, True, True),
    (1, 4096, 14336, None): (64, 256, 4, 4, 3, True, False, False, False),
    (1, 128256, 4096, None): (64, 128, 1, 4, 3, True, False, False, False),
}
OLD = {key: GemvConfig(*t) for key, t in PYTHON_TABLE.items()}


def _old_prefer(m, n, k, pro):
    return OLD.get((1 << max(0, m - 1).bit_length(), n, k, pro))


def _old_tuned(m, n, k):
    """The Python table's heuristic overrides: a plain product's config, else the fused entry's."""
    mb = 1 << max(0, m - 1).bit_length()
    for pro in (None, "rmsnorm", "silu_mul"):
        if (mb, n, k, pro) in OLD:
            return OLD[(mb, n, k, pro)]
    return None


def test_h200_file_decides_what_the_python_table_did():
    table = gemv_config.load_table("NVIDIA H200")
    assert {key[:4]: e.config for key, e in table.entries.items() if key[4] is None} == OLD
    shapes = {(n, k) for _, n, k, _ in OLD} | {(4096, 1024), (2048, 1024), (6144, 1024), (1024, 3072)}
    for n, k in sorted(shapes):
        for m in range(1, 17):
            want_default = _old_tuned(m, n, k) or default_config(m, n, k, 132)
            assert default_config(m, n, k, 132, table) == want_default, (m, n, k)
            for pro in gemv_config.PROLOGUES:
                assert table.prefer(m, n, k, pro) == _old_prefer(m, n, k, pro), (m, n, k, pro)
    assert table.prefer(17, 4096, 4096) is None                       # past the row buckets: cuBLAS


def test_tables_round_trip_through_json(tmp_path):
    table = GemvTable({(1, 96, 64, None, None): GemvEntry(GemvConfig(16, 32, 2), 3.5, 2.25, "a note"),
                       (4, 96, 64, "rmsnorm", None): GemvEntry(GemvConfig(8, 64, 1, 4, 1, use_dot=False,
                                                                         acc2d=True)),
                       (16, 80, 48, "silu_mul", None): GemvEntry(GemvConfig(xprefetch=True, prefetch=True), 1, 2),
                       (1, 96, 64, None, "fp8"): GemvEntry(GemvConfig(32, 256, 4, use_dot=False, acc2d=True))},
                      device="Some GPU", measured="by hand")
    path = tmp_path / "Some_GPU.json"
    gemv_config.write_table(str(path), table)
    back = gemv_config.read_table(str(path))
    assert back.entries == table.entries and (back.device, back.measured) == ("Some GPU", "by hand")
    with pytest.raises(TypeError):
        back.entries[(1, 8, 8, None, None)] = GemvEntry(GemvConfig())    # read-only: `tuned` is derived from it
    assert len(path.read_text().splitlines()) == 5 + 4 + 2        # one line per entry
    assert path.read_text().count('"weight"') == 1                # written only for an fp8 entry
    gemv_config.write_table(str(path), GemvTable(device="x"))
    assert len(gemv_config.read_table(str(path))) == 0


def test_shipped_files_are_named_after_their_device():
    import glob
    import os
    paths = glob.glob(os.path.join(gemv_config.CONFIG_DIR, "*.json"))
    assert paths
    for path in paths:
        table = gemv_config.read_table(path)
        assert os.path.basename(path) == gemv_config.device_file_name(table.device)
    assert gemv_config.device_file_name("NVIDIA H200") == "NVIDIA_H200.json"
    assert gemv_config.device_file_name(" NVIDIA A100-SXM4-80GB ") == "NVIDIA_A100-SXM4-80GB.json"
    assert gemv_config.device_file_name("AMD Instinct MI300X (gfx942)") == "AMD_Instinct_MI300X_gfx942.json"


def _doc(**entry):
    row = {"rows": 1, "n": 64, "k": 32, "prologue": None, "config": {"block_n": 16, "block_k": 32}}
    row.update(entry)
    return {"version": 1, "device": "d", "gemv": [row]}


@pytest.mark.parametrize("doc,match", [
    ({"version": 2, "gemv": []}, '"version": 1'),
    ({"version": 1, "gemv": [], "extra": 1}, r"unknown fields \['extra'\]"),
    (_doc(rows=3), "entry 0: gemv table: rows must be a power of two"),
    (_doc(rows=32), "rows must be a power of two in 1..16"),
    (_doc(n=0), "n must be a positive int"),
    (_doc(prologue="gelu"), "prologue must be one of"),
    (_doc(weight="int4"), "weight must be one of"),
    (_doc(weight="fp8", prologue="rmsnorm"), "an fp8 weight's entry is a plain product"),
    (_doc(config={"block_n": 24}), "entry 0: GemvConfig.block_n must be a power of two"),
    (_doc(config={"block_n": 8}), "must be >= 16 with use_dot"),
    (_doc(config={"use_dot": True, "acc2d": True}), "acc2d"),
    (_doc(config={"block_n": 16, "blockk": 32}), "blockk"),
    (_doc(config={"split_k": 2.0}), "split_k must be an int"),
    (_doc(config={"use_dot": 1}), "use_dot must be a bool"),
    (_doc(gemv_us="fast"), "gemv_us must be a number"),
    (_doc(speed=1), r"unknown fields \['speed'\]"),
    ({"version": 1, "gemv": [{"rows": 1, "n": 64, "k": 32, "config": {}}]}, r"missing \['prologue'\]"),
])
def test_malformed_tables_are_refused_by_entry(doc, match):
    with pytest.raises(ValueError, match=match):
        gemv_config.table_from_json(doc, "t.json")


def test_a_second_entry_for_a_product_is_refused(tmp_path):
    doc = _doc()
    doc["gemv"].append(dict(doc["gemv"][0]))
    path = tmp_path / "dup.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(ValueError, match=r"dup.json: gemv entry 1: a second entry for \(1, 64, 32, None, None\)"):
        gemv_config.read_table(str(path))
    path.write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        gemv_config.read_table(str(path))


def test_unknown_device_keeps_cublas_with_one_info_line(tm_log):
    tm_log.set_level(logging.INFO, logger="tokenmill")
    table = gemv_config.load_table("Imaginary GPU 9000")
    assert len(table) == 0 and table.device == "Imaginary GPU 9000"
    assert gemv_config.load_table("Imaginary GPU 9000") is table              # loaded once
    lines = [r.getMessage() for r in tm_log.records if "Imaginary GPU 9000" in r.getMessage()]
    assert len(lines) == 1 and "Imaginary_GPU_9000.json" in lines[0] and "cuBLAS" in lines[0]
    for m in (1, 2, 16):
        assert table.prefer(m, 4096, 4096) is None and table.tuned(m, 4096, 4096) is None


def test_the_policy_follows_tokenmill_gemv(monkeypatch):
    h200 = gemv_config.load_table("NVIDIA H200")
    monkeypatch.setattr(gemv_config, "table_for", lambda device: h200)
    dev = torch.device("cpu")
    with envs.override(TOKENMILL_GEMV="auto"):
        assert gemv_config.choose(1, 4096, 1024, "rmsnorm", dev) == OLD[(1, 4096, 1024, "rmsnorm")]
        assert gemv_config.choose(1, 4096, 1024, None, dev) is None          # only the fused form was faster
    with envs.override(TOKENMILL_GEMV="never"):
        assert gemv_config.choose(1, 4096, 1024, "rmsnorm", dev) is None
    with envs.override(TOKENMILL_GEMV="always"):
        assert gemv_config.choose(1, 4096, 1024, None, dev) == OLD[(1, 4096, 1024, "rmsnorm")]  # the shape's
        assert gemv_config.choose(3, 96, 64, None, dev) == default_config(3, 96, 64, 132)
        assert gemv_config.choose(17, 96, 64, None, dev) is None
    with pytest.raises(ValueError, match="TOKENMILL_GEMV='sometimes': choose one of auto, always, never"):
        with envs.override(TOKENMILL_GEMV="sometimes"):
            pass


def test_cpu_tensors_get_the_empty_table():
    assert gemv_config.table_for(torch.device("cpu")) is gemv_config.EMPTY_TABLE
    assert gemv_config.sm_count(torch.device("cpu")) == 132


@pytest.mark.parametrize("sms", [16, 78, 132, 144])
def test_the_heuristic_always_gives_a_launchable_config(sms):
    """Any shape the gemv may take (1..16 rows), on any SM count: a config GemvConfig accepts, whose launch has
    at least one K step per split and fits the split-K counter buffer."""
    for n in (1, 2, 7, 64, 1000, 4096, 151936, 600000):
        for k in (1, 8, 100, 1024, 14336):
            for m in (1, 5, 16):
                cfg = default_config(m, n, k, sms)
                block_m, tiles, split, k_per_split = launch_plan(m, n, k, cfg)
                assert split >= 1 and (split == 1 or tiles <= _MAX_SPLIT_TILES)
                assert (split - 1) * k_per_split < k <= split * k_per_split


def test_an_fp8_entry_decides_only_the_fp8_product():
    """An fp8 weight's config (half the bytes per K step) is the fp8 product's alone: the bf16 product of the same
    shape keeps cuBLAS and the heuristic, and the fp8 product without an entry gets none."""
    fp8 = GemvConfig(32, 256, 4, use_dot=False, acc2d=True)
    table = GemvTable({(1, 6144, 4096, None, "fp8"): GemvEntry(fp8)})
    assert table.prefer(1, 6144, 4096, None, "fp8") == fp8
    assert table.prefer(1, 6144, 4096) is None and table.tuned(1, 6144, 4096) is None
    assert table.prefer(2, 6144, 4096, None, "fp8") is None
    assert default_config(1, 6144, 4096, 132, table) == default_config(1, 6144, 4096, 132)
