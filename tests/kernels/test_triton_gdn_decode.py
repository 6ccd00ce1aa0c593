"""The fused Gated DeltaNet decode step (tokenmill/kernels/triton_gdn_decode.py) against the pure-PyTorch ops it
replaces (ops.causal_conv1d_update, ops.recurrent_gated_delta_rule, ops.gated_rms_norm, with GatedDeltaNet's gating
math), on fresh random inputs: outputs of the decode rows, the updated conv and delta-rule state slots, and the
slots and output rows the step must leave alone.

On the CPU the kernels run in Triton's interpreter (tests/kernels/conftest.py sets TRITON_INTERPRET=1)."""
from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from tests.kernels.kernel_check import DEV, INTERPRETED, compile_for_sm90, rel_err  # noqa: E402
from tokenmill.kernels.triton_gdn_decode import gdn_decode  # noqa: E402
from tokenmill.layers import gated_deltanet_ops as ops  # noqa: E402

# fp32 agrees to rounding; in bf16 torch rounds each conv product to bf16 where the kernel sums in fp32 (and the
# interpreter truncates fp32 -> bf16), so a few conv outputs differ by an ulp and that carries into the state.
TOL = {torch.float32: 1e-5, torch.bfloat16: 3e-2 if INTERPRETED else 2e-2}


def make_case(hk, hv, dk, dv, *, kw=4, t=7, dtype=torch.float32, rows=(5, 1, 3), slots=(2, 6, 0), pad=2,
              num_slots=8, seed=0, device=DEV):
    """Random inputs of one step with T = t rows: decode rows at token indices `rows` with state `slots`, then
    `pad` CUDA-graph padding rows (the next token indices) on the scratch slot (the last one, num_slots)."""
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape, scale=1.0, dt=dtype):
        return (torch.randn(*shape, generator=gen) * scale).to(device, dt)

    c = 2 * hk * dk + hv * dv
    free = [i for i in range(t) if i not in rows]
    tok = torch.tensor(list(rows) + free[:pad], device=device)
    sl = torch.tensor(list(slots) + [num_slots] * pad, device=device)
    return dict(
        mixed=rand(t, c), z=rand(t, hv, dv), ba=rand(t, 2 * hv, scale=2.0), conv_weight=rand(c, kw, scale=0.5),
        A_log=(torch.rand(hv, generator=gen) * 2.5).to(device), dt_bias=rand(hv, dt=torch.float32),
        norm_weight=(1 + 0.2 * torch.randn(dv, generator=gen)).to(device, dtype), eps=1e-6,
        conv_cache=rand(num_slots + 1, c, kw - 1), ssm_cache=rand(num_slots + 1, hv, dk, dv, scale=0.3,
                                                                 dt=torch.float32),
        tok=tok, slots=sl, hk=hk, hv=hv, dk=dk, dv=dv)


@torch.no_grad()
def reference(case):
    """The layer's torch decode path on copies: (out rows [B, hv, dv], conv_cache, ssm_cache)."""
    hk, hv, dk, dv = case["hk"], case["hv"], case["dk"], case["dv"]
    tok, slots = case["tok"], case["slots"]
    conv_cache, ssm_cache = case["conv_cache"].clone(), case["ssm_cache"].clone()
    b, a = case["ba"].index_select(0, tok).split([hv, hv], dim=-1)
    beta = b.float().sigmoid()
    g = -case["A_log"].float().exp() * F.softplus(a.float() + case["dt_bias"].float())
    cstate = conv_cache.index_select(0, slots)
    conv = ops.causal_conv1d_update(case["mixed"].index_select(0, tok), case["conv_weight"], cstate)
    conv_cache.index_copy_(0, slots, cstate)
    n = tok.shape[0]
    q, k, v = conv.split([hk * dk, hk * dk, hv * dv], dim=-1)
    q, k, v = q.reshape(n, 1, hk, dk), k.reshape(n, 1, hk, dk), v.reshape(n, 1, hv, dv)
    sstate = ssm_cache.index_select(0, slots)
    o = ops.recurrent_gated_delta_rule(q, k, v, g[:, None], beta[:, None], sstate)[:, 0]
    ssm_cache.index_copy_(0, slots, sstate)
    h = ops.gated_rms_norm(o, case["z"].index_select(0, tok), case["norm_weight"], case["eps"])
    return h, conv_cache, ssm_cache


def run_kernel(case):
    """gdn_decode on copies of the caches and on an output prefilled with a marker: (out, conv_cache, ssm_cache)."""
    hv = case["hv"]
    conv_cache, ssm_cache = case["conv_cache"].clone(), case["ssm_cache"].clone()
    out = torch.full_like(case["z"], 7.0)
    b, a = case["ba"].split([hv, hv], dim=-1)
    gdn_decode(case["mixed"], case["z"], b, a, case["conv_weight"], case["A_log"], case["dt_bias"],
               case["norm_weight"], case["eps"], conv_cache, ssm_cache, case["tok"], case["slots"], out,
               hk=case["hk"], hv=hv, dk=case["dk"], dv=case["dv"])
    return out, conv_cache, ssm_cache


