"""`tokenmill bench kernels` on the CPU: its flags, the products it derives from a model config, its candidate
configs and choice rule, the merge of a run into an existing table, and its refusal without CUDA. The sweep itself
runs through Triton's interpreter in tests/kernels/test_bench_kernels_sweep.py; timing needs the GPU."""
from __future__ import annotations

import re

import pytest
import torch

pytest.importorskip("triton")

from tokenmill.benchmarks import kernels as bk  # noqa: E402
from tokenmill.kernels import gemv_config as gc  # noqa: E402
from tokenmill.kernels.gemv_config import GemvConfig, GemvEntry  # noqa: E402


def _shapes(model: str, tp: int = 1) -> dict[str, tuple[int, int, str | None]]:
    return {p.name: (p.n, p.k, p.prologue) for p in bk.model_products(bk.load_model_config(model), tp)}


def test_products_of_the_shipped_shapes():
    assert _shapes("qwen3-0.6b") == {
        "qkv_proj": (4096, 1024, None), "qkv_proj+norm": (4096, 1024, "rmsnorm"), "o_proj": (1024, 2048, None),
        "gate_up_proj": (6144, 1024, None), "gate_up_proj+norm": (6144, 1024, "rmsnorm"),
        "down_proj": (1024, 3072, None), "down_proj+silu": (1024, 3072, "silu_mul"), "lm_head": (151936, 1024, None)}
    llama_tp2 = _shapes("llama-3-8b", 2)
    assert llama_tp2["qkv_proj"] == (3072, 4096, None) and llama_tp2["o_proj"] == (4096, 2048, None)
    assert llama_tp2["down_proj+silu"] == (4096, 7168, "silu_mul") and llama_tp2["lm_head"] == (64128, 4096, None)
    # every product of the shipped H200 table is one of these models' products
    ours = {v for model, tp in (("qwen3-0.6b", 1), ("llama-3-8b", 1), ("llama-3-8b", 2))
            for v in _shapes(model, tp).values()}
    assert {(n, k, pro) for _, n, k, pro, _ in gc.load_table("NVIDIA H200").entries} <= ours


def test_products_of_the_hybrid_qwen3_5_shape():
    """Qwen3.5-27B: gated attention (a query and a gate per head in the q slot) every 4th layer, Gated DeltaNet
    layers between, read from the config's text_config; one entry per shape (out_proj has o_proj's)."""
    assert _shapes("qwen3.5-27b") == {
        "qkv_proj": ((2 * 24 + 2 * 4) * 256, 5120, None), "o_proj": (5120, 24 * 256, None),
        "in_proj_qkv": (2 * 16 * 128 + 48 * 128, 5120, None), "in_proj_z": (48 * 128, 5120, None),
        "in_proj_ba": (96, 5120, None), "gate_up_proj": (2 * 17408, 5120, None),
        "down_proj+silu": (5120, 17408, "silu_mul"), "lm_head": (248320, 5120, None)}
    assert _shapes("qwen3.5-27b", 2)["in_proj_qkv"] == (2 * 8 * 128 + 24 * 128, 5120, None)


def test_products_of_a_model_directory_and_kv_replication(tmp_path):
    (tmp_path / "config.json").write_text('{"hidden_size": 512, "intermediate_size": 1536, "num_attention_heads": 8, '
                                          '"num_key_value_heads": 2, "vocab_size": 1001}')
    shapes = _shapes(str(tmp_path), 4)            # 2 KV heads over 4 ranks: one (replicated) head per rank
    assert shapes["qkv_proj"] == ((2 + 2 * 1) * 64, 512, None)
    assert shapes["gate_up_proj"] == (2 * 384, 512, None) and shapes["lm_head"] == (251, 512, None)
    with pytest.raises(ValueError, match="num_attention_heads = 8 does not split over --tensor-parallel-size 3"):
        _shapes(str(tmp_path), 3)
    (tmp_path / "config.json").write_text('{"hidden_size": 512, "num_attention_heads": 8, "vocab_size": 10}')
    with pytest.raises(ValueError, match=r"lacks \['intermediate_size'\]"):
        _shapes(str(tmp_path))
    with pytest.raises(ValueError, match="neither a shipped shape"):
        bk.load_model_config(str(tmp_path / "nowhere"))


