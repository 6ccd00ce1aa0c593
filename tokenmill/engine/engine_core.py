"""The engine core: schedule, execute, update. No I/O; the serving process wraps it in a busy loop."""
from __future__ import annotations

import time
from collections import deque

from tokenmill.config import TokenmillConfig
from tokenmill.core.messages import EngineCoreOutputs, EngineCoreRequest
from tokenmill.core.sched_output import EMPTY_MODEL_RUNNER_OUTPUT, ModelRunnerOutput, SchedulerOutput
from tokenmill.core.scheduler import Scheduler
from tokenmill.executor import get_executor_class
from tokenmill.kernels.compile_stats import CompileStats
from tokenmill.logger import init_logger
from tokenmill.metrics.step_timing import TIMER

logger = init_logger(__name__)
_IN_PROCESS_EXECUTORS = ("UniProcExecutor", "ExternalLauncherExecutor")


def format_startup(seconds: dict[str, float]) -> str:
    """'12.3 s: workers and weights 4.1 s, memory profile 2.0 s, ...' (the start-up breakdown log line)."""
    parts = [f"{k} {v:.1f} s" for k, v in seconds.items() if k != "total"]
    return f"{seconds['total']:.1f} s: " + ", ".join(parts)


class EngineCore:
    """Owns the scheduler and the executor. `step()` runs one batch and returns what requests produced.

    With async scheduling (the default on CUDA) a step launches batch N+1's forward pass before it waits for batch
    N's sampled ids: the host then applies N's output, builds N+1's grammar bitmask and launches N+1's sampling
    while the device computes, so the device never waits for the host. Requests in flight count their coming token
    as a placeholder when N+1 is scheduled; a request that stops at N has its token from N+1 dropped. `step()`
    therefore returns the outputs of the previous batch (nothing on the first call).

    Under pipeline parallelism (`executor.max_concurrent_batches` > 1) up to that many batches are in flight: a
    step schedules and launches batches (each of requests not already in flight, so they are disjoint) until the
    pipeline is full, then waits for the oldest and returns its outputs; batches complete in launch order.
    """

    def __init__(self, config: TokenmillConfig) -> None:
        self.config = config
        t0 = time.perf_counter()
        executor_cls = get_executor_class(config)
        # Kernels compile where the workers run; only an in-process executor's compiles are visible here.
        compiles = CompileStats.track() if executor_cls.__name__ in _IN_PROCESS_EXECUTORS else CompileStats()
        try:
            self.executor = executor_cls(config)
            t1 = time.perf_counter()
            self.num_blocks = self.executor.determine_num_blocks()
            t2 = time.perf_counter()
            self.executor.initialize_kv_cache(self.num_blocks)
            t3 = time.perf_counter()
        finally:
            compiles.stop()
        self.scheduler = Scheduler(config, self.num_blocks)
        # One count for the processor's prompt check and the metrics, also with a block count per layer group.
        self.num_blocks = self.scheduler.kv.num_prompt_blocks
        from tokenmill.core.kv_cache_groups import kv_capacity
        self.kv_capacity = kv_capacity(self.scheduler.kv, config.model_config.max_model_len,
                                       config.scheduler_config.max_num_batched_tokens)
        self.startup_seconds = {"workers and weights": t1 - t0, "memory profile": t2 - t1,
                                "KV cache and CUDA graphs": t3 - t2, "total": time.perf_counter() - t0}
        logger.info("Engine ready in %s%s", format_startup(self.startup_seconds),
                    f"; within them, kernel compile {compiles.describe()}" if compiles.available else "")
        # Reported to the API server for its own breakdown line (compile time is within the phases above).
        self.startup_compile_seconds = compiles.seconds if compiles.available else None
        self.async_scheduling = bool(config.scheduler_config.async_scheduling)
        # Speculative decoding steps aside while decoding without drafts is measured faster.
        spec = config.speculative_config
        self.gate = None
        if spec is not None:
            from tokenmill.spec_decode.step_aside import SpeculationGate
            self.gate = SpeculationGate(spec.disable_by_batch_size, enabled=spec.step_aside)
        # Standing aside, a drafter that costs only a lookup keeps proposing where the steps are synchronous anyway
        # (no async scheduling), so that the gate sees the acceptance come back (core/shadow_drafts.py).
        self._shadow_ok = (spec is not None and not spec.uses_draft_model and spec.benchmark_acceptance_rate is None
                           and not config.scheduler_config.async_scheduling)
        self._in_flight: tuple[SchedulerOutput, object] | None = None  # (batch, AsyncRunnerOutput)
        self.max_concurrent_batches = self.executor.max_concurrent_batches
        self._batches: deque[tuple[SchedulerOutput, object]] = deque()  # pipeline parallelism, oldest first
        self.max_batches_in_flight = 0  # the most batches ever in flight at once (observability, tests)
        self.last_scheduled: SchedulerOutput | None = None  # the latest batch (slow-step diagnostics)
        self._loras_seen: set[tuple[int, str]] = set()  # adapters the workers were asked to prefetch
        self._profiling = False  # the workers' torch profilers are running (start_profile)
        self.sleeping: set[str] = set()  # the workers' parts asleep (worker/sleep.py): "weights", "kv_cache"

    def add_request(self, request: EngineCoreRequest) -> None:
        self._check_awake()
        self.scheduler.add_request(request)
        self._prefetch_lora(request)

    def _prefetch_lora(self, request: EngineCoreRequest) -> None:
        """A request under an adapter not seen before: the workers start reading it now, off the step loop."""
        lora = request.lora_request
        if lora is not None and ((lora.lora_int_id, lora.lora_path) not in self._loras_seen or lora.load_inplace):
            self._loras_seen.add((lora.lora_int_id, lora.lora_path))
            self.executor.collective_rpc("prefetch_lora", lora)

    def add_requests(self, requests: list[EngineCoreRequest]) -> None:
        """The n sequences of one user request (the data-parallel stand-in keeps them on one engine)."""
        self._check_awake()
        for request in requests:
            self.scheduler.add_request(request)
            self._prefetch_lora(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        self.scheduler.finish_requests(request_ids)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or self._in_flight is not None or bool(self._batches)

    def step(self) -> EngineCoreOutputs:
        if self.max_concurrent_batches > 1:
            return self._step_pipelined()
        # A speculative step runs synchronously: its drafts need the previous step's tokens.
        speculate = self.gate is not None and self.gate.speculating(len(self.scheduler.running))
        overlap = self.async_scheduling and not speculate
        if self._in_flight is not None and not overlap:
            # Speculation resumes: the step in flight finishes before the next one is scheduled.
            prev, handle = self._in_flight
            self._in_flight = None
            with TIMER.phase("wait_output"):
                outputs = self._update(prev, handle.get())
            return self._stamp(outputs)
        sched = None
        if self.scheduler.has_unfinished_requests():
            self.scheduler.drafting = speculate
            self.scheduler.shadowing = (self._shadow_ok and not speculate
                                        and self.gate.wants_shadow(len(self.scheduler.running)))
            with TIMER.phase("schedule"):
                sched = self.last_scheduled = self.scheduler.schedule()
            with TIMER.phase("execute_model"):
                self.executor.execute_model(sched)
        outputs = None
        if self._in_flight is not None:
            prev, handle = self._in_flight
            self._in_flight = None
            with TIMER.phase("wait_output"):
                out = handle.get()
            outputs = self._update(prev, out)
        if sched is not None and not sched.is_empty:
            with TIMER.phase("grammar_bitmask"):
                grammar = self.scheduler.get_grammar_bitmask(sched)
            with TIMER.phase("sample"):
                handle = self.executor.sample_tokens(grammar)
            if overlap:
                self._in_flight = (sched, handle)
            else:
                outputs = self._update(sched, handle.get())
        if outputs is None:
            outputs = self.scheduler.update_from_output(sched, EMPTY_MODEL_RUNNER_OUTPUT) \
                if sched is not None else EngineCoreOutputs()
        return self._stamp(outputs)

    def _stamp(self, outputs: EngineCoreOutputs) -> EngineCoreOutputs:
        if self.gate is not None and not self.has_unfinished_requests():
            self.gate.idle()  # the time until the next request arrives is not a step's
        outputs.scheduler_stats = self.scheduler.make_stats()
        outputs.timestamp = time.monotonic()
        return outputs

    def _step_pipelined(self) -> EngineCoreOutputs:
        early = None  # outputs that need no batch (requests rejected before running)
        while len(self._batches) < self.max_concurrent_batches and self.scheduler.has_unfinished_requests():
            with TIMER.phase("schedule"):
                sched = self.last_scheduled = self.scheduler.schedule()
            if sched.is_empty:
                # Everything runnable is in flight. The runners still must forget finished requests.
                if sched.finished_req_ids:
                    self.executor.execute_model(sched)
                early = self.scheduler.update_from_output(sched, EMPTY_MODEL_RUNNER_OUTPUT)
                break
            with TIMER.phase("execute_model"):
                self.executor.execute_model(sched)
            grammar = self.scheduler.get_grammar_bitmask(sched)  # its requests have no sample in flight
            with TIMER.phase("sample"):
                self._batches.append((sched, self.executor.sample_tokens(grammar)))
            self.max_batches_in_flight = max(self.max_batches_in_flight, len(self._batches))
        outputs = EngineCoreOutputs()
        if self._batches:
            sched, handle = self._batches.popleft()
            outputs = self._update(sched, handle.get())
        if early is not None and early.outputs:
            outputs.outputs = early.outputs + outputs.outputs
        outputs.scheduler_stats = self.scheduler.make_stats()
        outputs.timestamp = time.monotonic()
        return outputs

    def _update(self, sched: SchedulerOutput, out: ModelRunnerOutput) -> EngineCoreOutputs:
        with TIMER.phase("update_from_output"):
            outputs = self.scheduler.update_from_output(sched, out)
        if self.gate is not None and not sched.is_empty:
            self._observe(sched, out)
        return outputs

    def _observe(self, sched: SchedulerOutput, out: ModelRunnerOutput) -> None:
        """Tell the speculation gate about a finished step: a pure decode step (every request one token plus its
        drafts) is a measurement."""
        drafts = sum(len(d) for d in sched.scheduled_spec_decode_tokens.values())
        n = len(sched.num_scheduled_tokens)
        counted = not sched.scheduled_new_reqs and sched.total_num_scheduled_tokens == n + drafts
        tokens = sum(len(t) for t in out.sampled_token_ids)
        speculated = sched.propose_drafts and not sched.shadow_drafts
        self.gate.observe(time.monotonic(), tokens, n, speculated, counted, drafts)
        shadow = self.scheduler.shadow
        if sched.shadow_drafts:
            self.gate.observe_shadow(shadow.tokens_per_step(), shadow.drafts_per_step(), shadow.samples)
        elif shadow.active:
            shadow.reset()  # its history describes an earlier stretch of plain decoding

    def describe_last_batch(self) -> str:
        """One line on the latest scheduled batch, for diagnostics."""
        s = self.last_scheduled
        if s is None:
            return "no batch"
        return (f"batch: {len(s.num_scheduled_tokens)} requests ({len(s.scheduled_new_reqs)} new, "
                f"{len(s.grammar_req_ids)} constrained), {s.total_num_scheduled_tokens} tokens")

    def reset_prefix_cache(self) -> bool:
        return self.scheduler.reset_prefix_cache()

    # ----- sleep mode (worker/sleep.py); checked here, before the workers are asked -----
    def _check_enabled(self, what: str) -> None:
        if not self.config.model_config.enable_sleep_mode:
            raise ValueError(f"{what} needs sleep mode: start the engine with enable_sleep_mode=True "
                             "(--enable-sleep-mode), as in vLLM.")

    def _check_awake(self) -> None:
        if self.sleeping:
            raise RuntimeError(f"The engine is sleeping ({' and '.join(sorted(self.sleeping))} released): call "
                               "wake_up() before generating.")

    def sleep(self, level: int = 1) -> None:
        """Level 1: weights to host memory, KV cache discarded; level 2: both discarded. The prefix cache is
        reset (its blocks are gone). Requests must have finished."""
        self._check_enabled("sleep()")
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 (weights kept in host memory) or 2 (weights discarded), got "
                             f"{level!r}.")
        if self.sleeping:
            logger.warning("sleep(): the engine is already sleeping (%s).", ", ".join(sorted(self.sleeping)))
            return
        if self.has_unfinished_requests():
            raise RuntimeError("sleep() with requests still running: let them finish or abort them first.")
        self.executor.collective_rpc("sleep", level)
        self.sleeping = {"weights", "kv_cache"}
        if not self.scheduler.reset_prefix_cache():
            logger.warning("sleep(): the prefix cache could not be reset (blocks still in use).")

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Take back the parts named in tags ("weights", "kv_cache"; None: both). After level 2 the weights come
        back uninitialised: load or sync them before generating."""
        from tokenmill.worker.sleep import PARTS
        self._check_enabled("wake_up()")
        if isinstance(tags, str):
            tags = [tags]
        wanted = list(PARTS) if tags is None else list(tags)
        unknown = sorted({str(t) for t in wanted} - set(PARTS))
        if unknown:
            raise ValueError(f"wake_up(tags=...): unknown tag(s) {unknown}; the parts are {list(PARTS)}.")
        if not self.sleeping:
            logger.warning("wake_up(): the engine is not sleeping.")
            return
        wanted = [t for t in PARTS if t in wanted and t in self.sleeping]
        if wanted:
            self.executor.collective_rpc("wake_up", wanted)
            self.sleeping -= set(wanted)

    def is_sleeping(self) -> bool:
        return bool(self.sleeping)

    # ----- torch profiler (worker/profiler.py); checked here: a worker raising inside a collective call would stop
    # a multi-process engine -----
    def start_profile(self) -> None:
        from tokenmill.worker.profiler import profiler_dir
        profiler_dir()
        if self._profiling:
            raise RuntimeError("The profiler is already running; call stop_profile() first.")
        self.executor.collective_rpc("start_profile")
        self._profiling = True

    def stop_profile(self) -> None:
        if not self._profiling:
            raise RuntimeError("The profiler is not running; call start_profile() first.")
        self._profiling = False
        self.executor.collective_rpc("stop_profile")
