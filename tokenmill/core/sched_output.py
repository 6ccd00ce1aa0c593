"""Messages between the scheduler and the model runner (one step's plan and its result)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tokenmill.core.messages import LogprobsLists
from tokenmill.sampling_params import SamplingParams


@dataclass
class NewRequestData:
    """A request the runner has no state for: first scheduled, or resumed after preemption (recompute)."""
    req_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # non-empty only when resuming after preemption
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    lora_request: Any = None  # the LoRARequest it runs under, or None
    # Hybrid models with prefix caching: the recurrent-state checkpoint slot to start from (its prefix hit ends
    # where that checkpoint was saved; core/state_checkpoints.py), or None.
    state_load: int | None = None


@dataclass
class CachedRequestData:
    """Requests the runner already holds: only what changed since the last step."""
    req_ids: list[str] = field(default_factory=list)
    new_block_ids: list[list[int]] = field(default_factory=list)  # blocks appended this step
    num_computed_tokens: list[int] = field(default_factory=list)
    # Pipeline parallelism only (empty otherwise): per request, the tokens it gained since it was last scheduled.
    # Only the last stage samples, so the other stages append these to their copy of the request.
    new_token_ids: list[list[int]] = field(default_factory=list)


@dataclass
class SchedulerOutput:
    """One step's plan: which requests run, how many tokens each, and what the runner must forget."""
    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    finished_req_ids: set[str]  # finished, aborted or preempted since the last step: drop their runner state
    # Requests that sample this step and own a compiled grammar. Their bitmask is made later
    # (Scheduler.get_grammar_bitmask), once the previous step's tokens have advanced the matchers.
    grammar_req_ids: list[str] = field(default_factory=list)
    step_seq: int = 0  # the scheduler's count of this step; tells a reused request id from the one it replaced
    # Speculative decoding: request id -> the draft tokens it verifies this step (scheduled after its last token).
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
    # Speculative decoding: this step runs synchronously and its sampling proposes the next step's drafts (False:
    # a step decoded without drafts, which async scheduling may overlap).
    propose_drafts: bool = False
    # Speculation stands aside but the drafter still proposes (core/shadow_drafts.py): no drafts are
    # verified; the proposals are only scored against the tokens that follow.
    shadow_drafts: bool = False
    # Hybrid models with prefix caching: per request, (token offset within this step's tokens, checkpoint slot)
    # where its recurrent state is to be saved after that many of its tokens.
    state_saves: dict[str, list[tuple[int, int]]] = field(default_factory=dict)

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0


@dataclass
class GrammarOutput:
    """Allowed-token bitmask rows for the constrained requests sampling this step (one row per id, in order)."""
    req_ids: list[str]
    bitmask: Any  # CPU int32 tensor [len(req_ids), ceil(vocab / 32)]


@dataclass
class ModelRunnerOutput:
    """The result of one step.

    sampled_token_ids[i] belongs to req_ids[i]: the tokens it sampled this step, in order (one per step today; k + 1
    when k draft tokens are verified), empty for a request whose prefill chunk did not reach the end of its known
    tokens. logprobs has one row per sampled token, request after request in req_ids order (the rows of request i
    are rows sum(len(t) for t in sampled_token_ids[:i]) onwards); rows of requests that did not ask are ignored.
    prompt_logprobs holds, per request that asked, the chunk computed this step. pooler_output[i] (a pooling model
    only, else None) is request i's pooled hidden state once its prompt is done, else None.
    """
    req_ids: list[str]
    sampled_token_ids: list[list[int]]
    logprobs: LogprobsLists | None = None
    prompt_logprobs: dict[str, LogprobsLists] = field(default_factory=dict)
    pooler_output: list[Any] | None = None
    # Speculative decoding: per request (req_ids order) the drafts proposed for its next step, or None.
    spec_token_ids: list[list[int]] | None = None


EMPTY_MODEL_RUNNER_OUTPUT = ModelRunnerOutput(req_ids=[], sampled_token_ids=[])
