"""`tokenmill bench kv-footprint`: the KV memory one long request holds at its peak, per layer group, against the
same shape with every layer global (full attention). Exact and device-free: the engine's own scheduler and KV cache
managers run the request's steps with a fake runner (the config alone is read; no weights, no model).

On a sliding-window model the global layers hold the whole context and the sliding ones their window plus one
prefill chunk, so the peak depends on the token budget (`--max-num-batched-tokens`; the API server's default is
2048). Recurrent-state layers (hybrid models) hold a fixed slot, not blocks, and are not counted here.

Example: tokenmill bench kv-footprint --model gemma-3-4b --prompt-len 32000 --output-len 256
"""
from __future__ import annotations

import argparse
import json

from tokenmill.benchmarks.offline_common import shipped_model_dir


def peak_kv_bytes(model: str, prompt_len: int, output_len: int, budget: int) -> dict:
    """{"groups": [[kind, layers, peak blocks, peak bytes], ...], "bytes": the peak over the request's steps,
    "all_global_bytes": what it would hold with every layer global, "ratio"} for one request of prompt_len tokens
    generating output_len, its prompt chunked at `budget` tokens a step."""
    from tokenmill.config.engine_args import create_engine_config
    from tokenmill.core.kv_cache_groups import kv_groups
    from tokenmill.core.kv_cache_spec import FullAttentionSpec, config_attention_specs
    from tokenmill.core.messages import EngineCoreRequest
    from tokenmill.core.sched_output import ModelRunnerOutput
    from tokenmill.core.scheduler import Scheduler
    from tokenmill.sampling_params import SamplingParams
    total = prompt_len + output_len
    cfg = create_engine_config(model=model, load_format="dummy", max_model_len=total, max_num_batched_tokens=budget,
                               max_num_seqs=1, enable_prefix_caching=False, skip_tokenizer_init=True, device="cpu")
    groups = kv_groups(config_attention_specs(cfg))
    if not groups:
        raise ValueError(f"{model}: no attention layer keeps KV blocks")
    need = [s.max_blocks_per_request(total, budget) for s, _ in groups]
    sched = Scheduler(cfg, tuple(n + 8 for n in need))
    managers = getattr(sched.kv, "groups", [sched.kv])
    cost = [s.bytes_per_block * len(layers) for s, layers in groups]
    sp = SamplingParams(max_tokens=output_len, ignore_eos=True)
    sp.update_from_tokenizer(eos_token_id=None, bad_words_ids=None)
    sched.add_request(EngineCoreRequest("r", [11] * prompt_len, sp, 0.0, 0))
    most, held = 0, [0] * len(groups)
    while sched.has_unfinished_requests():
        out = sched.schedule()
        r = sched.requests["r"]
        now = [m.num_held_blocks("r") for m in managers]
        if sum(n * c for n, c in zip(now, cost)) > most:
            most, held = sum(n * c for n, c in zip(now, cost)), now
        sched.update_from_output(out, ModelRunnerOutput(
            req_ids=["r"], sampled_token_ids=[[7] if r.num_computed_tokens >= r.num_tokens else []]))
    s0 = groups[0][0]
    full = FullAttentionSpec(s0.block_size, s0.num_kv_heads, s0.head_size, s0.dtype_bytes)
    layers = sum(len(ls) for _, ls in groups)
    all_global = full.max_blocks_per_request(total, budget) * full.bytes_per_block * layers
    rows = [[s.name, len(ls), n, n * c] for (s, ls), n, c in zip(groups, held, cost)]
    return {"groups": rows, "bytes": most, "all_global_bytes": all_global, "ratio": most / all_global}


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="tokenmill bench kv-footprint", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="gemma-3-4b", help="A model directory or a shipped config name.")
    p.add_argument("--prompt-len", type=int, default=32000)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, nargs="+", default=[2048, 8192],
                   help="Token budgets to report (the prefill chunk). Default 2048 8192.")
    p.add_argument("--output-json", default=None)
    a = p.parse_args(argv)
    model = shipped_model_dir(a.model) or a.model
    results = {}
    for budget in a.max_num_batched_tokens:
        r = results[budget] = peak_kv_bytes(model, a.prompt_len, a.output_len, budget)
        print(f"budget {budget}: peak {r['bytes'] / 2**20:.0f} MiB, {r['ratio']:.3f} of the "
              f"{r['all_global_bytes'] / 2**20:.0f} MiB with every layer global")
        for kind, layers, blocks, nbytes in r["groups"]:
            print(f"  {kind}: {layers} layers, {blocks} blocks, {nbytes / 2**20:.0f} MiB")
    if a.output_json:
        with open(a.output_json, "w") as f:
            json.dump(results, f, indent=1)
    return 0