def test_row_buckets():
    assert bk.row_buckets(1) == [1] and bk.row_buckets(8) == [1, 2, 4, 8] and bk.row_buckets(16)[-1] == 16
    for bad in (0, 6, 32):
        with pytest.raises(ValueError, match="--max-rows must be a power of two in 1..16"):
            bk.row_buckets(bad)


def test_candidates_are_valid_and_cover_splits_and_variants():
    cands = bk.first_pass(1, 4096, 4096, 132)
    assert len(set(cands)) == len(cands) and any(not c.use_dot for c in cands)
    assert {c.split_k for c in cands} >= {1, 2} and all(c.block_k <= 4096 for c in cands)
    assert all(c.use_dot for c in bk.first_pass(4, 4096, 4096, 132))          # FMA tilings only for 1-2 rows
    quick = bk.first_pass(1, 4096, 4096, 132, quick=True)
    assert set(quick) < set(cands) and all(c.use_dot for c in quick)
    fma = GemvConfig(8, 512, 1, 4, 1, use_dot=False)
    dot = GemvConfig(64, 128, 2)
    second = bk.second_pass([fma, dot])
    assert fma not in second and dot not in second and len(second) == len(set(second)) == 7 + 3
    assert GemvConfig(8, 512, 1, 4, 1, use_dot=False, prefetch=True, acc2d=True, xprefetch=True) in second
    assert not any(c.acc2d and c.use_dot for c in second)


def test_pick_takes_the_fastest_accurate_config_that_beats_cublas_enough():
    a, b, c = GemvConfig(16, 32), GemvConfig(32, 32), GemvConfig(64, 32)
    timed = [(9.0, b), (5.0, a), (9.9, c)]
    assert bk.pick(timed, 10.0, 0.03, lambda cfg: True) == (5.0, a)
    assert bk.pick(timed, 10.0, 0.03, lambda cfg: cfg != a) == (9.0, b)          # a is wrong: the next one
    assert bk.pick(timed, 10.0, 0.03, lambda cfg: cfg == c) is None              # c is within 3% of cuBLAS
    assert bk.pick(timed, 10.0, 0.0, lambda cfg: cfg == c) == (9.9, c)
    assert bk.pick(timed, 5.1, 0.03, lambda cfg: True) is None
    assert bk.pick([], 5.0, 0.03, lambda cfg: True) is None


def test_merge_replaces_what_a_run_measured_and_keeps_the_rest():
    e = {name: GemvEntry(GemvConfig(16, 32, i + 1)) for i, name in enumerate("abcd")}
    old = {(1, 64, 32, None, None): e["a"], (2, 64, 32, None, None): e["b"], (1, 64, 32, "rmsnorm", None): e["c"],
           (1, 64, 32, None, "fp8"): e["b"]}
    merged = bk.merge_entries(old, {(1, 64, 32, None, None): e["d"]},
                              measured={(1, 64, 32, None, None), (2, 64, 32, None, None)})  # rows 2 lost now
    assert merged == {(1, 64, 32, None, None): e["d"], (1, 64, 32, "rmsnorm", None): e["c"],
                      (1, 64, 32, None, "fp8"): e["b"]}


