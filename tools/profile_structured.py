"""What do structured-output requests cost the engine's step loop? Runs the same offline workload twice through one
engine: half the requests constrained by the bench's JSON schemas, then a replay with the same output lengths and no
constraints (ignore_eos). Prints step counts, time per step and per-phase timings for both, then a cProfile of the
host side of the constrained run. Works on CPU (use a tiny model) and on the GPU machine.

Usage: python3 tools/profile_structured.py [MODEL_DIR] [--tiny] [--n 128] [--seqs 32]
  --tiny   shrink the model to 2 layers of width 64 (keeps the vocabulary), so on CPU the host cost shows
"""
from __future__ import annotations

import argparse
import cProfile
import gc
import io
import pstats
import time

import numpy as np

from tokenmill import LLM, SamplingParams
from tokenmill.benchmarks.structured_dataset import JSON_SCHEMAS
from tokenmill.metrics.step_timing import TIMER
from tokenmill.sampling_params import RequestOutputKind
from tokenmill.structured.params import StructuredOutputsParams

ap = argparse.ArgumentParser()
ap.add_argument("model", nargs="?", default=".devcarry/smollm2-dummy")
ap.add_argument("--tiny", action="store_true")
ap.add_argument("--n", type=int, default=128)
ap.add_argument("--seqs", type=int, default=32)
ap.add_argument("--input-len", type=int, default=256)
ap.add_argument("--output-len", type=int, default=256)
args = ap.parse_args()

over = {"num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16} if args.tiny else {}
llm = LLM(args.model, load_format="dummy", max_model_len=1024, max_num_seqs=args.seqs, hf_overrides=over,
          structured_outputs_config={"disable_any_whitespace": True}, seed=0)
rng = np.random.default_rng(0)
prompts = [{"prompt_token_ids": rng.integers(100, 20000, args.input_len).tolist()} for _ in range(args.n)]


def params(constrained: bool, k: int, max_tokens: int) -> SamplingParams:
    so = StructuredOutputsParams(json=JSON_SCHEMAS[k % len(JSON_SCHEMAS)]) if constrained else None
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=not constrained, structured_outputs=so,
                          detokenize=False, output_kind=RequestOutputKind.FINAL_ONLY)


_gc = {"t0": 0.0, "time": [0.0, 0.0, 0.0], "count": [0, 0, 0]}


def _gc_callback(phase: str, info: dict) -> None:
    if phase == "start":
        _gc["t0"] = time.perf_counter()
    else:
        _gc["time"][info["generation"]] += time.perf_counter() - _gc["t0"]
        _gc["count"][info["generation"]] += 1


gc.callbacks.append(_gc_callback)


def run(sps, label: str, prof: cProfile.Profile | None = None):
    _gc["time"], _gc["count"] = [0.0, 0.0, 0.0], [0, 0, 0]
    TIMER.enabled = True
    TIMER.seconds.clear()
    TIMER.counts.clear()
    core = llm.llm_engine.engine_core
    steps = [0]
    orig = core.step

    def counted():
        steps[0] += 1
        return orig()
    core.step = counted
    t = time.perf_counter()
    if prof:
        prof.enable()
    outs = llm.generate(prompts, sps, use_tqdm=False)
    if prof:
        prof.disable()
    dt = time.perf_counter() - t
    core.step = orig
    toks = sum(len(o.outputs[0].token_ids) for o in outs)
    print(f"=== {label}: {steps[0]} steps, {dt:.2f} s, {1000 * dt / steps[0]:.3f} ms/step, {toks} output tokens")
    print(TIMER.report())
    print("  garbage collections per generation:", _gc["count"],
          "ms:", [round(1000 * x, 1) for x in _gc["time"]], "frozen objects:", gc.get_freeze_count())
    return outs


so = [i % 2 == 1 for i in range(args.n)]
constrained = [params(c, i // 2, args.output_len) for i, c in enumerate(so)]
run([params(False, 0, 8) for _ in prompts], "warm-up")
run(constrained, "warm-up constrained (compiles the grammars)")
outs = run(constrained, "constrained 50/50")
replay = [params(False, 0, max(1, len(o.outputs[0].token_ids))) for o in outs]
run(replay, "replay (same lengths, no constraints)")
# The same two runs under cProfile (slower, but alike): the per-function difference points at the extra cost.
stats = {}
for label, sps in (("constrained", constrained), ("replay", replay)):
    prof = cProfile.Profile()
    run(sps, f"{label} under cProfile", prof)
    stats[label] = pstats.Stats(prof)
    s = io.StringIO()
    stats[label].stream = s
    stats[label].sort_stats("tottime").print_stats(18)
    print(s.getvalue()[s.getvalue().find("ncalls"):][:3500])


def by_func(st: pstats.Stats) -> dict:
    return {f"{k[0].split('/')[-1]}:{k[1]}({k[2]})": (v[1], v[2], v[3]) for k, v in st.stats.items()}


c, r = by_func(stats["constrained"]), by_func(stats["replay"])
rows = sorted(((c.get(k, (0, 0, 0))[1] - r.get(k, (0, 0, 0))[1], k) for k in set(c) | set(r)), reverse=True)
print("=== where the constrained run spends more (tottime s, calls constrained/replay, cumtime s constrained)")
for d, k in rows[:30]:
    cc, rr = c.get(k, (0, 0, 0)), r.get(k, (0, 0, 0))
    print(f"  {d:+8.3f}  {cc[0]:>7}/{rr[0]:<7} cum {cc[2]:7.3f}  {k}")
rows = sorted(((c.get(k, (0, 0, 0))[2] - r.get(k, (0, 0, 0))[2], k) for k in set(c) | set(r)), reverse=True)
print("=== cumulative-time difference (s)")
for d, k in rows[:25]:
    print(f"  {d:+8.3f}  {k}")
