"""`tokenmill bench kernels`' sweep on the CPU (Triton's interpreter; tests/kernels/conftest.py sets it up): with a
given timing, the products of a tiny model get exactly the configs that beat cuBLAS by enough, each checked
against float64 by running it, and the resulting table passes `--check`'s test and round-trips through JSON."""
from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("triton")

from tests.kernels.kernel_check import INTERPRETED  # noqa: E402
from tokenmill.benchmarks import kernels as bk  # noqa: E402
from tokenmill.kernels import gemv_config as gc  # noqa: E402
from tokenmill.kernels.gemv_config import GemvConfig  # noqa: E402

pytestmark = pytest.mark.skipif(not INTERPRETED, reason="the CPU sweep runs in Triton's interpreter")

TINY = {"hidden_size": 64, "intermediate_size": 96, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16, "vocab_size": 80}
DOT = GemvConfig(16, 32, 2)
FMA = GemvConfig(8, 16, 1, 4, 1, use_dot=False, prefetch=True)


def test_sweep_picks_the_configs_that_win_and_writes_a_checked_table(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(TINY))
    products = bk.model_products(bk.load_model_config(str(tmp_path)))
    timed = []

    def time_case(case, cfg):
        """cuBLAS 10 us; the dot config 5 us on plain products (12 us with a prologue), the FMA one 9.8 us on
        o_proj (within 3%: not enough) and 8 us elsewhere; the second pass's variants 20 us."""
        timed.append((case.product.name, case.m, cfg))
        if cfg is None:
            return 10.0
        if cfg == DOT:
            return 5.0 if case.product.prologue is None else 12.0
        if cfg == FMA:
            return 9.8 if case.product.name == "o_proj" else 8.0
        return 20.0

    lines = []
    entries, measured = bk.measure(products, [1], torch.device("cpu"), time_case=time_case,
                                   candidates=lambda m, p: [DOT, FMA], out=lines.append)
    keys = {(1, p.n, p.k, p.prologue, None) for p in products}
    assert measured == keys
    want = {(1, p.n, p.k, p.prologue, None): DOT if p.prologue is None else FMA for p in products}
    assert {key: e.config for key, e in entries.items()} == want
    assert all((e.cublas_us, e.gemv_us) == (10.0, 5.0 if e.config == DOT else 8.0) for e in entries.values())
    # the second pass timed the variants of the first pass's best configs
    assert any(cfg not in (None, DOT, FMA) and cfg.xprefetch for _, _, cfg in timed)
    assert sum("-> table" in line for line in lines) == len(want)

    table = gc.GemvTable(entries, device="CPU test")
    assert bk.check_table(table, torch.device("cpu"), out=lines.append) == 0
    path = tmp_path / "table.json"
    gc.write_table(str(path), table)
    assert gc.read_table(str(path)).entries == entries


def test_sweep_writes_nothing_where_the_gemv_loses(tmp_path):
    products = [bk.Product("p", 48, 64), bk.Product("q", 40, 32, "silu_mul")]
    entries, measured = bk.measure(products, [1], torch.device("cpu"), time_case=lambda case, cfg: 10.0,
                                   candidates=lambda m, p: [DOT], out=lambda line: None)
    assert entries == {} and measured == {(1, 48, 64, None, None), (1, 40, 32, "silu_mul", None)}


def test_fp8_sweep_measures_against_the_untuned_gemv_and_checks_its_entries(tmp_path):
    """--quantization fp8: the plain products with fp8 weights and row scales; the baseline call is the gemv's
    untuned fp8 config (run here, so it must be right too), the entries carry the weight and pass the check."""
    from tokenmill.kernels.triton_gemv import untuned_fp8_config
    (tmp_path / "config.json").write_text(json.dumps(TINY))
    products = bk.fp8_products(bk.model_products(bk.load_model_config(str(tmp_path))))
    assert {p.name for p in products} == {"qkv_proj", "o_proj", "gate_up_proj", "down_proj"}
    fma = GemvConfig(8, 16, 2, 4, 1, use_dot=False, acc2d=True)
    seen = []

    def time_case(case, cfg):
        out = case.call(0, cfg)()                      # the call runs: fp8 weight, its scales, this config
        assert out.shape == (1, case.product.n) and out.dtype == torch.bfloat16
        seen.append(cfg)
        return 10.0 if cfg is None else (6.0 if case.product.name != "o_proj" else 9.9)

    entries, measured = bk.measure(products, [1], torch.device("cpu"), time_case=time_case,
                                   candidates=lambda m, p: [fma], out=lambda line: None)
    assert None in seen
    assert measured == {(1, p.n, p.k, None, "fp8") for p in products}
    assert {key[1] for key in entries} == {p.n for p in products if p.name != "o_proj"}       # o_proj: 1% only
    assert all(key[4] == "fp8" and e.config.use_dot is False for key, e in entries.items())
    case = bk.Case(products[0], 1, bk.weight_copies(products[0], torch.device("cpu"), calls=1))
    assert case.error(untuned_fp8_config(1, products[0].n, products[0].k, torch.device("cpu"))) < bk.TOLERANCE
    lines = []
    assert bk.check_table(gc.GemvTable(entries), torch.device("cpu"), out=lines.append) == 0
    assert len(lines) == len(entries) and all(" fp8 " in line for line in lines)
