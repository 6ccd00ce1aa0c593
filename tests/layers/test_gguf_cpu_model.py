"""The embedded default model (SmolLM2-135M-Instruct, Q4_1 GGUF) with its blocks kept quantized, against the same
file loaded dense in float32 (the oracle): `LLM()` with no arguments picks the quantized path on the CPU."""
from __future__ import annotations

import pytest

from tokenmill import LLM, SamplingParams

pytest.importorskip("gguf")

_TEXT = ("The history of the Roman Empire spans many centuries. It began when Augustus became the first emperor in "
         "27 BC, and the western half fell in 476 AD. Roman law, engineering and language spread across Europe.\n"
         "def add(a, b):\n    return a + b\n")
_PROMPTS = ["The three primary colors are", "def fibonacci(n):", "Once upon a time, in a small village,"]


@pytest.fixture(scope="session")
def quantized_and_dense(smollm2_gguf):
    quantized = LLM(max_model_len=256)  # no dtype: the default path
    dense = LLM(max_model_len=256, dtype="float32")
    yield quantized, dense
    del quantized, dense


def _layer_kinds(llm) -> set[str]:
    model = llm.llm_engine.engine_core.executor.worker.runner.model
    return {type(m.quant_method).__name__ for m in model.modules() if hasattr(m, "quant_method")}


def _teacher_forced(llm) -> list[float]:
    out = llm.generate([_TEXT], SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
    ids = out.prompt_token_ids
    return [d[ids[i]].logprob for i, d in enumerate(out.prompt_logprobs) if d is not None]


def test_default_keeps_the_4bit_blocks_quantized_and_float32_loads_dense(quantized_and_dense):
    quantized, dense = quantized_and_dense
    assert _layer_kinds(quantized) == {"GGUFInt4LinearMethod"}
    assert _layer_kinds(dense) == {"UnquantizedLinearMethod"}


def test_teacher_forced_logprobs_stay_close_to_the_dense_path(quantized_and_dense):
    quantized, dense = quantized_and_dense
    q, d = _teacher_forced(quantized), _teacher_forced(dense)
    assert len(q) == len(d) > 50
    diffs = [abs(a - b) for a, b in zip(q, d)]
    # bf16 rounding of the int4 kernel's inputs, outputs and scales is the whole difference, plus, for the prompt's
    # rows (12 or more run on the bf16 copy of those weights), the weights' own bf16 rounding: measured mean 0.0164
    # (0.0164 without the copy), max 0.10 (0.07) over this text on an AVX2 host (fp32 copy); 0.0177 / 0.086 on an AMX
    # host (bf16 copy)
    assert sum(diffs) / len(diffs) <= 2e-2, diffs
    assert max(diffs) <= 0.15, diffs


def test_greedy_tokens_match_the_dense_path_up_to_near_ties(quantized_and_dense):
    quantized, dense = quantized_and_dense
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    for p, q_out in zip(_PROMPTS, quantized.generate(_PROMPTS, sp, use_tqdm=False)):
        q_ids = q_out.outputs[0].token_ids
        d_out = dense.generate([p], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=5),
                               use_tqdm=False)[0].outputs[0]
        n = next((i for i, (a, b) in enumerate(zip(q_ids, d_out.token_ids)) if a != b), None)
        if n is None:
            continue
        # where they part, the dense model itself ranks the quantized path's token within a hair of its own
        top = d_out.logprobs[n]
        assert q_ids[n] in top, (p, n)
        gap = top[d_out.token_ids[n]].logprob - top[q_ids[n]].logprob
        assert gap <= 0.15, (p, n, gap)


