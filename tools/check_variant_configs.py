"""Checks every gemv config that tools/graph_ab.py's variants put in the table, at its own shape and prologue
(and, for a gate_up entry, plain or with the norm, with the SiLU-and-mul epilogue it runs with at batch 1), against
float64: the measured-table test's check for configs not yet in the table. Runs on the GPU machine.
Usage: python3 tools/check_variant_configs.py MODEL"""
from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import graph_ab  # noqa: E402
from tests.kernels.test_triton_gemv import _check  # noqa: E402


def main() -> None:
    seen = set()
    for name, variant in graph_ab.VARIANTS[sys.argv[1]].items():
        for (m, n, k, pro), cfg in variant[1].items():
            if cfg is None or (m, n, k, pro, cfg) in seen:
                continue
            seen.add((m, n, k, pro, cfg))
            kw = dict(act="silu_mul" if pro == "silu_mul" else None, norm=pro == "rmsnorm",
                      residual=pro == "rmsnorm")
            _check(m, n, k, torch.bfloat16, seed=len(seen), config=cfg, **kw)
            if pro in (None, "rmsnorm") and n == 28672:
                _check(m, n, k, torch.bfloat16, seed=len(seen), config=cfg, epilogue="silu_mul",
                       norm=pro == "rmsnorm", residual=pro == "rmsnorm")
            print(f"ok {name}: {(m, n, k, pro)} {cfg}", flush=True)


if __name__ == "__main__":
    main()