@pytest.mark.parametrize("argv,message", [
    ([], "give --model"),
    (["--model", "no-such-model"], "neither a shipped shape"),
    (["--model", "qwen3-0.6b", "--max-rows", "3"], "--max-rows must be a power of two"),
    (["--model", "qwen3-0.6b", "--tensor-parallel-size", "0"], "--tensor-parallel-size must be >= 1"),
    (["--model", "qwen3-0.6b", "--tensor-parallel-size", "3"], "does not split over --tensor-parallel-size 3"),
    (["--model", "qwen3-0.6b", "--min-gain", "1.5"], r"--min-gain must be in \[0, 1\)"),
    (["--model", "qwen3-0.6b", "--budget", "-1"], "--budget must be >= 0"),
    (["--check", "t.json", "--model", "qwen3-0.6b", "--update"], "it takes none of --model, --update"),
    (["--check", "--max-rows", "4"], "it takes none of --max-rows"),
    (["--model", "qwen3-0.6b", "--speed", "fast"], "unrecognized arguments: --speed fast"),
])
def test_bad_flags_are_refused_by_name(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        bk.main(argv)
    assert e.value.code == 2
    assert re.search(message, capsys.readouterr().err)


def test_flags_parse_into_the_products_and_rows():
    args = bk._parse(["--model", "qwen3-0.6b", "--model", "qwen3-0.6b", "--max-rows", "4", "-tp", "2", "-o", "x"])
    assert args.rows == [1, 2, 4] and args.output == "x" and len(args.products) == 8      # one set: same model
    assert args.products[0] == bk.Product("qkv_proj", (8 + 2 * 4) * 128, 1024)
    assert bk._parse(["--check"]).check == "" and bk._parse(["--check", "t.json"]).check == "t.json"


def test_fp8_products_are_the_plain_ones_but_the_lm_head():
    args = bk._parse(["--model", "llama-3-8b", "--quantization", "fp8"])
    assert [(p.name, p.n, p.k, p.prologue, p.weight) for p in args.products] == [
        ("qkv_proj", 6144, 4096, None, "fp8"), ("o_proj", 4096, 4096, None, "fp8"),
        ("gate_up_proj", 28672, 4096, None, "fp8"), ("down_proj", 4096, 14336, None, "fp8")]
    with pytest.raises(SystemExit):
        bk._parse(["--model", "llama-3-8b", "--quantization", "awq"])
    with pytest.raises(SystemExit):
        bk._parse(["--check", "--quantization", "fp8"])


def test_refused_without_cuda(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    from tokenmill.entrypoints.cli.main import BENCHMARKS, bench
    assert BENCHMARKS["kernels"][0] == "kernels:main"
    for argv in (["kernels", "--model", "qwen3-0.6b"], ["kernels", "--check"]):
        with pytest.raises(SystemExit) as e:
            bench(argv)
        assert e.value.code == 2
        assert "tokenmill bench kernels: needs 1 CUDA GPU; this machine has 0" in capsys.readouterr().err


@pytest.mark.gpu
def test_measures_writes_and_checks_a_table_on_cuda(tmp_path, capsys):
    """The whole command on a tiny model (quick sweep, rows 1-2): a table of this device that `--check` passes,
    and `--update` keeps what a second run did not measure."""
    (tmp_path / "config.json").write_text('{"hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4, '
                                          '"num_key_value_heads": 2, "vocab_size": 1000}')
    out = tmp_path / "table.json"
    assert bk.main(["--model", str(tmp_path), "--max-rows", "2", "--quick", "--min-gain", "0", "-o", str(out)]) == 0
    assert f"wrote {out}" in capsys.readouterr().out
    table = gc.read_table(str(out))
    assert table.device == torch.cuda.get_device_name() and "tokenmill bench kernels" in table.measured
    assert bk.main(["--check", str(out)]) == 0
    keep = {(16, 999, 999, None, None): GemvEntry(GemvConfig())}
    gc.write_table(str(out), gc.GemvTable({**table.entries, **keep}, device=table.device, measured=table.measured))
    assert bk.main(["--model", str(tmp_path), "--max-rows", "1", "--quick", "--update", "-o", str(out)]) == 0
    after = gc.read_table(str(out)).entries
    assert keep.items() <= after.items()
    assert "entries kept from before: `tokenmill bench kernels" in gc.read_table(str(out)).measured
    assert {k: v for k, v in after.items() if k[0] == 2} == {k: v for k, v in table.entries.items() if k[0] == 2}
