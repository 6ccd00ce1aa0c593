"""The engine core's view of one request: its tokens, progress and state."""
from __future__ import annotations

import enum
from typing import TYPE_CHECKING

from tokenmill.core.messages import EngineCoreRequest, FinishReason, LogprobsLists
from tokenmill.sampling_params import SamplingParams

if TYPE_CHECKING:
    from tokenmill.core.block_hash import BlockHasher


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH_CAPPED = 4
    FINISHED_ABORTED = 5

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> FinishReason | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
                   RequestStatus.FINISHED_LENGTH_CAPPED: FinishReason.LENGTH,
                   RequestStatus.FINISHED_ABORTED: FinishReason.ABORT}


class Request:
    """A request inside the engine core.

    The single scheduling quantity is `num_computed_tokens` catching up with `num_tokens` (prompt + outputs):
    prefill, chunked prefill, decode, prefix-cache hits and recompute after preemption are all that one rule.
    `block_hashes` holds the chained hash of every full block of known tokens (kept up to date on append).
    """

    def __init__(self, request_id: str, prompt_token_ids: list[int], sampling_params: SamplingParams,
                 arrival_time: float, priority: int = 0, max_model_len: int | None = None,
                 block_hasher: BlockHasher | None = None, cache_salt: str | None = None,
                 lora_request=None) -> None:
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.sampling_params = sampling_params
        self.arrival_time = arrival_time
        self.priority = priority
        self.cache_salt = cache_salt
        self.lora_request = lora_request  # a LoRARequest or None
        self.num_prompt_tokens = len(prompt_token_ids)
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.num_computed_tokens = 0
        # Tokens being sampled by steps still in flight (async scheduling): counted as if known when deciding what
        # to schedule next, replaced by real tokens when their step's output arrives.
        self.num_output_placeholders = 0
        self.spec_token_ids: list[int] = []  # speculative decoding: drafts proposed for its next step
        self.num_cached_tokens = -1  # prefix-cache hits at first scheduling; -1 = not scheduled yet
        self.num_recomputed_tokens = 0  # cached prompt tokens computed anyway at first scheduling
        self.num_preemptions = 0
        # Prompt-logprob rows reported to the client, and rows the runner returned since the request last started
        # from its first token (a preemption restarts the count, see new_prompt_logprobs).
        self.prompt_lp_rows_sent = 0
        self.prompt_lp_rows_seen = 0
        # The core's time.monotonic() when the scheduler received it and first scheduled it (metrics).
        self.queued_ts = 0.0
        self.scheduled_ts = 0.0
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        limit = sampling_params.max_tokens
        room = (max_model_len - self.num_prompt_tokens) if max_model_len is not None else None
        if limit is None:
            limit = max(room, 1) if room is not None else 2**31
        self.max_tokens = limit
        # A length known ahead: with ignore_eos and nothing else that could stop it, the prompt and all of
        # max_tokens; with min_tokens, the prompt and those. The scheduler keeps KV blocks free for the running
        # requests' growth to it. 0 (nothing kept) when the output may end at any step, as vLLM admits everything.
        sp = sampling_params
        certain = limit if (sp.ignore_eos and not sp.stop and not sp.stop_token_ids
                            and sp.structured_outputs is None) else min(sp.min_tokens, limit)
        self.certain_len = self.num_prompt_tokens + certain if certain > 0 else 0
        self.grammar = None        # structured outputs: the matcher, once its grammar compiled
        self.grammar_future = None
        # Where the constrained part of the output starts (after a reasoning block); None = not yet known.
        self.grammar_start: int | None = 0 if sampling_params._grammar_after_token_id is None else None
        self.block_hashes: list[bytes] = []
        self._block_hasher = block_hasher
        if block_hasher is not None:
            self.block_hashes.extend(block_hasher(self))

    @classmethod
    def from_engine_core_request(cls, req: EngineCoreRequest, max_model_len: int | None,
                                 block_hasher: BlockHasher | None) -> "Request":
        return cls(req.request_id, req.prompt_token_ids, req.sampling_params, req.arrival_time, req.priority,
                   max_model_len, block_hasher, req.cache_salt, req.lora_request)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def append_output_token_ids(self, token_ids: list[int]) -> None:
        if self.grammar_start is None and self.sampling_params._grammar_after_token_id in token_ids:
            after = token_ids.index(self.sampling_params._grammar_after_token_id) + 1
            self.grammar_start = self.num_output_tokens + after
        self.output_token_ids.extend(token_ids)
        self.all_token_ids.extend(token_ids)
        hasher = self._block_hasher
        if hasher is not None and len(self.all_token_ids) // hasher.block_size > len(self.block_hashes):
            self.block_hashes.extend(hasher(self))  # a block just filled

    def new_prompt_logprobs(self, lists: LogprobsLists) -> LogprobsLists | None:
        """The rows of a prefill chunk's prompt logprobs the client has not had yet, or None. A preempted request
        is computed again from its first token (prompt logprobs never take prefix-cache hits), so the runner scores
        prompt positions already reported; reporting them again would repeat them in the output."""
        start, n = self.prompt_lp_rows_seen, len(lists.logprobs)
        self.prompt_lp_rows_seen += n
        skip = self.prompt_lp_rows_sent - start
        if skip <= 0:
            self.prompt_lp_rows_sent += n
            return lists
        if skip >= n:
            return None
        self.prompt_lp_rows_sent += n - skip
        return LogprobsLists(lists.token_ids[skip:], lists.logprobs[skip:], lists.ranks[skip:])

    def is_finished(self) -> bool:
        return self.status.is_finished

    def get_finish_reason(self) -> FinishReason | None:
        return self.status.finish_reason

    def __lt__(self, other: "Request") -> bool:  # priority queue order: priority, then arrival
        return (self.priority, self.arrival_time) < (other.priority, other.arrival_time)
