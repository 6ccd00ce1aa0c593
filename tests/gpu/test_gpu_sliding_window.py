"""Sliding-window models on CUDA (run with `pytest -m gpu` on the device): a KV cache in several layer groups (window
layers beside full ones) runs through the CUDA graphs, each group with its own slot mapping and block table, and
gives the CPU's greedy tokens (fp32) with prompts several windows long, split over steps (mixed graphs) and
decoded (uniform graphs)."""
from __future__ import annotations

import pytest
import torch

from tests.models.test_sliding_window_models import PROMPTS, _config
from tokenmill import LLM, SamplingParams

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("arch", ["qwen2", "gemma2", "gemma3"])
def test_layer_groups_in_cuda_graphs_match_cpu(arch, tmp_path, smollm2_tokenizer):
    import transformers as tf
    tok = smollm2_tokenizer
    torch.manual_seed(4321)
    hf = tf.AutoModelForCausalLM.from_config(_config(arch, len(tok), tok.bos_token_id or 0, tok.eos_token_id),
                                             dtype=torch.float32).eval()
    hf.save_pretrained(str(tmp_path))
    tok.save_pretrained(str(tmp_path))
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    outs, replays = {}, []
    for name, dev, eager in (("cpu", "cpu", True), ("graphs", "cuda", False)):
        llm = LLM(str(tmp_path), dtype="float32", device=dev, max_model_len=256, block_size=4,
                  num_gpu_blocks_override=512, max_num_batched_tokens=16, max_num_seqs=8, enforce_eager=eager,
                  enable_prefix_caching=False)
        runner = llm.llm_engine.engine_core.executor.worker.runner
        cg = runner.cuda_graphs
        assert (cg is None) == eager
        if cg is not None:
            assert runner.group_tables is not None and cg.layer_group is not None
            run = cg.run

            def counted(key, n):
                replays.append(key.q)
                return run(key, n)
            cg.run = counted
        outs[name] = [o.outputs[0].token_ids for o in llm.generate(PROMPTS * 2, sp, use_tqdm=False)]
        del llm
    assert outs["graphs"] == outs["cpu"]
    assert replays.count(1) >= 20, replays      # decode steps replayed uniform graphs
    assert 0 in replays, replays                # prompt chunks beside decodes replayed mixed graphs