def test_the_lm_head_takes_its_fp16_copies_at_a_few_rows_only(quantized_and_dense):
    """FBGEMM's fp16-weight linear for the rows it takes in one pass (fp32 activations and logits: within fp16's
    rounding of the weight), a plain fp16 product beyond them where the CPU has fp16 arithmetic, fp32 past
    HALF_HEAD_MAX_ROWS. Where this CPU lacks a form, a duplicate of the head is given both and checked the same."""
    import copy

    import torch

    from tokenmill.kernels.cpu_features import fast_fp16_matmul, fbgemm_fp16_rows
    from tokenmill.layers.quantization.gguf_cpu import HALF_HEAD_MAX_ROWS
    quantized, dense = quantized_and_dense
    head = quantized.llm_engine.engine_core.executor.worker.runner.model.lm_head
    oracle = dense.llm_engine.engine_core.executor.worker.runner.model.lm_head
    assert oracle._packed is None and oracle._half is None  # the oracle stays fp32
    packed = fbgemm_fp16_rows()
    assert head._packed_rows == packed and (head._packed is not None) == (packed > 0)
    assert (head._half is not None) == fast_fp16_matmul()
    if packed == 0 and "fbgemm" not in torch.backends.quantized.supported_engines:
        pytest.skip("this torch build has no FBGEMM")
    if packed == 0 or not fast_fp16_matmul():
        head = copy.deepcopy(head)
        head.enable_fp16_copies(packed_rows=packed or 6, half_rows=HALF_HEAD_MAX_ROWS)
    h = torch.randn(HALF_HEAD_MAX_ROWS + 8, head.embedding_dim, generator=torch.Generator().manual_seed(0))
    exact = torch.nn.functional.linear(h, head.weight)
    w16 = head.weight.half().float()
    scale = exact.abs().max().item()
    for rows in (1, head._packed_rows):       # FBGEMM: the fp16 weight's product in fp32, to fp32 rounding
        got = head.compute_logits(h[:rows])
        assert got.dtype == torch.float32 and got.shape == (rows, head.num_embeddings)
        assert not torch.equal(got, exact[:rows])
        torch.testing.assert_close(got, torch.nn.functional.linear(h[:rows], w16), rtol=0, atol=1e-5 * scale)
    for rows in (head._packed_rows + 1, HALF_HEAD_MAX_ROWS):   # fp16 activations and logits too
        got = head.compute_logits(h[:rows])
        assert got.dtype == torch.float32 and got.is_contiguous() and not torch.equal(got, exact[:rows])
        assert (got - exact[:rows]).abs().max().item() <= 2e-3 * scale
    torch.testing.assert_close(head.compute_logits(h), exact, rtol=1e-6, atol=1e-5)  # fp32 past them


def test_a_bf16_kv_cache_on_request_stays_close_and_hits_equal_misses(quantized_and_dense):
    """--kv-cache-dtype bfloat16 under the default path's fp32 activations: decode attends in bf16 (the fused CPU
    decode path); a prompt read back from the prefix cache gives the tokens its first run gave."""
    import torch
    quantized, _ = quantized_and_dense
    bf16 = LLM(max_model_len=256, kv_cache_dtype="bfloat16")
    assert bf16.llm_engine.engine_core.executor.worker.runner.kv_caches[0].dtype == torch.bfloat16
    prompts = [_TEXT + p for p in _PROMPTS]      # whole blocks to hit on the second run
    sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=0)
    first, again = (bf16.generate(prompts, sp, use_tqdm=False) for _ in range(2))
    assert [o.outputs[0].token_ids for o in first] == [o.outputs[0].token_ids for o in again]
    want = quantized.generate(prompts, sp, use_tqdm=False)
    diffs = []
    for g, w in zip(first, want):
        g, w = g.outputs[0], w.outputs[0]
        n = next((i for i, (a, b) in enumerate(zip(g.token_ids, w.token_ids)) if a != b), len(g.token_ids))
        diffs += [abs(g.logprobs[i][t].logprob - w.logprobs[i][t].logprob) for i, t in enumerate(g.token_ids[:n])]
    # measured on these prompts against the fp32 cache: mean 0.011, max 0.054 over 37 tokens (AMX host)
    assert len(diffs) >= 16 and sum(diffs) / len(diffs) <= 2e-2 and max(diffs) <= 0.15, diffs
