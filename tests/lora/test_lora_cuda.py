"""Multi-LoRA on CUDA (run with `pytest -m gpu` on the device): steps with adapters replay the CUDA graphs with the
Triton deltas inside, and give the greedy tokens of the eager engine running the torch reference deltas."""
from __future__ import annotations

import json
import os

import pytest
import torch

pytestmark = pytest.mark.gpu

PROMPTS = ["Hello, my name is", "The quick brown fox jumps over the lazy dog because it", "a b c d e f g",
           "In 1492, Columbus sailed across the Atlantic Ocean and reached the islands of"]


def _write_adapter(base: str, out: str, seed: int, r: int, targets: list[str]) -> str:
    """A random adapter as PEFT saves one (lora_B random too, so it changes the output), without peft."""
    from safetensors.torch import save_file
    cfg = json.load(open(os.path.join(base, "config.json")))
    h, inter = cfg["hidden_size"], cfg["intermediate_size"]
    hd = cfg.get("head_dim") or h // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    shapes = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h), "gate_proj": (h, inter),
              "up_proj": (h, inter), "down_proj": (inter, h)}
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(cfg["num_hidden_layers"]):
        for m in targets:
            k, n = shapes[m]
            group = "mlp" if m in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            p = f"base_model.model.model.layers.{layer}.{group}.{m}"
            tensors[f"{p}.lora_A.weight"] = torch.randn(r, k, generator=g) * 0.3
            tensors[f"{p}.lora_B.weight"] = torch.randn(n, r, generator=g) * 0.3
    os.makedirs(out, exist_ok=True)
    save_file(tensors, os.path.join(out, "adapter_model.safetensors"))
    json.dump({"peft_type": "LORA", "r": r, "lora_alpha": 2 * r, "target_modules": targets, "bias": "none",
               "base_model_name_or_path": base}, open(os.path.join(out, "adapter_config.json"), "w"))
    return out


def test_graph_steps_with_adapters_match_the_eager_reference(tiny_model_factory, tmp_path):
    from tokenmill import LLM, SamplingParams
    from tokenmill.lora.request import LoRARequest
    base = tiny_model_factory("llama")
    every = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    specs = [(8, every), (4, ["q_proj", "v_proj"]), (16, ["o_proj", "gate_proj", "down_proj"])]
    loras = [LoRARequest(f"a{i}", i + 1, _write_adapter(base, str(tmp_path / f"a{i}"), i + 1, r, t))
             for i, (r, t) in enumerate(specs)]
    prompts, reqs = [], []
    for p in PROMPTS:
        for lo in [None, *loras]:
            prompts.append(p)
            reqs.append(lo)
    sp = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    kw = dict(dtype="float32", max_model_len=256, num_gpu_blocks_override=256, max_num_seqs=16, enable_lora=True,
              max_loras=2, max_cpu_loras=3, max_lora_rank=16, enable_prefix_caching=True)

    graphs = LLM(base, **kw)
    runner = graphs.llm_engine.engine_core.executor.worker.runner
    assert runner.cuda_graphs is not None and runner.lora.use_triton
    cg, replays, run = runner.cuda_graphs, [], runner.cuda_graphs.run

    def counting(key, n):
        replays.append(not runner.lora._map_empty)
        return run(key, n)
    cg.run = counting
    got = [o.outputs[0].token_ids for o in graphs.generate(prompts, sp, use_tqdm=False, lora_request=reqs)]
    assert sum(replays) > 5  # steps with adapters ran through the graphs
    base_only = graphs.generate(PROMPTS, sp, use_tqdm=False)
    del graphs, runner, cg
    torch.cuda.empty_cache()

    eager = LLM(base, enforce_eager=True, **kw)
    eager.llm_engine.engine_core.executor.worker.runner.lora.set_kernels(False)
    want = [o.outputs[0].token_ids for o in eager.generate(prompts, sp, use_tqdm=False, lora_request=reqs)]
    assert got == want
    assert [o.outputs[0].token_ids for o in base_only] == want[::len(loras) + 1]
    assert len({tuple(t) for t in want[:len(loras) + 1]}) > 1  # the adapters change the output
