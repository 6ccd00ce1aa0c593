"""Mixture-of-experts models on CUDA (run with `pytest -m gpu` on the device): the grouped Triton experts inside the
CUDA graphs give the CPU path's greedy tokens (fp32), with prompts split over steps (mixed graphs) and decoded
(uniform graphs). The kernels alone: tests/kernels/test_triton_fused_moe.py."""
from __future__ import annotations

import pytest
import torch

from tests.models.test_moe_models import PROMPTS, _config
from tokenmill import LLM, SamplingParams

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2_moe", "mixtral", "qwen3_5_moe", "qwen3_moe+routing"])
def test_experts_in_cuda_graphs_match_cpu(arch, tmp_path, smollm2_tokenizer):
    """With "+routing" the routing kernels (TOKENMILL_MOE_ROUTING_KERNELS=1) run inside the graphs too."""
    import transformers as tf
    from tokenmill import envs
    arch, _, routing = arch.partition("+")
    with envs.override(TOKENMILL_MOE_ROUTING_KERNELS=bool(routing)):
        _run_against_cpu(arch, tmp_path, tf, smollm2_tokenizer)


def _run_against_cpu(arch, tmp_path, tf, smollm2_tokenizer):
    tok = smollm2_tokenizer
    torch.manual_seed(1234)
    cfg = _config(arch, len(tok), tok.bos_token_id or 0, tok.eos_token_id)
    hf = tf.Qwen3_5MoeForCausalLM(cfg) if arch == "qwen3_5_moe" \
        else tf.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("gate.weight"):
                p.normal_(0.0, 0.5)
    hf.float().save_pretrained(str(tmp_path))
    tok.save_pretrained(str(tmp_path))
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    outs, replays = {}, []
    for name, dev, eager in (("cpu", "cpu", True), ("graphs", "cuda", False)):
        llm = LLM(str(tmp_path), dtype="float32", device=dev, max_model_len=256, block_size=16,
                  max_num_batched_tokens=16, max_num_seqs=8, enforce_eager=eager, enable_prefix_caching=False,
                  gpu_memory_utilization=0.3)
        cg = llm.llm_engine.engine_core.executor.worker.runner.cuda_graphs
        assert (cg is None) == eager
        if cg is not None:
            run = cg.run

            def counted(key, n):
                replays.append(key.q)
                return run(key, n)
            cg.run = counted
        outs[name] = [o.outputs[0].token_ids for o in llm.generate(PROMPTS * 2, sp, use_tqdm=False)]
        del llm
    assert outs["graphs"] == outs["cpu"]
    assert replays.count(1) >= 20, replays
    if arch != "qwen3_5_moe":  # the hybrid captures decode graphs only; prompt chunks run eagerly
        assert 0 in replays, replays