def check(case, tol, n_real):
    """The kernel against the reference: the first n_real rows (the rest are padding rows on the scratch slot,
    whose shared state is garbage by design) and every slot but the scratch one."""
    out, conv_cache, ssm_cache = run_kernel(case)
    ref_h, ref_conv, ref_ssm = reference(case)
    tok = case["tok"]
    assert rel_err(out[tok[:n_real]], ref_h[:n_real]) < tol
    assert rel_err(ssm_cache[:-1], ref_ssm[:-1]) < tol
    # The new conv window is the old one shifted plus the input: copies, exact in any dtype.
    assert torch.equal(conv_cache[:-1], ref_conv[:-1])
    untouched = torch.ones(case["conv_cache"].shape[0], dtype=torch.bool, device=tok.device)
    untouched[case["slots"]] = False
    assert torch.equal(conv_cache[untouched], case["conv_cache"][untouched])
    assert torch.equal(ssm_cache[untouched], case["ssm_cache"][untouched])
    rest = torch.ones(out.shape[0], dtype=torch.bool, device=tok.device)
    rest[tok] = False
    assert (out[rest] == 7.0).all(), "rows that are not decode rows are left alone"
    assert not out[tok].isnan().any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hk,hv,dk,dv", [(2, 4, 16, 16), (1, 3, 32, 16)])
def test_matches_reference(hk, hv, dk, dv, dtype):
    check(make_case(hk, hv, dk, dv, dtype=dtype, seed=hv + dk), TOL[dtype], n_real=3)


def test_padding_row_alone_on_scratch_and_odd_sizes():
    """A single padding row owns the scratch slot (so it is checked too); dk / dv not powers of two, K = 3, and
    conv channels spanning several channel blocks."""
    case = make_case(2, 4, 24, 40, kw=3, t=5, rows=(4, 0), slots=(1, 3), pad=1, num_slots=4, seed=9)
    out, conv_cache, ssm_cache = run_kernel(case)
    ref_h, ref_conv, ref_ssm = reference(case)
    assert rel_err(out[case["tok"]], ref_h) < TOL[torch.float32]
    assert rel_err(ssm_cache, ref_ssm) < TOL[torch.float32]
    assert torch.equal(conv_cache, ref_conv)


def test_gating_extremes():
    """softplus past its threshold (a + dt_bias > 20 passes through; exp(a) would overflow fp32) and strongly
    negative (decay ~ 1), with a small A_log so that the decay neither vanishes nor saturates."""
    case = make_case(1, 2, 16, 16, t=3, rows=(0, 2), slots=(0, 1), pad=0, num_slots=2, seed=4)
    case["ba"][0::2, 2:] = torch.tensor([[30.0, -40.0], [100.0, 0.5]], device=DEV)
    case["A_log"].fill_(-4.0)
    check(case, TOL[torch.float32], n_real=2)


def test_empty_batch_is_a_no_op():
    case = make_case(1, 2, 16, 16, rows=(), slots=(), pad=0)
    out, conv_cache, ssm_cache = run_kernel(case)
    assert (out == 7.0).all() and torch.equal(conv_cache, case["conv_cache"])


_COMPILE = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from tokenmill.kernels.triton_gdn_decode import _conv_update_kernel, _recurrence_norm_kernel
t = GPUTarget("cuda", 90, 32)


def build(fn, sig, cx, warps):
    # As a launch at the 27B shape specializes them: every pointer and integer divisible by 16.
    names = list(sig)
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in names if sig[n] != "fp32"}
    sig.update({k: "constexpr" for k in cx})
    src = ASTSource(fn=fn, signature=sig, constexprs=cx, attrs=attrs)
    return sorted(triton.compile(src, target=t, options={"num_warps": warps}).asm)


out = [build(_conv_update_kernel, {
    "x_ptr": "*bf16", "w_ptr": "*bf16", "state_ptr": "*bf16", "out_ptr": "*bf16", "tok_ptr": "*i64",
    "slot_ptr": "*i64", "C": "i32", "stride_x": "i32", "stride_w": "i32", "stride_ss": "i32", "stride_sc": "i32",
    "stride_sk": "i32", "stride_o": "i32"}, dict(K=4, BLOCK_C=256, PDL=False), 2)]
