"""Gated DeltaNet on CUDA (run with `pytest -m gpu` on the device): flash-linear-attention's kernels, which the
layer uses when that package is importable, against the pure-PyTorch reference on fresh random inputs, and the tiny
Qwen3.5 through the engine on CUDA against the same model on the CPU (fp32, greedy)."""
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
