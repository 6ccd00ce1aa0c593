"""Triton skinny GEMM (tokenmill/kernels/triton_gemv.py) vs plain torch in float64.

On the CPU the kernel runs in Triton's interpreter (tests/kernels/conftest.py sets TRITON_INTERPRET=1); shapes are
small and deliberately not multiples of the blocks. The `gpu` tests run the compiled kernel at model shapes."""
from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from tests.kernels.kernel_check import DEV, INTERPRETED, check_pdl_chain, compile_for_sm90, rel_err  # noqa: E402
from tokenmill.kernels import gemv_config, triton_gemv  # noqa: E402
from tokenmill.kernels.gemv_config import GemvConfig, default_config  # noqa: E402
from tokenmill.kernels.triton_gemv import gemv, use_gemv  # noqa: E402

# The output is rounded to the activation dtype once, so its error vs float64 is about one rounding; the interpreter
# truncates fp32 -> bf16 (the GPU rounds to nearest), which doubles the bf16 figure; prologues add one or two
# roundings of the input (as torch rounds them).
TOL = {torch.float16: 1e-3, torch.bfloat16: 1.2e-2 if INTERPRETED else 6e-3}
DTYPES = [torch.bfloat16, torch.float16]

# Small configs that exercise: dot and FMA paths, one and several K splits, partial N and K tiles.
CPU_CONFIGS = [
    GemvConfig(block_n=32, block_k=32, split_k=1),
    GemvConfig(block_n=16, block_k=64, split_k=3),
    GemvConfig(block_n=16, block_k=32, split_k=1, use_dot=False),
    GemvConfig(block_n=8, block_k=16, split_k=4, use_dot=False),
    # two W tiles in flight: several K steps, one step only (the prefetch re-reads its tile), and K splits
    GemvConfig(block_n=16, block_k=16, split_k=1, num_stages=1, use_dot=False, prefetch=True),
    GemvConfig(block_n=16, block_k=32, split_k=3, num_stages=1, use_dot=True, prefetch=True),
    # FMA reducing over K every step, with and without the prefetch
    GemvConfig(block_n=8, block_k=32, split_k=2, num_stages=1, use_dot=False, prefetch=True, acc2d=True),
    GemvConfig(block_n=16, block_k=16, split_k=1, num_stages=1, use_dot=False, acc2d=True),
    # x (and residual / norm weight) one K step ahead, dot and FMA, with a partial last split
    GemvConfig(block_n=16, block_k=16, split_k=3, num_stages=1, use_dot=True, xprefetch=True),
    GemvConfig(block_n=8, block_k=32, split_k=1, num_stages=1, use_dot=False, prefetch=True, acc2d=True,
               xprefetch=True),
]
CPU_IDS = ["dot1", "dot_split", "fma1", "fma_split", "fma_pre", "dot_split_pre", "fma_pre_a2", "fma_a2",
           "dot_split_xpre", "fma_pre_a2_xpre"]


def _rand(*shape, dtype, gen, scale=1.0):
    return (torch.randn(*shape, generator=gen, device=DEV) * scale).to(dtype)


