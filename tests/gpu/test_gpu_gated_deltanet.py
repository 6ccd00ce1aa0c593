"""Gated DeltaNet on CUDA (run with `pytest -m gpu` on the device): flash-linear-attention's kernels, which the
layer uses for prefill when that package is importable, and the fused decode kernels (kernels/triton_gdn_decode.py)
against the pure-PyTorch reference on fresh random inputs, and the tiny Qwen3.5 through the engine on CUDA against
the same model on the CPU (fp32, greedy)."""
from __future__ import annotations

import pytest
import torch

from tokenmill.layers import gated_deltanet_ops as ops

pytestmark = pytest.mark.gpu


def _inputs(n, hk, hv, dk, dv, seed, batch=None):
    g = torch.Generator().manual_seed(seed)
    lead = (n,) if batch is None else (batch,)
    q = torch.randn(*lead, hk, dk, generator=g)
    k = torch.randn(*lead, hk, dk, generator=g)
    v = torch.randn(*lead, hv, dv, generator=g)
    gl = -torch.rand(*lead, hv, generator=g) * 2
    beta = torch.rand(*lead, hv, generator=g)
    s0 = torch.randn(batch or 1, hv, dk, dv, generator=g) * 0.3
    return q, k, v, gl, beta, s0


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("n", [1, 63, 200])
def test_fla_chunked_prefill_matches_reference(n):
    if ops.fla_ops() is None:
        pytest.skip("flash-linear-attention is not installed")
    q, k, v, g, beta, s0 = _inputs(n, 4, 8, 128, 128, seed=n)
    o_ref, s_ref = ops.chunk_gated_delta_rule(q.double(), k.double(), v.double(), g.double(), beta.double(),
                                              s0[0].double())
    o, s = ops.delta_rule_prefill(*(t.cuda() for t in (q, k, v, g, beta)), s0[0].cuda())
    assert _rel(o.cpu(), o_ref) < 2e-3 and _rel(s.cpu(), s_ref) < 2e-3


def test_fla_decode_matches_reference():
    if ops.fla_ops() is None:
        pytest.skip("flash-linear-attention is not installed")
    q, k, v, g, beta, s0 = _inputs(None, 4, 8, 128, 128, seed=5, batch=6)
    st_ref = s0.clone()  # the reference recurrence runs in float32 (its state's dtype), on the CPU
    o_ref = ops.recurrent_gated_delta_rule(q[:, None], k[:, None], v[:, None], g[:, None], beta[:, None],
                                           st_ref)[:, 0]
    st = s0.cuda().clone()
    o = ops.delta_rule_decode(*(t.cuda() for t in (q, k, v, g, beta)), st)
    assert _rel(o.cpu(), o_ref) < 2e-3 and _rel(st.cpu(), st_ref) < 2e-3


def test_tiny_qwen3_5_on_cuda_matches_cpu(tmp_path, smollm2_tokenizer):
    """CPU, CUDA eager and CUDA with decode graphs give the same greedy tokens; the graphs replay decode steps
    (each continuing the recurrent state from its slot) while prompts split over 32-token steps run eagerly."""
    import transformers as tf

    from tests.models.test_qwen3_5 import PROMPTS, _text_config
    from tokenmill import LLM, SamplingParams
    tok = smollm2_tokenizer
    torch.manual_seed(0)
    hf = tf.Qwen3_5ForCausalLM(_text_config(len(tok), tok.bos_token_id or 0, tok.eos_token_id)).eval()
    hf.save_pretrained(str(tmp_path))
    tok.save_pretrained(str(tmp_path))
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outs, replays = {}, []
    for name, dev, eager in (("cpu", "cpu", True), ("eager", "cuda", True), ("graphs", "cuda", False)):
        llm = LLM(str(tmp_path), dtype="float32", device=dev, max_model_len=256, num_gpu_blocks_override=256,
                  max_num_batched_tokens=32, max_num_seqs=8, enforce_eager=eager)
        cg = llm.llm_engine.engine_core.executor.worker.runner.cuda_graphs
        assert (cg is None) == eager
        if cg is not None:
            run = cg.run

            def counted(key, n):
                replays.append(n)
                return run(key, n)
            cg.run = counted
        outs[name] = [o.outputs[0].token_ids for o in llm.generate(PROMPTS * 2, sp, use_tqdm=False)]
        del llm
    assert outs["eager"] == outs["cpu"]
    assert outs["graphs"] == outs["cpu"]
    assert len(replays) >= 8 and max(replays) > 1


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fused_decode_at_27b_head_shape(dtype):
    """kernels/triton_gdn_decode.py compiled, at Qwen3.5-27B's head shape (16 key heads, 48 value heads,
    dk = dv = 128), against the torch decode path; then captured in a CUDA graph (token indices and slots read from
    device buffers) and replayed from the same caches: the same results as the eager launch."""
    from tests.kernels.kernel_check import rel_err
    from tests.kernels.test_triton_gdn_decode import make_case, reference, run_kernel
    from tokenmill.kernels.triton_gdn_decode import gdn_decode
    case = make_case(16, 48, 128, 128, dtype=dtype, t=9, rows=(5, 1, 3, 8), slots=(2, 6, 0, 7), pad=2,
                     device=torch.device("cuda"), seed=11)
    out, conv_cache, ssm_cache = run_kernel(case)
    ref_h, ref_conv, ref_ssm = reference(case)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    n, tok = 4, case["tok"]
    assert rel_err(out[tok[:n]], ref_h[:n]) < tol
    assert rel_err(ssm_cache[:-1], ref_ssm[:-1]) < tol
    assert torch.equal(conv_cache[:-1], ref_conv[:-1])

    hv = case["hv"]
    g_conv, g_ssm = case["conv_cache"].clone(), case["ssm_cache"].clone()
    g_out = torch.full_like(case["z"], 7.0)
    b, a = case["ba"].split([hv, hv], dim=-1)
    tok_buf, slot_buf = torch.zeros_like(tok), torch.zeros_like(case["slots"])

    def launch():
        gdn_decode(case["mixed"], case["z"], b, a, case["conv_weight"], case["A_log"], case["dt_bias"],
                   case["norm_weight"], case["eps"], g_conv, g_ssm, tok_buf, slot_buf, g_out, hk=16, hv=hv,
                   dk=128, dv=128)
    launch()                 # compiles outside the capture (every row on token 0, slot 0: the caches are reset below)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        launch()
    g_conv.copy_(case["conv_cache"])
    g_ssm.copy_(case["ssm_cache"])
    g_out.fill_(7.0)
    tok_buf.copy_(tok)
    slot_buf.copy_(case["slots"])
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(g_out[tok[:n]], out[tok[:n]])
    assert torch.equal(g_ssm[:-1], ssm_cache[:-1]) and torch.equal(g_conv[:-1], conv_cache[:-1])