out.append(build(_recurrence_norm_kernel, {
    "conv_ptr": "*bf16", "b_ptr": "*bf16", "a_ptr": "*bf16", "z_ptr": "*bf16", "alog_ptr": "*bf16",
    "dtb_ptr": "*bf16", "nw_ptr": "*bf16", "ssm_ptr": "*fp32", "out_ptr": "*bf16", "tok_ptr": "*i64",
    "slot_ptr": "*i64", "key_dim": "i32", "stride_c": "i32", "stride_b": "i32", "stride_a": "i32",
    "stride_zt": "i32", "stride_zh": "i32", "stride_ss": "i32", "stride_sh": "i32",
    "stride_ot": "i32", "stride_oh": "i32", "q_scale": "fp32", "eps": "fp32"},
    dict(GROUP=3, DK=128, DV=128, DK_P2=128, DV_P2=128, ROUND_WH=True, PDL=False), 4))
print(out)
"""


def test_kernels_compile_for_sm90():
    """The interpreter accepts code the compiler rejects: both kernels at Qwen3.5-27B's head shape (16 key heads,
    48 value heads, dk = dv = 128, conv kernel 4) compile for an H100/H200 target."""
    assert compile_for_sm90(_COMPILE).count("ttgir") == 2


# ----- the layer: GatedDeltaNet.forward with its decode rows on the fused kernels vs its torch path -----
def _layer_and_caches(slots=6):
    tf = pytest.importorskip("transformers")
    from tokenmill.distributed import ParallelState, use_parallel_state
    from tokenmill.layers.gated_deltanet import GatedDeltaNet
    from tokenmill.worker.state_cache import RecurrentStateCache
    cfg = tf.Qwen3_5TextConfig(hidden_size=32, linear_num_key_heads=2, linear_num_value_heads=4,
                               linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4,
                               rms_norm_eps=1e-6)
    with use_parallel_state(ParallelState(world_size=1, rank=0, tp_size=1, tp_rank=0)):
        layer = GatedDeltaNet(cfg, 0).to(DEV)
    g = torch.Generator().manual_seed(0)
    for p in layer.parameters():
        p.data.copy_(torch.randn(p.shape, generator=g) * 0.3)
    caches = []
    for _ in range(2):
        cache = RecurrentStateCache({0: layer.state_shapes()}, slots, torch.float32, DEV)
        g = torch.Generator().manual_seed(1)
        for t in (cache.conv[0], cache.ssm[0]):
            t.copy_(torch.randn(t.shape, generator=g))
        caches.append(cache)
    return layer, caches


def _both_paths(monkeypatch, layer, x, views):
    """(torch path's output and caches, fused path's): views[0] / views[1] are the step's views of two equal
    caches."""
    from tokenmill.forward_context import set_forward_context
    outs = []
    for view, devices in zip(views, (frozenset(), frozenset({DEV.type}))):
        monkeypatch.setattr(type(layer), "fused_decode_devices", devices)
        with torch.no_grad(), set_forward_context(None, [], recurrent=view):
            outs.append(layer(x))
    return outs


def test_layer_mixed_batch(monkeypatch):
    """Decode rows (fused) beside a prefill chunk continuing from its state and a new prompt (torch path, each
    normalised on its own rows): the same outputs and state updates as the all-torch path."""
    import numpy as np
    layer, (c_ref, c_fused) = _layer_and_caches()
    rows, qsl = np.array([4, 1, 3, 0]), np.array([0, 1, 4, 5, 7])       # decode, chunk of 3, decode, new prompt
    computed = np.array([5, 4, 2, 0])
    x = torch.randn(7, 32, generator=torch.Generator().manual_seed(2)).to(DEV)
    want, got = _both_paths(monkeypatch, layer, x, [c.step(rows, qsl, computed) for c in (c_ref, c_fused)])
    assert rel_err(got, want) < 1e-5
    assert rel_err(c_fused.ssm[0], c_ref.ssm[0]) < 1e-5
    assert torch.equal(c_fused.conv[0], c_ref.conv[0])


def test_layer_graph_view(monkeypatch):
    """A decode CUDA graph's view (every row a decode row, a padding row on the scratch slot): the fused path
    alone, no torch fallback, gives the torch path's outputs and request slots."""
    import numpy as np

    from tokenmill.worker.state_cache import GraphRecurrentStep
    layer, caches = _layer_and_caches()
    views = [GraphRecurrentStep(c, max_rows=8) for c in caches]
    for v in views:
        v.load(np.array([4, 1, 3]), 4)
        v.view(4)
    x = torch.randn(4, 32, generator=torch.Generator().manual_seed(3)).to(DEV)
    want, got = _both_paths(monkeypatch, layer, x, views)
    assert rel_err(got, want) < 1e-5
    assert rel_err(caches[1].ssm[0][:-1], caches[0].ssm[0][:-1]) < 1e-5
    assert torch.equal(caches[1].conv[0][:-1], caches[0].conv[0][:-1])