def _rms_ref(h: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    h = h.double()
    return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * w.double()


def _check(m, n, k, dtype, seed, *, config=None, bias=False, act=None, norm=False, residual=False, lead=(),
           epilogue=None, fp8=False, block=None):
    gen = torch.Generator(device=DEV).manual_seed(seed)
    k_in = 2 * k if act == "silu_mul" else k
    x = _rand(*lead, m, k_in, dtype=dtype, gen=gen, scale=2.0)
    w = _rand(n, k, dtype=dtype, gen=gen, scale=k ** -0.5)
    w_ref, w_scale = w.double(), None
    if fp8:  # e4m3 values with one float32 scale per row (the FP8 linear method's layout)
        w = (torch.randn(n, k, generator=gen, device=DEV) * 60).clamp(-448, 448).to(torch.float8_e4m3fn)
        if block is None:
            w_scale = (torch.rand(n, generator=gen, device=DEV) + 0.5) * (k ** -0.5 / 60)
            w_ref = w.double() * w_scale.double()[:, None]
        else:  # one scale per (block_n x block_k) block, partial blocks at the edges
            bn, bk = block
            w_scale = (torch.rand(-(-n // bn), -(-k // bk), generator=gen, device=DEV) + 0.5) * (k ** -0.5 / 60)
            full = w_scale.double().repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
            w_ref = w.double() * full
    b = _rand(n, dtype=dtype, gen=gen) if bias else None
    nw = _rand(k, dtype=dtype, gen=gen) if norm else None
    r = _rand(*lead, m, k, dtype=dtype, gen=gen) if residual else None
    eps = 1e-5
    # float64 reference; the residual sum is rounded to the activation dtype first, as torch (and the kernel) do.
    h = (x + r) if residual else x
    if act == "silu_mul":
        inp = F.silu(x[..., :k].double()) * x[..., k:].double()
    elif norm:
        inp = _rms_ref(h, nw, eps)
    else:
        inp = h.double()
    ref = F.linear(inp, w_ref, b.double() if bias else None)
    tol = TOL[dtype]
    if epilogue == "silu_mul":
        # w = [gate | up]; the kernel rounds gate, up, silu(gate) and the product (three more roundings).
        ref = F.silu(ref[..., :n // 2]) * ref[..., n // 2:]
        n, tol = n // 2, 3 * tol
    out = torch.full((*lead, m, n), float("nan"), dtype=dtype, device=DEV)     # poison: every element written
    x_before = x.clone()
    res = gemv(x, w, b, act=act, norm_weight=nw, eps=eps, residual=r, out=out, config=config, epilogue=epilogue,
               weight_scale=w_scale, block=block)
    if residual:
        y, r_out = res
        if dtype != torch.bfloat16 or not INTERPRETED:                   # the interpreter truncates bf16
            assert torch.equal(r_out, h), "residual_out is x + residual rounded like torch"
        assert rel_err(r_out, x.double() + r.double()) < TOL[dtype]
    else:
        y = res
    assert y is out and y.dtype == dtype and y.shape == (*lead, m, n)
    assert torch.equal(x, x_before), "x is left alone"
    err = rel_err(y, ref)
    assert err < tol, f"rel err {err:.2e} (m={m} n={n} k={k} {config})"
    for counters in triton_gemv._COUNTERS.values():
        assert not counters.any(), "split-K arrival counters must be reset to 0"
    return err


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("config", CPU_CONFIGS, ids=lambda c: f"n{c.block_n}k{c.block_k}s{c.split_k}"
                                                             f"{'dot' if c.use_dot else 'fma'}"
                                                             f"{'pre' if c.prefetch else ''}{'a2' if c.acc2d else ''}"
                                                             f"{'x' if c.xprefetch else ''}")
def test_plain_and_bias(config, dtype):
    for i, (m, n, k) in enumerate(((1, 37, 100), (3, 50, 72), (8, 33, 129))):
        _check(m, n, k, dtype, seed=i, config=config, bias=i % 2 == 1)


@pytest.mark.parametrize("config", CPU_CONFIGS[:2] + CPU_CONFIGS[3:], ids=CPU_IDS[:2] + CPU_IDS[3:])
def test_silu_mul_prologue(config):
    for i, m in enumerate((1, 2, 5)):
        _check(m, 29, 80 + i, torch.bfloat16, seed=10 + i, config=config, act="silu_mul", bias=i == 1)


@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("config", CPU_CONFIGS[:2] + CPU_CONFIGS[3:], ids=CPU_IDS[:2] + CPU_IDS[3:])
def test_rmsnorm_prologue(config, residual):
    for i, m in enumerate((1, 4, 7)):
        _check(m, 45, 96 + 7 * i, torch.float16, seed=20 + i, config=config, norm=True, residual=residual,
               bias=i == 2)


@pytest.mark.parametrize("config", CPU_CONFIGS, ids=CPU_IDS)
def test_silu_mul_epilogue(config):
    """W = [gate | up]: silu(gate) * up straight out of the product (partial pair tiles, K splits, the norm
    prologue and a bias included)."""
    for i, (m, n) in enumerate(((1, 58), (3, 64), (6, 42))):
        _check(m, n, 80 + 9 * i, torch.float16, seed=60 + i, config=config, epilogue="silu_mul", bias=i == 1,
               norm=i == 2, residual=i == 2)


@pytest.mark.parametrize("config", CPU_CONFIGS, ids=CPU_IDS)
def test_fp8_weights_with_row_scales(config):
    """float8 e4m3 weights widened in registers, each output column scaled by its row's scale (the FP8 decode
    path), alone and with the prologues and the SiLU epilogue."""
    _check(1, 37, 100, torch.bfloat16, seed=70, config=config, fp8=True)
    _check(5, 50, 72, torch.float16, seed=71, config=config, fp8=True, bias=True, norm=True, residual=True)
    _check(3, 42, 80, torch.float16, seed=72, config=config, fp8=True, epilogue="silu_mul")
    if config.use_dot:
        _check(2, 29, 64, torch.bfloat16, seed=73, config=config, fp8=True, act="silu_mul")
    w8 = torch.zeros(8, 16, device=DEV).to(torch.float8_e4m3fn)
    x = torch.zeros(1, 16, dtype=torch.bfloat16, device=DEV)
    with pytest.raises(TypeError, match="float16 or bfloat16"):
        gemv(x, w8)                                                   # fp8 needs its scales
    with pytest.raises(ValueError, match="weight_scale must be contiguous float32"):
        gemv(x, w8, weight_scale=torch.ones(4, device=DEV))


@pytest.mark.parametrize("config", [c for c in CPU_CONFIGS if c.use_dot], ids=[i for c, i in
                                                                         zip(CPU_CONFIGS, CPU_IDS) if c.use_dot])
def test_fp8_weights_with_bf16_activations_beyond_fp16_range(config):
    """bf16 activations far past fp16's largest value (65504), and tiny ones, come through an fp8 weight's dot path
    as in float64, with per-row and with block scales (a guard for the fp16 dot: one with a literal pre-scale
    overflowed here on an H100, the compiler having moved the scale after the narrowing)."""
    gen = torch.Generator(device=DEV).manual_seed(80)
    m, n, k = 3, 40, 96
    x = torch.randn(m, k, generator=gen, device=DEV) * 3e5
    x[:, ::5] *= 1e-9
    x[1] *= 1e28                    # a row past fp16's range by 38 orders of magnitude
    x[2] *= 1e-33                   # a row below fp16's smallest subnormal (6e-8) by 30
    x = x.to(torch.bfloat16)
    w = (torch.randn(n, k, generator=gen, device=DEV) * 60).clamp(-448, 448).to(torch.float8_e4m3fn)
    w_scale = torch.rand(n, generator=gen, device=DEV) + 0.5
    ref = x.double() @ (w.double() * w_scale.double()[:, None]).T
    y = gemv(x, w, weight_scale=w_scale, config=config)
    assert y.float().isfinite().all()
    for row in range(m):
        assert rel_err(y[row], ref[row]) < 1e-2, row
    # Block scales (the fp16 dot with a power-of-two scale per row and K step).
    b_scale = torch.rand(n // 8, k // 32, generator=gen, device=DEV) + 0.5
    ref = x.double() @ (w.double() * b_scale.double().repeat_interleave(8, 0).repeat_interleave(32, 1)).T
    y = gemv(x, w, weight_scale=b_scale, block=(8, 32), config=config)
    assert y.float().isfinite().all()
    for row in range(m):
        assert rel_err(y[row], ref[row]) < 1e-2, row


@pytest.mark.parametrize("config", CPU_CONFIGS, ids=CPU_IDS)
def test_fp8_weights_with_block_scales(config):
    """Block-wise FP8 (one scale per block_n x block_k block, DeepSeek-V3 / Qwen3-FP8 checkpoints): each K step's
    product scaled per column, steps cut to stay inside a block, partial blocks at the N and K edges, alone and with
    the prologues and the SiLU epilogue (whose interleaved gate / up columns come from different row blocks). FMA
    configs are replaced by a dot config."""
    _check(1, 37, 100, torch.bfloat16, seed=90, config=config, fp8=True, block=(16, 32))
    _check(5, 50, 72, torch.float16, seed=91, config=config, fp8=True, block=(8, 16), bias=True, norm=True,
           residual=True)
    _check(3, 42, 80, torch.bfloat16, seed=92, config=config, fp8=True, block=(16, 48), epilogue="silu_mul")
    _check(2, 29, 64, torch.bfloat16, seed=93, config=config, fp8=True, block=(32, 64), act="silu_mul")


def test_fp8_products_take_the_tables_fp8_entry(monkeypatch):
    """A per-row fp8 product takes the device table's fp8 entry for its shape (launched with that config, and
    right); a shape without one, a bf16 product of the same shape and a block-scaled fp8 product take theirs."""
    entry = GemvConfig(8, 16, 2, 4, 1, use_dot=False, acc2d=True)
    table = gemv_config.GemvTable({(1, 40, 64, None, "fp8"): gemv_config.GemvEntry(entry)})
    monkeypatch.setattr(triton_gemv, "table_for", lambda device: table)
    launched = []
    real = triton_gemv._launch
    monkeypatch.setattr(triton_gemv, "_launch", lambda *a, **kw: launched.append(a[11]) or real(*a, **kw))
    gen = torch.Generator(device=DEV).manual_seed(95)
    w = (torch.randn(40, 64, generator=gen, device=DEV) * 60).clamp(-448, 448).to(torch.float8_e4m3fn)
    s = torch.rand(40, generator=gen, device=DEV) + 0.5
    x = torch.randn(1, 64, generator=gen, device=DEV).to(torch.bfloat16)
    y = gemv(x, w, weight_scale=s)
    assert launched == [entry]
    assert rel_err(y[0], (x.double() @ (w.double() * s.double()[:, None]).T)[0]) < 1e-2
    gemv(torch.cat([x, x]), w, weight_scale=s)                           # rows 2: no entry
    gemv(x, w.to(torch.bfloat16))                                        # the bf16 product
    gemv(x, w, weight_scale=torch.ones(5, 4, device=DEV), block=(8, 16))
    assert launched[1] == triton_gemv.untuned_fp8_config(2, 40, 64, x.device)
    assert launched[2] == default_config(1, 40, 64, 132) and entry not in launched[1:]


def test_fp8_block_scale_checks():
    w8 = torch.zeros(40, 64, device=DEV).to(torch.float8_e4m3fn)
    x = torch.zeros(1, 64, dtype=torch.bfloat16, device=DEV)
    with pytest.raises(ValueError, match=r"weight_scale must be contiguous float32 \(3, 2\)"):
        gemv(x, w8, weight_scale=torch.ones(40, device=DEV), block=(16, 32))
    with pytest.raises(ValueError, match="block_k a multiple of 16"):
        gemv(x, w8, weight_scale=torch.ones(3, 3, device=DEV), block=(16, 24))
    with pytest.raises(ValueError, match="block goes with a float8 weight_scale"):
        gemv(x, torch.zeros(40, 64, dtype=torch.bfloat16, device=DEV), block=(16, 32))


def test_residual_without_norm_and_leading_dims():
    _check(3, 40, 64, torch.bfloat16, seed=30, config=CPU_CONFIGS[1], residual=True, lead=(2,))


def test_every_m_with_default_heuristic():
    # The default config on an odd shape: split-K with a partial last split and a partial N tile.
    for m in range(1, 9):
        _check(m, 70, 300, torch.bfloat16, seed=40 + m)
    cfg = default_config(1, 70, 300)
    assert cfg.split_k > 1


def test_m16_and_split_larger_than_k_steps():
    _check(16, 24, 48, torch.float16, seed=50, config=GemvConfig(block_n=16, block_k=16, split_k=64))


def test_rejects_bad_arguments():
    x = torch.zeros(2, 32, dtype=torch.bfloat16, device=DEV)
    w = torch.zeros(16, 32, dtype=torch.bfloat16, device=DEV)
    with pytest.raises(ValueError, match="act"):
        gemv(x, w, act="gelu")
    with pytest.raises(ValueError, match="silu_mul"):
        gemv(x, w, act="silu_mul")                                   # x must be [M, 2K]
    with pytest.raises(TypeError, match="dtype"):
        gemv(x.float(), w)
    with pytest.raises(ValueError, match="residual_out"):
        gemv(x, w, residual_out=torch.empty_like(x))
    with pytest.raises(ValueError, match="overlap"):
        r = torch.zeros_like(x)
        gemv(x, w, norm_weight=torch.ones(32, dtype=x.dtype, device=DEV), residual=r, residual_out=r)
    with pytest.raises(ValueError, match="out must not overlap"):
        gemv(x, torch.zeros(32, 32, dtype=torch.bfloat16, device=DEV), out=x)
    with pytest.raises(ValueError, match="norm_weight"):
        gemv(x, w, norm_weight=torch.ones(31, dtype=x.dtype, device=DEV))
    with pytest.raises(ValueError, match="block_n"):
        GemvConfig(block_n=8, use_dot=True)
    assert not use_gemv(x.cpu(), w.cpu())                            # CPU tensors stay on torch


# ------------------------------------------------------------------------------------------------------------ GPU
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_gemv_gpu_model_shapes(dtype):
    shapes = [(1024, 4096), (2048, 1024), (1024, 6144), (4096, 6144), (4096, 4096), (14336, 4096),
              (1024, 151936), (4096, 28672)]
    for i, (k, n) in enumerate(shapes):
        for m in (1, 2, 3, 8, 13, 16):
            _check(m, n, k, dtype, seed=100 + i * 20 + m, bias=m == 3)
    x = torch.randn(4, 1024, device=DEV, dtype=dtype)
    assert use_gemv(x, torch.empty(64, 1024, device=DEV, dtype=dtype))
    assert not use_gemv(torch.randn(17, 1024, device=DEV, dtype=dtype), torch.empty(64, 1024, device=DEV,
                                                                                      dtype=dtype))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_gemv_gpu_prologues(dtype):
    for m in (1, 4, 8, 16):
        _check(m, 1024, 3072, dtype, seed=200 + m, act="silu_mul")
        _check(m, 4096, 14336, dtype, seed=210 + m, act="silu_mul")
        _check(m, 4096, 1024, dtype, seed=220 + m, norm=True, residual=True)
        _check(m, 6144, 4096, dtype, seed=230 + m, norm=True, residual=m > 4, bias=True)
    for cfg in (GemvConfig(32, 256, 8, 4, 2), GemvConfig(16, 128, 4, 4, 1, use_dot=False),
                GemvConfig(128, 64, 1, 8, 4)):
        _check(5, 3000, 2000, dtype, seed=240, config=cfg, norm=True, residual=True, bias=True)
    h200 = gemv_config.load_table("NVIDIA H200")
    for m in (1, 3, 16):     # the SiLU epilogue at gate_up shapes, with the H200 table's (or the default) configs
        _check(m, 28672, 4096, dtype, seed=250 + m, epilogue="silu_mul", config=h200.prefer(m, 28672, 4096))
        _check(m, 6144, 1024, dtype, seed=260 + m, epilogue="silu_mul", norm=True, residual=True,
               config=h200.prefer(m, 6144, 1024, "rmsnorm"))


@pytest.mark.gpu
def test_gemv_gpu_measured_table():
    """Every entry of this GPU model's shipped table, at its own shape, row count, prologue and weight (bf16, or fp8
    with row scales), against float64; bf16 entries without the SiLU prologue also with the SiLU-and-mul epilogue
    (gate_up_proj's)."""
    name = torch.cuda.get_device_name()
    path = os.path.join(gemv_config.CONFIG_DIR, gemv_config.device_file_name(name))
    if not os.path.isfile(path):
        pytest.skip(f"no gemv table is shipped for {name}")
    table = gemv_config.read_table(path)
    for i, ((m, n, k, pro, wt), e) in enumerate(sorted(table.entries.items(), key=str)):
        _check(m, n, k, torch.bfloat16, seed=300 + i, config=e.config, act="silu_mul" if pro == "silu_mul" else None,
               norm=pro == "rmsnorm", residual=pro == "rmsnorm", fp8=wt == "fp8")
        if pro != "silu_mul" and n % 2 == 0 and wt is None:       # any even N can be a [gate | up] product
            _check(m, n, k, torch.bfloat16, seed=400 + i, config=e.config, epilogue="silu_mul",
                   norm=pro == "rmsnorm", residual=pro == "rmsnorm")


@pytest.mark.gpu
def test_gemv_gpu_cuda_graph_replays():
    """Split-K counters reset themselves: many replays of a captured graph give the same, right answer."""
    dtype = torch.bfloat16
    x = torch.randn(2, 2048, device=DEV, dtype=dtype)
    w = torch.randn(1024, 2048, device=DEV, dtype=dtype) * 0.02
    cfg = GemvConfig(block_n=64, block_k=128, split_k=8)
    y = gemv(x, w, config=cfg)                                         # warm-up outside the capture
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(5):
            y = gemv(x, w, config=cfg)
    for _ in range(3):
        x.copy_(torch.randn_like(x))
        g.replay()
        torch.cuda.synchronize()
        assert rel_err(y, F.linear(x.double(), w.double())) < TOL[dtype]
    assert not any(c.any() for c in triton_gemv._COUNTERS.values())


@pytest.mark.gpu
def test_gemv_gpu_pdl_chain_in_graph():
    """A chain of dependent products (each reads the one before; prologues, split-K counters and the deep-K batch-1
    configs of the table) captured in a CUDA graph with programmatic dependent launch: bit-identical to the same
    chain launched in plain stream order, on every replay."""
    from tokenmill.kernels import pdl
    dev = torch.device(DEV)
    if not pdl.pdl_enabled(dev):
        pytest.skip("programmatic dependent launch needs compute capability 9.0+")
    gen = torch.Generator(device=DEV).manual_seed(77)
    dt = torch.bfloat16
    # (N, K, config, prologue): 1024 -> 4096 (+norm), 2048 -> 1024, 1024 -> 6144 (+norm), 3072 -> 1024 (silu_mul),
    # then the prefetching configs (fma with K splits, dot) on 1024 -> 2048 and 1024 -> 1024 (silu_mul)
    steps = [(4096, 1024, GemvConfig(16, 512, 1, 4, 1, use_dot=False), "norm"),
             (1024, 2048, GemvConfig(8, 1024, 1, 4, 1, use_dot=False, prefetch=True), None),
             (6144, 1024, GemvConfig(8, 1024, 1, 4, 1, use_dot=False), "norm"),
             (1024, 3072, GemvConfig(64, 128, 4, 4, 3), "silu_mul"),
             (2048, 1024, GemvConfig(8, 256, 2, 4, 1, use_dot=False, prefetch=True), None),
             (1024, 1024, GemvConfig(32, 256, 1, 4, 1, prefetch=True), "silu_mul"),
             (4096, 1024, GemvConfig(8, 256, 1, 4, 1, use_dot=False, prefetch=True, acc2d=True), "norm"),
             (1024, 4096, GemvConfig(8, 512, 1, 4, 1, use_dot=False, acc2d=True), None)] * 3
    ws = [_rand(n, k, dtype=dt, gen=gen, scale=k ** -0.5) for n, k, _, _ in steps]
    nws = [_rand(k, dtype=dt, gen=gen) for _, k, _, _ in steps]
    x0 = _rand(1, 1024, dtype=dt, gen=gen)

    def chain():
        x, res = x0, x0
        for (n, k, cfg, pro), w, nw in zip(steps, ws, nws):
            if pro == "norm":
                x, res = gemv(x[:, :k], w, norm_weight=nw, residual=res[:, :k], config=cfg)
            elif pro == "silu_mul":
                x = gemv(x[:, :2 * k], w, act="silu_mul", config=cfg)
            else:
                x = gemv(x[:, :k], w, config=cfg)
        return x

    check_pdl_chain(chain)
    assert not any(c.any() for c in triton_gemv._COUNTERS.values())



def test_acc2d_needs_the_fma_path():
    with pytest.raises(ValueError, match="acc2d"):
        GemvConfig(64, 128, 1, 4, 3, use_dot=True, acc2d=True)


_COMPILE_FP8 = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from tokenmill.kernels.triton_gemv import _gemv_kernel
sig = dict(x_ptr="*bf16", w_ptr="*fp8e4nv", b_ptr="*bf16", y_ptr="*bf16", nw_ptr="*bf16", res_ptr="*bf16",
           res_out_ptr="*bf16", ws_ptr="*fp32", cnt_ptr="*i32", M="i32", N="i32", K="i32", k_per_split="i32",
           split_k="i32", eps="fp32", stride_xm="i32", stride_wn="i32", stride_ym="i32", stride_rm="i32",
           stride_rom="i32", wsc_ptr="*fp32", bsc_cols="i32")
const = dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, SPLIT=True, SILU_MUL=False, NORM=True, HAS_RES=True,
             HAS_BIAS=False, USE_DOT=True, EVEN_K=True, DOT_F32=False, PREFETCH=True, ACC2D=False, OUT_SILU=False,
             XPRE=True, PDL=False, W_SCALE=True, BLOCK_SCALE=False, BN_SCALE=128, BK_SCALE=128, F16_DOT=True)
for use_dot, out_silu, blocks in ((True, False, False), (False, True, False), (True, True, True)):
    c = {**const, "USE_DOT": use_dot, "OUT_SILU": out_silu, "NORM": not out_silu, "HAS_RES": not out_silu,
         "BLOCK_M": 16 if use_dot else 1, "W_SCALE": not blocks, "BLOCK_SCALE": blocks, "F16_DOT": blocks}
    s = {**sig, **{k: "constexpr" for k in c}}
    src = ASTSource(fn=_gemv_kernel, signature=s, constexprs=c)
    print(sorted(triton.compile(src, target=GPUTarget("cuda", 90, 32)).asm))
"""


def test_the_fp8_weight_path_compiles_for_sm90():
    """The interpreter accepts code the compiler rejects: the fp8-weight variants (dot with the norm prologue and
    split-K; FMA with the SiLU epilogue; block scales with the SiLU epilogue) compiled for an H100/H200 target,
    in a process without the interpreter."""
    assert compile_for_sm90(_COMPILE_FP8).count("ttgir") == 3
