"""The scheduler: one token budget per step, running requests first, then waiting ones."""
from __future__ import annotations

import time

from tokenmill.config import TokenmillConfig
from tokenmill.core.block_hash import BlockHasher
from tokenmill.core.kv_cache_manager import cdiv
from tokenmill.core.messages import (EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest, FinishReason,
                                     LogprobsLists, RequestStartStats, SchedulerStats, SpecDecodingStats)
from tokenmill.core.request import Request, RequestStatus
from tokenmill.core.request_queue import make_queue
from tokenmill.core.sched_output import (CachedRequestData, GrammarOutput, ModelRunnerOutput, NewRequestData,
                                         SchedulerOutput)
from tokenmill.core.shadow_drafts import ShadowDrafts


def _long_rope_prompt_len(config: TokenmillConfig) -> int | None:
    """LongRoPE and dynamic-NTK models read a second RoPE table for prompts longer than this (layers/rotary.py): their cached
    blocks are not interchangeable with shorter prompts' ones."""
    hf_config = getattr(config.model_config, "hf_config", None)
    if hf_config is None:
        return None
    from tokenmill.transformers_utils.config import longrope_switch
    return longrope_switch(hf_config, config.model_config.max_model_len)


class Scheduler:
    """Decides, each step, how many tokens of which requests to compute.

    Every request has `num_computed_tokens` catching up with `num_tokens`; a step gives each scheduled request a
    share of `max_num_batched_tokens`. Running requests go first (in order); when blocks run out the lowest-ranked
    running request is preempted (its blocks freed, recomputed later). Waiting requests are admitted while budget,
    `max_num_seqs` and blocks allow; a prompt that does not fit the budget is chunked across steps. Requests whose
    length is known ahead (ignore_eos without a stop condition, or min_tokens) keep blocks free for that growth: one
    joins only while the free blocks cover its own and the running ones' certain growth, so a `max_num_seqs` above
    what the pool holds does not turn into preemptions and recomputation.

    Under pipeline parallelism (pp > 1) several batches are in flight at once, so a batch is built from the
    requests that are not waiting for a sample: one whose sampled token is in flight is not scheduled again until
    its output arrives (no placeholders), is never a preemption victim (its output would come back for a request
    that restarted), and each batch takes at most ceil(unfinished requests / pp) requests so the load spreads over
    the micro-batches. Cached requests carry the tokens they gained since they last ran (`new_token_ids`), for
    the stages that do not sample.
    """

    def __init__(self, config: TokenmillConfig, num_blocks: int) -> None:
        sc, cc = config.scheduler_config, config.cache_config
        self.max_num_batched_tokens: int = sc.max_num_batched_tokens
        self.max_num_seqs: int = sc.max_num_seqs
        self.chunked_prefill: bool = sc.enable_chunked_prefill
        self.long_prefill_threshold = sc.long_prefill_token_threshold
        self.policy = sc.scheduling_policy
        self.max_model_len = config.model_config.max_model_len
        self.block_size = cc.block_size
        self.pp_size = config.parallel_config.pipeline_parallel_size
        self._runner_num_tokens: dict[str, int] = {}  # pp > 1: tokens the runners know, per request
        # One manager, or one per layer group (full attention beside sliding windows): core/kv_cache_groups.py.
        from tokenmill.core.kv_cache_groups import make_kv_cache_manager
        self.kv = make_kv_cache_manager(config, num_blocks)
        self.block_hasher = BlockHasher(cc.block_size, cc.prefix_caching_hash_algo, _long_rope_prompt_len(config)) \
            if cc.enable_prefix_caching else None
        self.requests: dict[str, Request] = {}
        self.waiting = make_queue(self.policy)
        self.running: list[Request] = []
        self._finished_since_last_step: set[str] = set()
        self._num_preemptions = 0
        self._num_batched_tokens = 0  # scheduled since the last stats snapshot
        self._num_deferred = 0        # waiting requests the last schedule() held back for their grammar
        self._step_seq = 0
        # request id -> the last step scheduled when it was freed: that step's (and earlier steps') outputs for
        # the id belong to the freed request, not to a new one that reuses the id. Pruned as steps complete.
        self._freed_at: dict[str, int] = {}
        self._rejected: list[EngineCoreOutput] = []  # requests that failed before running (e.g. bad grammar)
        from tokenmill.structured.manager import StructuredOutputManager
        self.structured = StructuredOutputManager(config)
        # LoRA: the adapters of the running requests never outnumber the runner's slots (a step runs a subset).
        lora = getattr(config, "lora_config", None)  # absent from tests' minimal configs
        self.max_loras = lora.max_loras if lora is not None else None
        spec = getattr(config, "speculative_config", None)  # absent from tests' minimal configs
        # Whether the steps scheduled now verify drafts and propose the next ones: the engine core's speculation
        # gate (spec_decode/step_aside.py) turns it off while decoding without drafts is faster and above
        # disable_by_batch_size running requests.
        self.drafting = spec is not None
        # Speculation stands aside, yet the next steps propose drafts that are scored, not verified.
        self.shadowing = False
        self.shadow = ShadowDrafts()
        self.spec_stats = SpecDecodingStats.new(spec.num_speculative_tokens) if spec is not None else None
        # A draft model writes KV for its k drafts past the verified tokens before the target computes them: each
        # allocation reserves k slots beyond the step's tokens (up to max_model_len).
        self.num_lookahead = spec.num_speculative_tokens if spec is not None and spec.uses_draft_model else 0
        # Hybrid models with prefix caching: recurrent-state checkpoints at block boundaries, one slot per
        # sequence the engine may run (core/state_checkpoints.py); a prefix hit ends at a saved one.
        from tokenmill.core.state_checkpoints import StateCheckpoints, num_checkpoint_slots
        slots = num_checkpoint_slots(config)
        self.state_ckpts = StateCheckpoints(slots, cc.block_size) if slots else None

    # ----- admission -----
    def check_request(self, prompt_len: int) -> None:
        """Raise ValueError if a prompt could never be scheduled."""
        if prompt_len > self.max_model_len:
            raise ValueError(f"The prompt is {prompt_len} tokens long, more than max_model_len "
                             f"({self.max_model_len}).")
        need = self.kv.max_blocks_per_request(prompt_len, self.max_num_batched_tokens)
        if need > self.kv.num_blocks:
            raise ValueError(f"The prompt needs {need} KV blocks but the cache has "
                             f"only {self.kv.num_blocks}; give the KV cache more memory.")

    def add_request(self, req: EngineCoreRequest) -> None:
        if req.request_id in self.requests:
            raise ValueError(f"Request id {req.request_id!r} is already running.")
        self.check_request(len(req.prompt_token_ids))
        request = Request.from_engine_core_request(req, self.max_model_len, self.block_hasher)
        request.queued_ts = time.monotonic()
        if req.sampling_params.structured_outputs is not None:
            self.structured.submit(request)  # compiles in a worker thread; scheduled once ready
        self.requests[request.request_id] = request
        self.waiting.add(request)

    def finish_requests(self, request_ids, status: RequestStatus = RequestStatus.FINISHED_ABORTED) -> None:
        """Finish (by default abort) requests wherever they are; unknown or finished ids are ignored."""
        for rid in request_ids:
            request = self.requests.get(rid)
            if request is None or request.is_finished():
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            else:
                self.waiting.remove(request)
            request.status = status
            self._free(request)

    def _free(self, request: Request) -> None:
        self._freed_at[request.request_id] = self._step_seq
        self.shadow.forget(request.request_id)
        self.kv.free(request)
        self._runner_num_tokens.pop(request.request_id, None)
        self._finished_since_last_step.add(request.request_id)
        del self.requests[request.request_id]

    # ----- one step -----
    def schedule(self) -> SchedulerOutput:
        budget = self.max_num_batched_tokens
        new_reqs: list[NewRequestData] = []
        cached = CachedRequestData()
        num_scheduled: dict[str, int] = {}
        spec_tokens: dict[str, list[int]] = {}
        preempted_any = False
        pp = self.pp_size > 1
        max_reqs = cdiv(len(self.requests), self.pp_size) if pp else self.max_num_seqs
        ckpts = self.state_ckpts
        if ckpts is not None:
            ckpts.begin_step()

        i = 0
        while i < len(self.running) and budget > 0 and len(num_scheduled) < max_reqs:
            req = self.running[i]
            n = self._num_tokens_to_schedule(req, req.num_computed_tokens, budget)
            if n <= 0:
                i += 1
                continue
            drafts = self._drafts_to_schedule(req, n, budget) if req.spec_token_ids else None
            if drafts:
                n += len(drafts)
            ahead = self._lookahead(req.num_computed_tokens + n)
            new_block_ids = self.kv.allocate_slots(req, n, num_lookahead_tokens=ahead)
            while new_block_ids is None:
                victim = self._pick_victim()
                self._preempt(victim)
                preempted_any = True
                if victim is req:
                    break
                new_block_ids = self.kv.allocate_slots(req, n, num_lookahead_tokens=ahead)
            if new_block_ids is None:
                break  # `req` itself was preempted; it sat at the end, so nothing after it remains
            cached.req_ids.append(req.request_id)
            cached.new_block_ids.append(new_block_ids)
            cached.num_computed_tokens.append(req.num_computed_tokens)
            if pp:
                known = self._runner_num_tokens[req.request_id]
                cached.new_token_ids.append(req.all_token_ids[known:])
                self._runner_num_tokens[req.request_id] = req.num_tokens
            num_scheduled[req.request_id] = n
            if drafts:
                spec_tokens[req.request_id] = drafts
            budget -= n
            i += 1

        deferred: list[Request] = []  # waiting for their grammar to compile, or for an adapter slot
        growth = None  # blocks the running requests will certainly still take; computed if a request may join
        loras = {r.lora_request.lora_int_id for r in self.running if r.lora_request is not None} \
            if self.max_loras is not None else set()
        while (not preempted_any and len(self.waiting) and budget > 0
               and len(self.running) < self.max_num_seqs and len(num_scheduled) < max_reqs):
            req = self.waiting.peek()
            if req.grammar_future is not None:
                ready = self._grammar_ready(req)
                if ready is None:
                    continue  # its grammar failed: the request was finished with the error
                if not ready:
                    deferred.append(self.waiting.pop())
                    continue
            lora = req.lora_request
            if lora is not None and self.max_loras is not None and lora.lora_int_id not in loras \
                    and len(loras) >= self.max_loras:
                deferred.append(self.waiting.pop())  # every slot holds another running request's adapter
                continue
            # A hybrid model's hit ends where a recurrent-state checkpoint was saved; the request starts from it.
            hits, num_hit = self.kv.get_computed_blocks(req, None if ckpts is None else
                                                        ckpts.ends_hit(req.block_hashes))
            state_load = ckpts.ready(req.block_hashes[num_hit // self.block_size - 1]) \
                if ckpts is not None and num_hit else None
            n = self._num_tokens_to_schedule(req, num_hit, budget)
            if n <= 0:
                break
            if not self.chunked_prefill and num_hit + n < req.num_tokens:
                break  # the whole prompt must fit in one step
            if self.running:
                if growth is None:
                    growth = sum(self._certain_growth(r, r.num_computed_tokens) for r in self.running)
                own = self._certain_growth(req, num_hit)
                if own + growth > self.kv.num_free_blocks():
                    # Admitting it would preempt a running request later, and recomputing that one costs more
                    # than waiting for blocks to come free.
                    break
                growth += own
            new_block_ids = self.kv.allocate_slots(req, n, hits, num_lookahead_tokens=self._lookahead(num_hit + n))
            if new_block_ids is None:
                break
            self.waiting.pop()
            req.status = RequestStatus.RUNNING
            req.num_computed_tokens = num_hit
            if req.num_cached_tokens < 0:  # first scheduled (not a preempted request resuming)
                req.num_cached_tokens = num_hit
                req.num_recomputed_tokens = self.kv.num_recomputed_tokens(req, num_hit)
                req.scheduled_ts = time.monotonic()
            self.running.append(req)
            if lora is not None:
                loras.add(lora.lora_int_id)
            if pp:
                self._runner_num_tokens[req.request_id] = req.num_tokens
            new_reqs.append(NewRequestData(
                req_id=req.request_id, prompt_token_ids=req.prompt_token_ids,
                output_token_ids=list(req.output_token_ids), sampling_params=req.sampling_params,
                block_ids=new_block_ids, num_computed_tokens=num_hit, lora_request=req.lora_request,
                state_load=state_load))
            num_scheduled[req.request_id] = n
            budget -= n

        for r in reversed(deferred):
            self.waiting.prepend(r)
        self._num_deferred = len(deferred)
        grammar_req_ids = []
        state_saves: dict[str, list[tuple[int, int]]] = {}
        for rid, n in num_scheduled.items():
            r = self.requests[rid]
            if ckpts is not None:
                saves = [(p - r.num_computed_tokens, slot) for p in ckpts.boundaries(
                    r.num_computed_tokens, r.num_computed_tokens + n, r.num_prompt_tokens, len(r.block_hashes))
                    if (slot := ckpts.reserve(r.block_hashes[p // self.block_size - 1])) is not None]
                if saves:
                    state_saves[rid] = saves
            r.num_computed_tokens += n
            if r.num_computed_tokens >= r.num_tokens + r.num_output_placeholders:
                r.num_output_placeholders += 1  # it samples this step
                if r.grammar is not None:
                    grammar_req_ids.append(rid)
        finished = self._finished_since_last_step
        self._finished_since_last_step = set()
        self._step_seq += 1
        self._num_batched_tokens += self.max_num_batched_tokens - budget
        return SchedulerOutput(scheduled_new_reqs=new_reqs, scheduled_cached_reqs=cached, step_seq=self._step_seq,
                               num_scheduled_tokens=num_scheduled,
                               total_num_scheduled_tokens=self.max_num_batched_tokens - budget,
                               finished_req_ids=finished, grammar_req_ids=grammar_req_ids,
                               scheduled_spec_decode_tokens=spec_tokens, state_saves=state_saves,
                               propose_drafts=self.drafting or self.shadowing,
                               shadow_drafts=self.shadowing and not self.drafting)

    def _lookahead(self, end: int) -> int:
        """KV slots to reserve past a step that ends at position `end` (a draft model's drafts)."""
        return min(self.num_lookahead, self.max_model_len - end) if self.num_lookahead else 0

    def _drafts_to_schedule(self, req: Request, n: int, budget: int) -> list[int]:
        """The drafts a decoding request verifies this step (its proposals, cut to the budget, the context length
        and max_tokens), consumed from the request; none while drafting is off."""
        drafts, req.spec_token_ids = req.spec_token_ids, []
        if not self.drafting or n != 1 or req.num_output_placeholders:
            return []
        room = min(budget - 1, self.max_model_len - req.num_tokens, req.max_tokens - req.num_output_tokens - 1)
        return drafts[:max(room, 0)]

    def get_grammar_bitmask(self, sched: SchedulerOutput) -> GrammarOutput | None:
        """Bitmask rows for the constrained requests that sample in `sched`.

        Called after the previous step's output has been applied (its tokens advanced the matchers), which with
        async scheduling is after `sched` was made. Requests that finished meanwhile, or whose grammar is not active
        yet (still reasoning), get no row.
        """
        reqs = [r for r in map(self.requests.get, sched.grammar_req_ids)
                if r is not None and r.status == RequestStatus.RUNNING and r.grammar_start is not None]
        if not reqs:
            return None
        return GrammarOutput([r.request_id for r in reqs], self.structured.fill_bitmask(reqs))

    def _grammar_ready(self, req: Request) -> bool | None:
        """Whether a constrained request's grammar compiled; None when it failed (the request is then finished
        with the error as its stop reason)."""
        try:
            return self.structured.ready(req)
        except ValueError as e:
            self.waiting.remove(req)
            req.status = RequestStatus.FINISHED_ABORTED
            self._free(req)
            self._rejected.append(EngineCoreOutput(req.request_id, [], finish_reason=FinishReason.ABORT,
                                                   stop_reason=str(e)))
            return None

    def _num_tokens_to_schedule(self, req: Request, num_computed: int, budget: int) -> int:
        ph = req.num_output_placeholders
        if ph and self.pp_size > 1:
            return 0  # its sample is in flight: schedule it again once the token is known
        if ph and (req.num_output_tokens + ph >= req.max_tokens or req.num_tokens + ph >= self.max_model_len):
            return 0  # the tokens in flight already end it
        n = req.num_tokens + ph - num_computed
        if 0 < self.long_prefill_threshold < n:
            n = self.long_prefill_threshold
        return min(n, budget, self.max_model_len - num_computed)

    def _certain_growth(self, req: Request, num_computed: int) -> int:
        """Blocks `req` will certainly still allocate beyond those for its first num_computed tokens: up to its
        min_tokens, or with ignore_eos and no stop condition its max_tokens (Request.certain_len); 0 for a request
        whose output may end at any step."""
        if not req.certain_len:
            return 0
        end = min(max(req.certain_len, req.num_tokens), self.max_model_len)
        if end <= num_computed:
            return 0
        step = self.max_num_batched_tokens
        return self.kv.max_blocks_per_request(end, step) - self.kv.max_blocks_per_request(num_computed, step)

    def _pick_victim(self) -> Request:
        # Under pp, never a request whose sample is in flight; the one being scheduled always qualifies.
        cands = self.running if self.pp_size == 1 else [r for r in self.running if not r.num_output_placeholders]
        if self.policy == "priority":
            return max(cands, key=lambda r: (r.priority, r.arrival_time))
        return cands[-1]

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.kv.free(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_output_placeholders = 0  # a token in flight is dropped; recompute samples it again
        req.spec_token_ids = []
        self.shadow.forget(req.request_id)
        req.num_preemptions += 1
        req.prompt_lp_rows_seen = 0
        self._num_preemptions += 1
        self._finished_since_last_step.add(req.request_id)  # the runner drops its state; resumed as new
        self.waiting.prepend(req)

    # ----- results -----
    def update_from_output(self, sched: SchedulerOutput, out: ModelRunnerOutput) -> EngineCoreOutputs:
        """Apply one step's sampled tokens. A request may receive several tokens at once (k + 1 when k draft tokens
        were verified): they are taken one at a time with the stop conditions checked after each, so the output
        ends exactly where one-token steps would end it, and tokens past a stop are dropped."""
        outputs, self._rejected = self._rejected, []
        seq, freed_at = sched.step_seq, self._freed_at
        if freed_at:  # later steps are all newer than `seq`: older entries cannot matter any more
            self._freed_at = freed_at = {r: s for r, s in freed_at.items() if s >= seq}
        lp_row = 0  # logprobs rows follow the sampled tokens, request after request
        drafted = sched.scheduled_spec_decode_tokens
        next_drafts = dict(zip(out.req_ids, out.spec_token_ids)) if out.spec_token_ids is not None else None
        for rid, token_ids in zip(out.req_ids, out.sampled_token_ids):
            first_row, lp_row = lp_row, lp_row + len(token_ids)
            req = self.requests.get(rid)
            if req is None or req.status != RequestStatus.RUNNING or freed_at.get(rid, -1) >= seq:
                continue  # aborted or preempted while the step ran, or the id now names a newer request
            prompt_lp = out.prompt_logprobs.get(rid)
            if prompt_lp is not None:
                prompt_lp = req.new_prompt_logprobs(prompt_lp)
            if token_ids and req.num_output_placeholders:
                req.num_output_placeholders -= 1
            if not token_ids:
                if prompt_lp is not None:
                    outputs.append(EngineCoreOutput(rid, [], new_prompt_logprobs=prompt_lp))
                continue
            drafts = drafted.get(rid)
            if drafts:  # the KV slots of the rejected drafts are computed again, with the right tokens, next step
                accepted = len(token_ids) - 1
                req.num_computed_tokens -= len(drafts) - accepted
                self.spec_stats.observe(len(drafts), accepted)
            token_ids, stopped = self._append_until_stop(req, token_ids)
            if next_drafts is not None and not stopped:
                req.spec_token_ids = next_drafts.get(rid) or []
                if sched.shadow_drafts:
                    self.shadow.step(rid, token_ids, req.spec_token_ids)
            new_lp = None
            if out.logprobs is not None and req.sampling_params.logprobs is not None:
                rows = slice(first_row, first_row + len(token_ids))
                lp = out.logprobs
                new_lp = LogprobsLists(lp.token_ids[rows], lp.logprobs[rows], lp.ranks[rows])
            start = None
            if req.num_output_tokens == len(token_ids):  # its first tokens: say how it started, once
                start = RequestStartStats(req.queued_ts, req.scheduled_ts, req.num_recomputed_tokens)
            outputs.append(EngineCoreOutput(
                rid, token_ids, new_logprobs=new_lp, new_prompt_logprobs=prompt_lp,
                finish_reason=req.get_finish_reason() if stopped else None, stop_reason=req.stop_reason,
                num_cached_tokens=max(req.num_cached_tokens, 0), start_stats=start))
            if stopped:
                self.running.remove(req)
                self._free(req)
        return EngineCoreOutputs(outputs=outputs)

    def _append_until_stop(self, req: Request, token_ids: list[int]) -> tuple[list[int], bool]:
        """Append a step's tokens to `req` up to and including the first that stops it (the grammar, when one is
        active, accepts each kept token); returns (the tokens kept, whether it stopped)."""
        if len(token_ids) == 1:
            active = req.grammar is not None and req.grammar_start is not None
            req.append_output_token_ids(token_ids)
            if active:
                self.structured.accept(req, token_ids)  # (tokens up to a reasoning end are not constrained)
            return token_ids, self._check_stop(req)
        for k in range(len(token_ids)):
            one = token_ids[k:k + 1]
            active = req.grammar is not None and req.grammar_start is not None
            req.append_output_token_ids(one)
            if active:
                self.structured.accept(req, one)
            if self._check_stop(req):
                return token_ids[:k + 1], True
        return token_ids, False

    def _check_stop(self, req: Request) -> bool:
        params = req.sampling_params
        last = req.output_token_ids[-1]
        if req.grammar is not None and req.grammar.is_terminated():
            req.status = RequestStatus.FINISHED_STOPPED  # the grammar completed and took its stop token
            req.stop_reason = None if last == params._eos_token_id else last
            return True
        if req.num_output_tokens >= params.min_tokens:
            if last in params.stopping_token_ids:
                req.status = RequestStatus.FINISHED_STOPPED
                # vLLM checks EOS first: it stops with stop_reason None even when stop_token_ids names it too
                # (unless ignore_eos, when only stop_token_ids can stop on it).
                req.stop_reason = None if last == params._eos_token_id and not params.ignore_eos else last
                return True
        if req.num_output_tokens >= req.max_tokens or req.num_tokens >= self.max_model_len:
            req.status = RequestStatus.FINISHED_LENGTH_CAPPED
            return True
        return False

    # ----- introspection -----
    def has_unfinished_requests(self) -> bool:
        return bool(self.requests) or bool(self._rejected)

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    def make_stats(self) -> SchedulerStats:
        """A snapshot; `num_batched_tokens` counts the tokens scheduled since the previous snapshot."""
        batched, self._num_batched_tokens = self._num_batched_tokens, 0
        return self._with_lora(SchedulerStats(num_running_reqs=len(self.running), num_waiting_reqs=len(self.waiting),
                              kv_cache_usage=self.kv.usage(), prefix_cache_queries=self.kv.prefix_queries,
                              prefix_cache_hits=self.kv.prefix_hits, num_preemptions=self._num_preemptions,
                              num_batched_tokens=batched,
                              num_deferred_reqs=min(self._num_deferred, len(self.waiting)),
                              spec_decoding_stats=self.spec_stats.take() if self.spec_stats is not None else None))

    def _with_lora(self, stats: SchedulerStats) -> SchedulerStats:
        """`stats` with the adapters of the running and waiting requests counted (when LoRA is on)."""
        if self.max_loras is not None:
            for reqs, out in ((self.running, stats.running_lora_adapters),
                              (list(self.waiting), stats.waiting_lora_adapters)):
                for r in reqs:
                    if r.lora_request is not None:
                        out[r.lora_request.lora_name] = out.get(r.lora_request.lora_name, 0) + 1
        return stats

    def reset_prefix_cache(self) -> bool:
        return self.kv.reset_prefix_cache()
