"""What the kernel tests share: where they run and how they compare (METHOD.md's relative error).

tests/kernels/conftest.py sets TRITON_INTERPRET=1 without CUDA before triton is imported, so on the CPU the kernels
run in Triton's interpreter. That interpreter (triton 3.9) converts fp32 -> bf16 by truncation where the GPU
rounds to nearest even, so bf16 bounds are looser when INTERPRETED.
"""
from __future__ import annotations

import torch

from tokenmill import envs
from tokenmill.kernels import pdl

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
INTERPRETED = envs.TRITON_INTERPRET


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64; a NaN (an element the kernel never wrote, say) fails at once."""
    out, ref = out.double(), ref.double()
    assert not out.isnan().any(), "NaN in output (unwritten element?)"
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def check_pdl_chain(chain, replays: int = 3) -> None:
    """`chain()` (a sequence of dependent kernel launches returning its last output) run with programmatic
    dependent launch and captured in a CUDA graph must be bit-identical to the same chain in plain stream order,
    eagerly and on every replay (each replay starts from a zeroed output), with the default early triggers, with
    every kernel triggering its successor after its wait and with every kernel triggering it before."""
    with pdl.launch_mode(enabled=False):
        want = chain()
    for early in (pdl.EARLY_KINDS, (), pdl.KINDS):
        with pdl.launch_mode(early=early):
            assert torch.equal(chain(), want)        # eager; also compiles and creates counters outside the capture
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                got = chain()
            for _ in range(replays):
                got.zero_()
                g.replay()
                torch.cuda.synchronize()
                assert torch.equal(got, want), f"early triggers in {sorted(early)}"


def compile_for_sm90(script: str) -> str:
    """Run `script` (which compiles kernels with triton.compile for a GPUTarget("cuda", 90, 32) and prints each
    result's sorted asm keys) in a process without the interpreter, and return its stdout: the interpreter accepts
    code the compiler rejects. Skips the test where this triton cannot compile for sm_90."""
    import os
    import subprocess
    import sys

    import pytest
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    if r.returncode != 0 and ("ImportError" in r.stderr or "ptxas" in r.stderr):
        pytest.skip(f"no sm_90 compile here: {r.stderr.strip().splitlines()[-1]}")
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout
