"""The front end's output side: engine-core outputs -> user-facing `RequestOutput`s.

Runs in the API-server process in serving and in-process for offline `LLM`. Per engine step it detokenizes the new
tokens of every sequence, applies stop strings (the engine core only knows token-level stops), shapes logprobs,
folds the n sequences of a request back into one output, and reports which sequences the core must abort.
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Any

from tokenmill.core.messages import EngineCoreOutput, EngineCoreRequest, FinishReason, RequestStartStats
from tokenmill.engine.detokenizer import IncrementalDetokenizer
from tokenmill.engine.logprobs import LogprobsProcessor, TokenTextCache
from tokenmill.metrics.stats import IterationStats, SeqStats
from tokenmill.outputs import CompletionOutput, PromptLogprobs, RequestMetrics, RequestOutput
from tokenmill.sampling_params import RequestOutputKind

_ABORT = str(FinishReason.ABORT)


@dataclass
class OutputProcessorResult:
    request_outputs: list[RequestOutput]  # outputs of requests without a queue (those with one got theirs there)
    reqs_to_abort: list[str]  # engine request ids that a stop string finished here; the core must abort them
    iteration_stats: IterationStats | None = None


class _Seq:
    """One engine request: one of a parent's n sequences."""

    __slots__ = ("request_id", "index", "parent", "detok", "logprobs", "finish_reason", "stop_reason",
                 "tokens_sent", "logprobs_sent", "stats")

    def __init__(self, request_id: str, index: int, parent: "_Parent", detok: IncrementalDetokenizer,
                 logprobs: LogprobsProcessor, stats: SeqStats | None):
        self.request_id = request_id
        self.index = index
        self.parent = parent
        self.detok = detok
        self.logprobs = logprobs
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.tokens_sent = 0  # token ids / logprob positions already handed out in DELTA mode
        self.logprobs_sent = 0
        self.stats = stats  # only with log_stats

    def completion(self, delta: bool) -> CompletionOutput:
        finished = self.finish_reason is not None
        text = self.detok.get_next_output_text(finished, delta)
        ids = self.detok.token_ids
        lps = self.logprobs.logprobs
        if delta:
            token_ids, self.tokens_sent = ids[self.tokens_sent:], len(ids)
            if lps is not None:
                lps, self.logprobs_sent = lps[self.logprobs_sent:], len(lps)
        else:
            # Copies: a caller may keep an earlier cumulative output while this one keeps growing.
            token_ids = list(ids)
            lps = list(lps) if lps is not None else None
        return CompletionOutput(index=self.index, text=text, token_ids=token_ids,
                                cumulative_logprob=self.logprobs.cumulative_logprob, logprobs=lps,
                                finish_reason=self.finish_reason, stop_reason=self.stop_reason)


class _Parent:
    """The user-visible request: n sequences sharing one prompt, one id, one output kind and one metrics record."""

    __slots__ = ("request_id", "prompt", "prompt_token_ids", "output_kind", "n", "seqs", "num_finished", "queue",
                 "metrics", "num_cached_tokens", "prompt_logprobs", "prompt_logprobs_sent", "lora_request")

    def __init__(self, request: EngineCoreRequest, prompt: str | None, parent_id: str, n: int, queue: Any):
        self.request_id = parent_id
        self.prompt = prompt
        self.prompt_token_ids = request.prompt_token_ids
        self.output_kind = request.sampling_params.output_kind
        self.n = n
        self.seqs: list[_Seq | None] = [None] * n
        self.num_finished = 0
        self.queue = queue
        self.metrics = RequestMetrics(arrival_time=request.arrival_time)
        self.num_cached_tokens = 0
        self.prompt_logprobs: PromptLogprobs | None = None
        self.prompt_logprobs_sent = False
        self.lora_request = request.lora_request

    @property
    def finished(self) -> bool:
        return self.num_finished >= self.n

    def make_output(self, changed: list[_Seq]) -> RequestOutput | None:
        """CUMULATIVE: every sequence so far; DELTA: what is new in the sequences that changed; FINAL_ONLY: all
        sequences once every one has finished (None before). Sequences are in index order."""
        finished = self.finished
        kind = self.output_kind
        delta = kind == RequestOutputKind.DELTA
        if kind == RequestOutputKind.FINAL_ONLY and not finished:
            return None
        seqs = sorted(changed, key=lambda s: s.index) if delta else [s for s in self.seqs if s is not None]
        outputs = [s.completion(delta) for s in seqs]
        if self.lora_request is not None:
            for out in outputs:
                out.lora_request = self.lora_request
        prompt_logprobs = self.prompt_logprobs
        if delta:
            # Prompt logprobs go out once, with the first output that has them.
            if self.prompt_logprobs_sent:
                prompt_logprobs = None
            elif prompt_logprobs is not None:
                self.prompt_logprobs_sent = True
        return RequestOutput(request_id=self.request_id, prompt=self.prompt,
                             prompt_token_ids=self.prompt_token_ids, prompt_logprobs=prompt_logprobs,
                             outputs=outputs, finished=finished, metrics=dataclasses.replace(self.metrics),
                             num_cached_tokens=self.num_cached_tokens, lora_request=self.lora_request)


class OutputProcessor:
    """Turns engine-core outputs into `RequestOutput`s, one per parent request per `process_outputs` call.

    Contract:
    - `add_request(request, prompt, parent_id, index, n, queue=None)` registers engine request
      `request.request_id` as sequence `index` (0..n-1) of user request `parent_id` (for n == 1 both ids are the
      same). With a `queue` (anything with `put_nowait`), that parent's outputs go there instead of the result.
    - `process_outputs(outputs)` consumes one step's `EngineCoreOutput`s. Outputs for unknown (aborted or already
      finished) engine requests are ignored. A sequence reports only when it got new tokens or finished.
      finish_reason is "stop" / "length" / "abort"; stop_reason is the stop string or stop token id (None for
      EOS). A stop string found here finishes the sequence ("stop"), keeps its token ids as generated, and its id
      is returned in `reqs_to_abort` unless the core had finished it in the same step.
    - `abort_requests(ids)` accepts parent or engine request ids, drops their state, returns the engine request
      ids to abort in the core; a parent with a queue gets a final output with finish_reason "abort".
    - `get_num_unfinished_requests()` counts engine requests (sequences), as vLLM does.
    """

    def __init__(self, tokenizer: Any | None, log_stats: bool = False, max_model_len: int | None = None):
        self.tokenizer = tokenizer
        self.log_stats = log_stats
        self.max_model_len = max_model_len  # the max_tokens a request without one runs with (for metrics)
        self._token_text = TokenTextCache(tokenizer) if tokenizer is not None else None
        self._parents: dict[str, _Parent] = {}
        self._seqs: dict[str, _Seq] = {}  # engine request id -> sequence, while unfinished

    # ----- bookkeeping -----
    def get_num_unfinished_requests(self) -> int:
        return len(self._seqs)

    def has_unfinished_requests(self) -> bool:
        return bool(self._seqs)

    def add_request(self, request: EngineCoreRequest, prompt: str | None, parent_id: str, index: int, n: int,
                    queue: Any = None) -> None:
        request_id = request.request_id
        if request_id in self._seqs:
            raise ValueError(f"Request id {request_id!r} is already running.")
        if not 0 <= index < n:
            raise ValueError(f"Sequence index {index} is outside 0..{n - 1} for request {parent_id!r}.")
        parent = self._parents.get(parent_id)
        if parent is None:
            parent = self._parents[parent_id] = _Parent(request, prompt, parent_id, n, queue)
        elif parent.n != n or parent.seqs[index] is not None:
            raise ValueError(f"Request {parent_id!r} already has sequence {index} or a different n.")
        elif queue is not None:
            parent.queue = queue
        params = request.sampling_params
        stats = None
        if self.log_stats:
            max_tokens = params.max_tokens
            if max_tokens is None and self.max_model_len is not None:
                max_tokens = self.max_model_len - len(request.prompt_token_ids)
            stats = SeqStats(max_tokens)
        seq = _Seq(request_id, index, parent,
                   IncrementalDetokenizer(self.tokenizer, request.prompt_token_ids, params),
                   LogprobsProcessor(params, self._token_text), stats)
        parent.seqs[index] = seq
        self._seqs[request_id] = seq

    def abort_requests(self, request_ids: str | list[str], stats: IterationStats | None = None) -> list[str]:
        """Drops the named parents (all their sequences) or sequences; returns the engine ids to abort. With
        `stats` (and log_stats) each dropped sequence is recorded there as finished with reason "abort"."""
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        to_abort: list[str] = []
        for rid in request_ids:
            parent = self._parents.get(rid)
            whole = parent is not None
            if whole:
                seqs = [s for s in parent.seqs if s is not None and s.finish_reason is None]
            else:
                seq = self._seqs.get(rid)
                if seq is None:
                    continue
                parent, seqs = seq.parent, [seq]
            if not self.log_stats:
                stats = None
            for seq in seqs:
                self._finish(seq, _ABORT, None)
                to_abort.append(seq.request_id)
                if stats is not None and seq.stats is not None:
                    stats.observe_finished(seq.stats, _ABORT, len(parent.prompt_token_ids),
                                           parent.metrics.arrival_time)
            if whole:
                parent.num_finished = parent.n  # sequences not added yet will never come
            if parent.finished:
                self._close(parent, seqs, time.time(), None, stats)
        return to_abort

    def _finish(self, seq: _Seq, reason: str, stop_reason: int | str | None) -> None:
        seq.finish_reason, seq.stop_reason = reason, stop_reason
        seq.parent.num_finished += 1
        self._seqs.pop(seq.request_id, None)

    def _close(self, parent: _Parent, changed: list[_Seq], now: float, result: list[RequestOutput] | None,
               stats: IterationStats | None) -> None:
        """Emits the parent's output for this step; forgets the parent once all its sequences finished."""
        if parent.finished:
            parent.metrics.finished_time = now
            if self._parents.get(parent.request_id) is parent:
                del self._parents[parent.request_id]
            if stats is not None:
                stats.observe_parent_finished(parent.n, [s.stats.num_generation_tokens for s in parent.seqs
                                                         if s is not None and s.stats is not None])
        out = parent.make_output(changed)
        if parent.finished:
            # Break the parent <-> sequence cycle: otherwise a finished request (its detokenizer, queue, ...) lives
            # on until a full garbage collection, which on a busy server walks thousands of such leftovers.
            for seq in parent.seqs:
                if seq is not None:
                    seq.parent = None
        if out is None:
            return
        if parent.queue is not None:
            parent.queue.put_nowait(out)
        elif result is not None:
            result.append(out)

    # ----- the per-step work -----
    def process_outputs(self, outputs: list[EngineCoreOutput], engine_timestamp: float = 0.0
                        ) -> OutputProcessorResult:
        """`engine_timestamp`: the core's time.monotonic() for these outputs (0: unknown, then this process's;
        the same clock on one host)."""
        now = time.time()
        stats = IterationStats(now, engine_timestamp or time.monotonic()) if self.log_stats else None
        request_outputs: list[RequestOutput] = []
        reqs_to_abort: list[str] = []
        changed: dict[str, tuple[_Parent, list[_Seq]]] = {}
        for eco in outputs:
            seq = self._seqs.get(eco.request_id)
            if seq is None:
                continue  # aborted, or finished by a stop string before the core heard of it
            parent = seq.parent
            new_ids = eco.new_token_ids
            if eco.new_prompt_logprobs is not None:
                seq.logprobs.update_prompt(eco.new_prompt_logprobs)
            if eco.new_logprobs is not None:
                seq.logprobs.update_sample(eco.new_logprobs)
            finish, stop_reason = eco.finish_reason, eco.stop_reason
            stop_string = seq.detok.update(new_ids, stop_terminated=finish == FinishReason.STOP,
                                           final=finish is not None)
            if stop_string is not None:
                if finish is None:
                    reqs_to_abort.append(seq.request_id)
                finish, stop_reason = FinishReason.STOP, stop_string
            if eco.num_cached_tokens > parent.num_cached_tokens:
                parent.num_cached_tokens = eco.num_cached_tokens
            if stats is not None:
                stats.observe_output(seq.stats, eco, len(new_ids), len(parent.prompt_token_ids),
                                     parent.metrics.arrival_time)
            if eco.start_stats is not None:
                _observe_start(parent.metrics, eco.start_stats, now, engine_timestamp or time.monotonic())
            if new_ids:
                metrics = parent.metrics
                if metrics.first_token_time is None:
                    metrics.first_token_time = now
                metrics.last_token_time = now
                metrics.num_generation_tokens += len(new_ids)
                if parent.prompt_logprobs is None and seq.logprobs.prompt_logprobs is not None:
                    # A sequence's first token means its prefill (and so its prompt logprobs) is complete.
                    parent.prompt_logprobs = seq.logprobs.prompt_logprobs
            if finish is not None:
                self._finish(seq, str(finish), stop_reason)
                if stats is not None:
                    stats.observe_finished(seq.stats, str(finish), len(parent.prompt_token_ids),
                                           parent.metrics.arrival_time)
            elif not new_ids:
                continue  # e.g. a prefill chunk that only carried prompt logprobs: nothing to show yet
            entry = changed.get(parent.request_id)
            if entry is None:
                changed[parent.request_id] = (parent, [seq])
            else:
                entry[1].append(seq)
        for parent, seqs in changed.values():
            self._close(parent, seqs, now, request_outputs, stats)
        return OutputProcessorResult(request_outputs, reqs_to_abort, stats)


def _observe_start(metrics: RequestMetrics, start: RequestStartStats, now: float, engine_ts: float) -> None:
    """first_scheduled_time (wall clock: the core's monotonic time moved by its offset from `now`) and
    time_in_queue, from the core's record of a sequence's start; with n > 1 the earliest sequence counts."""
    scheduled = now - (engine_ts - start.scheduled_ts)
    if metrics.first_scheduled_time is None or scheduled < metrics.first_scheduled_time:
        metrics.first_scheduled_time = scheduled
        metrics.time_in_queue = max(start.scheduled_ts - start.queued_ts, 0.0)
