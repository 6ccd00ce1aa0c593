"""Beam search for the offline API (`LLM.beam_search`), with vLLM's parameters, outputs and scoring.

Each step extends every live beam by one token: all beams of all prompts go to the engine together as one batch of
max_tokens=1 requests asking for the top 2 * beam_width logprobs, and the prefix cache makes each of them cost about
one token of compute. A candidate ending in EOS (unless ignore_eos) is set aside as completed; the others compete
for the beam_width places of their prompt. At the end, completed and live beams are ranked by
cum_logprob / len(tokens) ** length_penalty (the length counts the prompt, and a final EOS does not count).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tokenmill.outputs import Logprob
from tokenmill.sampling_params import BeamSearchParams, SamplingParams

if TYPE_CHECKING:
    from tokenmill.entrypoints.llm import LLM


@dataclass
class BeamSearchSequence:
    """One beam: all its tokens (prompt first), the logprobs of each generated position, and their sum."""
    tokens: list[int]
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None  # "stop" (EOS) or "length"


@dataclass
class BeamSearchOutput:
    """The best beam_width sequences of one prompt, best first."""
    sequences: list[BeamSearchSequence]


def beam_score(seq: BeamSearchSequence, eos_token_id: int | None, length_penalty: float) -> float:
    n = len(seq.tokens) - (1 if seq.tokens and seq.tokens[-1] == eos_token_id else 0)
    return seq.cum_logprob / (max(n, 1) ** length_penalty)


def beam_search(llm: "LLM", prompts: list[Any], params: BeamSearchParams,
                use_tqdm: bool = False) -> list[BeamSearchOutput]:
    engine = llm.llm_engine
    tok = llm.get_tokenizer()
    eos = engine.processor.eos_token_id
    k = params.beam_width
    limit = engine.processor.max_logprobs
    if limit != -1 and 2 * k > limit:
        raise ValueError(f"beam_width={k} needs the top {2 * k} logprobs per step, but max_logprobs is {limit}; "
                         "lower beam_width or raise max_logprobs.")
    step_params = SamplingParams(max_tokens=1, temperature=params.temperature, logprobs=2 * k, ignore_eos=True,
                                 detokenize=False)
    live: list[list[BeamSearchSequence]] = []
    done: list[list[BeamSearchSequence]] = [[] for _ in prompts]
    for p in prompts:
        _, ids = engine.processor.tokenize_prompt(p)
        live.append([BeamSearchSequence(tokens=list(ids))])
    for _ in range(params.max_tokens):
        batch = [(i, beam) for i, beams in enumerate(live) for beam in beams]
        if not batch:
            break
        outs = llm.generate([{"prompt_token_ids": b.tokens} for _, b in batch], step_params, use_tqdm=use_tqdm)
        cands: list[list[BeamSearchSequence]] = [[] for _ in prompts]
        for (i, beam), out in zip(batch, outs):
            top = out.outputs[0].logprobs[0]
            for token, lp in top.items():
                new = BeamSearchSequence(beam.tokens + [token], beam.logprobs + [top], beam.cum_logprob + lp.logprob)
                if token == eos and not params.ignore_eos:
                    new.finish_reason = "stop"
                    done[i].append(new)
                else:
                    cands[i].append(new)
        for i, c in enumerate(cands):
            c.sort(key=lambda s: s.cum_logprob, reverse=True)  # one length per step: the score orders alike
            live[i] = c[:k]
    results = []
    for i in range(len(prompts)):
        for beam in live[i]:
            beam.finish_reason = "length"
        ranked = sorted(done[i] + live[i], key=lambda s: beam_score(s, eos, params.length_penalty), reverse=True)
        best = ranked[:k]
        if tok is not None:
            for beam in best:
                ids = beam.tokens
                if beam.finish_reason == "stop" and not params.include_stop_str_in_output:
                    ids = ids[:-1]
                beam.text = tok.decode(ids)
        results.append(BeamSearchOutput(sequences=best))
    return results
