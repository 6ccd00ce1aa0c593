"""Gated DeltaNet ops: the chunked delta rule against its step-by-step recurrence (with initial and final states,
chunks of several sizes), both against HF transformers' torch fallback, and the conv1d / gated norm against HF."""
import pytest
import torch

from tokenmill.layers import gated_deltanet_ops as ops

hf = pytest.importorskip("transformers.models.qwen3_5.modeling_qwen3_5")


def _inputs(L, hk=2, hv=4, dk=16, dv=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(L, hk, dk, generator=g)
    k = torch.randn(L, hk, dk, generator=g)
    v = torch.randn(L, hv, dv, generator=g)
    gl = -torch.rand(L, hv, generator=g) * 2          # log decay in (-2, 0]
    beta = torch.rand(L, hv, generator=g)
    s0 = torch.randn(hv, dk, dv, generator=g) * 0.3
    return q, k, v, gl, beta, s0


@pytest.mark.parametrize("L,chunk", [(1, 64), (37, 16), (64, 64), (130, 64)])
def test_chunked_matches_recurrence(L, chunk):
    q, k, v, g, beta, s0 = _inputs(L)
    o, s = ops.chunk_gated_delta_rule(q, k, v, g, beta, s0, chunk=chunk)
    st = s0.clone()[None]
    o_ref = ops.recurrent_gated_delta_rule(q[None], k[None], v[None], g[None], beta[None], st)[0]
    torch.testing.assert_close(o, o_ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(s, st[0], rtol=1e-4, atol=1e-4)


def test_split_sequence_carries_state():
    q, k, v, g, beta, s0 = _inputs(50, seed=1)
    o_all, s_all = ops.chunk_gated_delta_rule(q, k, v, g, beta, None, chunk=16)
    o1, s1 = ops.chunk_gated_delta_rule(q[:23], k[:23], v[:23], g[:23], beta[:23], None, chunk=16)
    o2, s2 = ops.chunk_gated_delta_rule(q[23:], k[23:], v[23:], g[23:], beta[23:], s1, chunk=16)
    torch.testing.assert_close(torch.cat([o1, o2]), o_all, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(s2, s_all, rtol=1e-4, atol=1e-4)


def test_against_hf_fallbacks():
    q, k, v, g, beta, s0 = _inputs(45, seed=2)
    ho, hs = hf.torch_chunk_gated_delta_rule(q[None], k[None], v[None], g[None], beta[None], chunk_size=16,
                                            initial_state=s0[None], output_final_state=True,
                                            use_qk_l2norm_in_kernel=True)
    o, s = ops.chunk_gated_delta_rule(q, k, v, g, beta, s0)
    torch.testing.assert_close(o, ho[0], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(s, hs[0], rtol=1e-4, atol=1e-4)
    ro, rs = hf.torch_recurrent_gated_delta_rule(q[None, :1], k[None, :1], v[None, :1], g[None, :1],
                                                beta[None, :1], initial_state=s0[None], output_final_state=True,
                                                use_qk_l2norm_in_kernel=True)
    st = s0.clone()[None]
    o1 = ops.recurrent_gated_delta_rule(q[None, :1], k[None, :1], v[None, :1], g[None, :1], beta[None, :1], st)
    torch.testing.assert_close(o1, ro, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(st, rs, rtol=1e-5, atol=1e-5)


def test_conv1d_prefill_then_updates_match_hf():
    torch.manual_seed(3)
    C, K, L = 12, 4, 9
    x, w = torch.randn(L + 3, C), torch.randn(C, K)
    ref = hf.causal_conv1d_fn(x.t()[None], w, None, activation="silu")[0].t()
    out, st = ops.causal_conv1d(x[:L], w, None)
    torch.testing.assert_close(out, ref[:L])
    # Carried state: the next tokens one at a time, and a second chunk from the same state.
    chunk, _ = ops.causal_conv1d(x[L:], w, st)
    torch.testing.assert_close(chunk, ref[L:])
    state = st.clone()[None]
    for t in range(L, L + 3):
        torch.testing.assert_close(ops.causal_conv1d_update(x[t][None], w, state)[0], ref[t])
    # HF's one-step update keeps K inputs; its last K - 1 are this state.
    hf_state = torch.cat([torch.zeros(1, C, 1), st.clone()[None]], dim=2)
    mine = st.clone()[None]
    hf_out = hf.causal_conv1d_update(x[L][None, :, None], hf_state, w, None, "silu")
    torch.testing.assert_close(ops.causal_conv1d_update(x[L][None], w, mine), hf_out[:, :, 0])
    torch.testing.assert_close(mine, hf_state[:, :, 1:])


def test_gated_rms_norm_matches_hf():
    torch.manual_seed(4)
    norm = hf.Qwen3_5RMSNormGated(8, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(8))
    x, z = torch.randn(5, 8, dtype=torch.bfloat16), torch.randn(5, 8, dtype=torch.bfloat16)
    torch.testing.assert_close(ops.gated_rms_norm(x, z, norm.weight.to(torch.bfloat16), 1e-6),
                               norm.to(torch.bfloat16)(x, z))
