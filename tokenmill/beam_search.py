"""Beam search (`LLM.beam_search`, and `use_beam_search` in the API), with vLLM's parameters, outputs and scoring.

Each step extends every live beam by one token: all beams of all prompts go to the engine together as one batch of
max_tokens=1 requests asking for the top 2 * beam_width logprobs, and the prefix cache makes each of them cost about
one token of compute. A candidate ending in EOS (unless ignore_eos) is set aside as completed; the others compete
for the beam_width places of their prompt. At the end, completed and live beams are ranked by
cum_logprob / len(tokens) ** length_penalty (the length counts the prompt, and a final EOS does not count).
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

from tokenmill.outputs import Logprob
from tokenmill.sampling_params import BeamSearchParams, SamplingParams


@dataclass
class BeamSearchSequence:
    """One beam: all its tokens (prompt first), the logprobs of each generated position, and their sum."""
    tokens: list[int]
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None  # "stop" (EOS) or "length"
    stop_reason: int | str | None = None  # vLLM's field: None, as a beam ends on EOS or length only
    lora_request: Any = None  # vLLM's field: beam search runs without an adapter here


@dataclass
class BeamSearchOutput:
    """The best beam_width sequences of one prompt, best first."""
    sequences: list[BeamSearchSequence]


def beam_score(seq: BeamSearchSequence, eos_token_id: int | None, length_penalty: float) -> float:
    n = len(seq.tokens) - (1 if seq.tokens and seq.tokens[-1] == eos_token_id else 0)
    return seq.cum_logprob / (max(n, 1) ** length_penalty)


def check_beam_width(beam_width: int, max_logprobs: int) -> None:
    """Each step asks the engine for the top 2 * beam_width logprobs, which max_logprobs (-1: no limit) must allow."""
    if max_logprobs != -1 and 2 * beam_width > max_logprobs:
        raise ValueError(f"beam_width={beam_width} (n) needs the top {2 * beam_width} logprobs per step, but "
                         f"max_logprobs (--max-logprobs) is {max_logprobs}; lower it or raise max_logprobs.")


class BeamSearch:
    """The search over several prompts at once. Drive it with `pending()` (the beams to extend next: run each as a
    one-token request with `step_params`), then `advance()` with the top logprobs each of them got; stop when
    pending() is empty or after max_tokens rounds, then read `results()`."""

    def __init__(self, prompt_ids: list[list[int]], params: BeamSearchParams, eos_token_id: int | None,
                 max_logprobs: int) -> None:
        k = params.beam_width
        check_beam_width(k, max_logprobs)
        self.params, self.eos = params, eos_token_id
        self.prompt_lens = [len(ids) for ids in prompt_ids]
        self.live = [[BeamSearchSequence(tokens=list(ids))] for ids in prompt_ids]
        self.done: list[list[BeamSearchSequence]] = [[] for _ in prompt_ids]
        self.step_params = SamplingParams(max_tokens=1, temperature=params.temperature, logprobs=2 * k,
                                          ignore_eos=True, detokenize=False)

    def pending(self) -> list[tuple[int, BeamSearchSequence]]:
        return [(i, beam) for i, beams in enumerate(self.live) for beam in beams]

    def advance(self, pending: list[tuple[int, BeamSearchSequence]], tops: list[dict[int, Logprob]]) -> None:
        cands: list[list[BeamSearchSequence]] = [[] for _ in self.live]
        for (i, beam), top in zip(pending, tops):
            for token, lp in top.items():
                new = BeamSearchSequence(beam.tokens + [token], beam.logprobs + [top], beam.cum_logprob + lp.logprob)
                if token == self.eos and not self.params.ignore_eos:
                    new.finish_reason = "stop"
                    self.done[i].append(new)
                else:
                    cands[i].append(new)
        for i, c in enumerate(cands):
            c.sort(key=lambda s: s.cum_logprob, reverse=True)  # one length per step: the score orders alike
            self.live[i] = c[:self.params.beam_width]

    def results(self, tokenizer: Any, generated_text_only: bool = False,
                skip_special_tokens: bool = False) -> list[BeamSearchOutput]:
        """Each prompt's best beams. `text` decodes all tokens (vLLM's LLM.beam_search), or only the generated
        ones with generated_text_only (the API's completion text); a final EOS only with include_stop_str_in_output."""
        out = []
        for i in range(len(self.live)):
            for beam in self.live[i]:
                beam.finish_reason = "length"
            ranked = sorted(self.done[i] + self.live[i], reverse=True,
                            key=lambda s: beam_score(s, self.eos, self.params.length_penalty))
            best = ranked[:self.params.beam_width]
            if tokenizer is not None:
                for beam in best:
                    ids = beam.tokens[self.prompt_lens[i]:] if generated_text_only else beam.tokens
                    if beam.finish_reason == "stop" and not self.params.include_stop_str_in_output:
                        ids = ids[:-1]
                    beam.text = tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
            out.append(BeamSearchOutput(sequences=best))
        return out


def beam_search(proc: Any, generate: Callable[[list[dict], SamplingParams], list[Any]], tokenizer: Any,
                prompts: list[Any], params: BeamSearchParams) -> list[BeamSearchOutput]:
    """LLM.beam_search: all prompts searched together, one engine batch per step. `proc` is the engine's input
    processor (tokenizes the prompts; knows max_model_len, EOS and max_logprobs); `generate(prompts, params)`
    runs a batch of token-id prompts to completion and returns their RequestOutputs in order (LLM.generate)."""
    prompt_ids = [proc.tokenize_prompt(p)[1] for p in prompts]
    for ids in prompt_ids:
        if len(ids) + params.max_tokens > proc.max_model_len:
            raise ValueError(f"A prompt of {len(ids)} tokens plus max_tokens={params.max_tokens} exceeds the maximum "
                             f"model length of {proc.max_model_len} tokens; lower max_tokens.")
    search = BeamSearch(prompt_ids, params, proc.eos_token_id, proc.max_logprobs)
    for _ in range(params.max_tokens):
        pending = search.pending()
        if not pending:
            break
        outs = generate([{"prompt_token_ids": b.tokens} for _, b in pending], search.step_params)
        search.advance(pending, [o.outputs[0].logprobs[0] for o in outs])
    return search.results(tokenizer)


async def beam_search_async(generate: Callable[[list[int], SamplingParams, str], Awaitable[Any]],
                            prompt_ids: list[int], params: BeamSearchParams, eos_token_id: int | None,
                            max_logprobs: int, tokenizer: Any, request_id: str,
                            skip_special_tokens: bool = True) -> BeamSearchOutput:
    """One prompt's search for the API server: `generate(token_ids, params, sub_request_id)` returns the final
    RequestOutput of a one-token request; a step's beams run concurrently."""
    search = BeamSearch([prompt_ids], params, eos_token_id, max_logprobs)
    for step in range(params.max_tokens):
        pending = search.pending()
        if not pending:
            break
        outs = await asyncio.gather(*(generate(b.tokens, search.step_params, f"{request_id}-beam{step}-{j}")
                                      for j, (_, b) in enumerate(pending)))
        search.advance(pending, [o.outputs[0].logprobs[0] for o in outs])
    return search.results(tokenizer, generated_text_only=True, skip_special_tokens=skip_special_tokens)[0]
