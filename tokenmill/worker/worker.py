"""A worker: one device, one model runner; sizes the KV cache from the memory it is allowed to use."""
from __future__ import annotations

import torch

from tokenmill import envs
from tokenmill.attention import kv_cache_memory
from tokenmill.config import TokenmillConfig
from tokenmill.core.kv_cache_manager import cdiv
from tokenmill.core.sched_output import GrammarOutput, SchedulerOutput
from tokenmill.distributed import ParallelState, init_distributed, use_parallel_state, world_min
from tokenmill.logger import init_logger
from tokenmill.worker.model_runner import ModelRunner
from tokenmill.worker.pp_output import BroadcastOutput, ResultSender, output_rank

logger = init_logger(__name__)
GiB = 1 << 30
# The CPU KV cache may take this share of the host memory available once the weights are loaded: the rest is
# for a step's activations, the API server and the page cache.
CPU_KV_AVAILABLE_SHARE = 0.9



def balanced_num_seqs(left_bytes: float, per_slot_bytes: int, checkpoints: bool, request_kv_bytes: int) -> int:
    """The max_num_seqs whose recurrent state leaves the KV cache room for as many requests of max_model_len:
    each sequence costs its state slot (and, with prefix caching, a checkpoint slot) plus one such request's KV
    (request_kv_bytes; 0: unknown, then half the memory goes to the state). A scratch slot comes off first."""
    per_seq = per_slot_bytes * (2 if checkpoints else 1)
    if request_kv_bytes <= 0:
        return max(int((left_bytes / 2 - per_slot_bytes) // per_seq), 0)
    return max(int((left_bytes - per_slot_bytes) // (per_seq + request_kv_bytes)), 0)


def check_state_fits(left_bytes: float, per_slot_bytes: int, max_num_seqs: int, checkpoints: int,
                     request_kv_bytes: int = 0) -> int:
    """The bytes of the recurrent-state slots; raises, naming max_num_seqs, when the recurrent-state slots (one per
    running request, a scratch slot and the prefix-caching checkpoints) take all the memory the weights and
    activations leave: a hybrid model's state is reserved per max_num_seqs, so the default of 256 sequences may not
    fit beside a large model. The value suggested balances state and KV (balanced_num_seqs)."""
    need = per_slot_bytes * (max_num_seqs + 1 + checkpoints)
    if per_slot_bytes <= 0 or need < left_bytes:
        return need
    fit = balanced_num_seqs(left_bytes, per_slot_bytes, bool(checkpoints), request_kv_bytes)
    room = ("leaves the KV cache room for as many requests of max_model_len" if request_kv_bytes > 0
            else "leaves half of that for the KV cache")
    raise ValueError(
        f"The recurrent state of max_num_seqs={max_num_seqs} requests ({per_slot_bytes / GiB:.3f} GiB each, plus "
        f"{checkpoints} prefix-caching checkpoints and a scratch slot) needs {need / GiB:.2f} GiB, but the weights "
        f"and activations leave {max(left_bytes, 0) / GiB:.2f} GiB under gpu_memory_utilization. Lower max_num_seqs "
        f"(--max-num-seqs {fit} {room})" + (" or turn prefix caching off." if checkpoints else "."))


class Worker:
    """One rank: joins the process groups (when the world has more than one rank), then owns its model runner.

    Every public method is what an executor's `collective_rpc` may call by name on every rank. Under pipeline
    parallelism the last stage resolves its sampled output at once, and the output rank hands it on: to
    `result_addr` (the mp executor's driver) when given, otherwise, under external_launcher, as a broadcast to every
    rank when the step's handle is resolved (see worker/pp_output.py).
    """

    def __init__(self, config: TokenmillConfig, rank: int = 0, local_rank: int = 0,
                 distributed_init_method: str | None = None, result_addr: str | None = None) -> None:
        self.config = config
        self.rank = rank
        self.device = config.device_config.torch_device
        pc = config.parallel_config
        if pc.world_size > 1 and self.device.type == "cuda":
            self.device = torch.device("cuda", local_rank)
            torch.cuda.set_device(self.device)
        if self.device.type == "cpu":
            # CPU ranks on one host share its cores (with each other and an API server); oversubscribed threads
            # make every product and collective wait
            from tokenmill.worker.cpu_threads import configure_cpu_threads
            logger.info(configure_cpu_threads(rank, pc.world_size))
        self.parallel_state = ParallelState(local_rank=local_rank)
        if pc.world_size > 1:
            self.parallel_state = init_distributed(
                pc.world_size, rank, local_rank, tp_size=pc.tensor_parallel_size, pp_size=pc.pipeline_parallel_size,
                device=self.device, init_method=distributed_init_method or "env://",
                timeout_s=pc.distributed_timeout_seconds,
                adopt_existing=pc.distributed_executor_backend == "external_launcher")
            ps = self.parallel_state
            if ps.tp_size > 1 and self.device.type == "cuda" and not pc.disable_custom_all_reduce:
                from tokenmill.distributed.symm_all_reduce import enable_symmetric_all_reduce
                ps.tp_fast_all_reduce = enable_symmetric_all_reduce(ps.tp_group, ps.tp_cpu_group, self.device)
        torch.manual_seed(config.model_config.seed)
        self.runner = ModelRunner(config, self.device)
        from tokenmill.worker.profiler import WorkerProfiler
        self.profiler = WorkerProfiler(rank, self.device)
        from tokenmill.worker.sleep import SleepState
        self._num_blocks: int | tuple[int, ...] | None = None
        self.sleep_state = SleepState(self.runner, lambda: self.runner.initialize_kv_cache(self._num_blocks))
        ps = self.parallel_state
        self.pp = ps.pp_size > 1
        self.broadcast_output = self.pp and pc.distributed_executor_backend == "external_launcher"
        self.result_sender = None
        if self.pp and result_addr is not None and ps.rank == output_rank(ps):
            self.result_sender = ResultSender(result_addr)

    def load_model(self) -> None:
        with use_parallel_state(self.parallel_state):  # the layers shard for, and talk in, this worker's world
            self.runner.load_model()

    def determine_num_blocks(self) -> int:
        """Blocks that fit the allowed KV memory; raises with the numbers if max_model_len cannot fit."""
        cc, mc, sc = self.config.cache_config, self.config.model_config, self.config.scheduler_config
        per_block = self.runner.kv_cache_bytes_per_block()
        specs, blocks_per_request = self._kv_specs()
        if specs and len(set(specs)) > 1:  # full attention beside sliding windows: blocks per layer group
            return self._group_blocks(specs)
        if cc.num_gpu_blocks_override is not None:
            num_blocks = cc.num_gpu_blocks_override
            source = "num_gpu_blocks_override"
        else:
            budget, source = self._kv_budget_bytes(blocks_per_request * per_block)
            num_blocks = budget // per_block
        # Every rank must hold the same blocks: the scheduler's one block table addresses all of them.
        num_blocks = world_min(int(num_blocks), self.parallel_state)
        need_one = blocks_per_request
        if num_blocks < need_one:
            raise ValueError(
                f"The KV cache holds {num_blocks} blocks ({num_blocks * cc.block_size} tokens, from {source}) but "
                f"one request of max_model_len={mc.max_model_len} needs {need_one} blocks "
                f"({need_one * per_block / GiB:.2f} GiB). Lower max_model_len or give the KV cache more memory "
                "(gpu_memory_utilization / kv_cache_memory_bytes).")
        logger.info("KV cache: %d blocks of %d tokens (%.2f GiB, %s), max concurrency at max_model_len %d: %.1fx",
                    num_blocks, cc.block_size, num_blocks * per_block / GiB,
                    str(self.runner.kv_dtype).removeprefix("torch."), mc.max_model_len, num_blocks / need_one)
        from tokenmill.core.kv_cache_spec import capacity_report
        if specs and specs[0].num_dead_blocks(1 << 40):  # every layer slides: blocks below the window are freed
            logger.info("KV cache capacity per layer group (requests of max_model_len %d at once): %s",
                        mc.max_model_len, ", ".join(f"{name}: {n:.1f}" for name, n in capacity_report(
                            specs, self.runner.own_layers, int(num_blocks), mc.max_model_len,
                            sc.max_num_batched_tokens).items()))
        return int(num_blocks)

    def _group_blocks(self, specs) -> tuple[int, ...]:
        """Blocks per layer group (core/kv_cache_groups.py): the budget is split so every group holds the same
        number of max_model_len requests; num_gpu_blocks_override gives each group that many blocks."""
        from tokenmill.core.kv_cache_groups import kv_groups, split_kv_budget
        cc, mc, sc = self.config.cache_config, self.config.model_config, self.config.scheduler_config
        groups, own = kv_groups(specs), self.runner.own_layers
        mlen, step = mc.max_model_len, sc.max_num_batched_tokens
        need = [s.max_blocks_per_request(mlen, step) for s, _ in groups]
        cost = [s.bytes_per_block * sum(1 for i in layers if i in own) for s, layers in groups]
        if cc.num_gpu_blocks_override is not None:
            blocks, source = (cc.num_gpu_blocks_override,) * len(groups), "num_gpu_blocks_override"
        else:
            budget, source = self._kv_budget_bytes(sum(n * c for n, c in zip(need, cost)))
            blocks = split_kv_budget(budget, groups, own, mlen, step)
        blocks = tuple(world_min(int(n), self.parallel_state) for n in blocks)
        for (spec, layers), n, want in zip(groups, blocks, need):
            if n < want:
                raise ValueError(
                    f"The KV cache's {spec.name} group ({len(layers)} layers) holds {n} blocks (from {source}) but "
                    f"one request of max_model_len={mlen} needs {want}. Lower max_model_len or give the KV cache "
                    "more memory (gpu_memory_utilization / kv_cache_memory_bytes).")
        logger.info("KV cache per layer group (%d-token blocks): %s", cc.block_size, "; ".join(
            f"{spec.name} x{len(layers)} layers: {n} blocks ({n * c / GiB:.2f} GiB), {n / want:.1f} requests of "
            f"max_model_len {mlen} at once" for (spec, layers), n, c, want in zip(groups, blocks, cost, need)))
        return blocks

    def _kv_budget_bytes(self, per_request_bytes: int) -> tuple[int, str]:
        """(bytes the KV cache may take, the setting they come from): kv_cache_memory_bytes; on the CPU a fixed
        budget (never all RAM), and no more than max_num_seqs requests of per_request_bytes need; on a GPU what
        the memory profile leaves under gpu_memory_utilization."""
        cc, sc = self.config.cache_config, self.config.scheduler_config
        if cc.kv_cache_memory_bytes is not None:
            return cc.kv_cache_memory_bytes, f"kv_cache_memory_bytes={cc.kv_cache_memory_bytes}"
        if self.device.type == "cpu":
            name = "VLLM_CPU_KVCACHE_SPACE" if envs.VLLM_CPU_KVCACHE_SPACE > 0 else "TOKENMILL_CPU_KVCACHE_SPACE_GIB"
            gib = getattr(envs, name)
            if gib <= 0:
                raise ValueError(f"{name}={gib}: the CPU KV cache needs at least 1 GiB")
            budget = int(min(gib * GiB, sc.max_num_seqs * per_request_bytes))
            available = kv_cache_memory.available_host_bytes()
            if available is not None and budget > CPU_KV_AVAILABLE_SHARE * available:
                raise ValueError(
                    f"{name}={gib}: a {budget / GiB:.1f} GiB CPU KV cache does not fit the "
                    f"{available / GiB:.1f} GiB of host memory available (at most "
                    f"{CPU_KV_AVAILABLE_SHARE:.0%} of it goes to the cache); lower {name}, max_num_seqs or "
                    "max_model_len.")
            return budget, f"{name}={gib}"
        # bytes: the profile's "blocks" of one byte
        return (self._profile_gpu_blocks(1, per_request_bytes),
                f"gpu_memory_utilization={cc.gpu_memory_utilization}")

    def _kv_specs(self):
        """(this rank's per-layer KV specs or None, the most blocks one max_model_len request holds at once)."""
        from tokenmill.core.kv_cache_spec import config_attention_specs, manager_spec
        r, cc, sc = self.runner, self.config.cache_config, self.config.scheduler_config
        specs = config_attention_specs(self.config, torch.empty((), dtype=r.kv_dtype).element_size(),
                                       r.num_kv_heads, r.head_dim)
        spec = manager_spec(specs)
        mlen = self.config.model_config.max_model_len
        if spec is None:
            return specs, cdiv(mlen, cc.block_size)
        return specs, spec.max_blocks_per_request(mlen, sc.max_num_batched_tokens)

    def _profile_gpu_blocks(self, per_block: int, request_kv_bytes: int = 0) -> int:
        cc, sc = self.config.cache_config, self.config.scheduler_config
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        self.runner.profile_run(sc.max_num_batched_tokens)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
        free, total = torch.cuda.mem_get_info()
        non_torch = (total - free) - torch.cuda.memory_reserved()
        graphs = self.runner.cuda_graph_output_bytes()
        from tokenmill.core.kv_cache_spec import model_state_specs
        # Per-request state slots (recurrent layers) are reserved first: max_num_seqs of each kind, plus the scratch
        # slot that CUDA graphs' padding rows use, plus prefix caching's checkpoints.
        from tokenmill.core.state_checkpoints import num_checkpoint_slots
        checkpoints = num_checkpoint_slots(self.config)
        per_slot = sum(s.bytes_per_request for s in model_state_specs(self.runner.model))
        left = total * cc.gpu_memory_utilization - peak - non_torch - graphs
        state = check_state_fits(left, per_slot, sc.max_num_seqs, checkpoints, request_kv_bytes)
        available = left - state
        if per_slot and request_kv_bytes and available < (sc.max_num_seqs / 1.25) * request_kv_bytes:
            # The state slots of sequences that the KV cache could never run at max_model_len are memory lost.
            fit = balanced_num_seqs(left, per_slot, bool(checkpoints), request_kv_bytes)
            if fit > available / request_kv_bytes:
                logger.warning(
                    "max_num_seqs=%d reserves recurrent state for %d requests, but the KV cache left beside it holds "
                    "%.1f requests of max_model_len %d: --max-num-seqs %d would hold %d of each (more requests at "
                    "once; for long prompts, more throughput)", sc.max_num_seqs, sc.max_num_seqs,
                    available / request_kv_bytes, self.config.model_config.max_model_len, fit, fit)
        logger.info("Memory: weights+activations peak %.2f GiB, other %.2f GiB, CUDA graph logits %.2f GiB, "
                    "per-request state %.2f GiB, KV budget %.2f GiB", peak / GiB, non_torch / GiB, graphs / GiB,
                    state / GiB, available / GiB)
        return max(int(available // per_block), 0)

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.runner.initialize_kv_cache(num_blocks)
        self._num_blocks = num_blocks  # sleep mode builds the same cache again on waking

    def sleep(self, level: int = 1) -> None:
        """Release the weights' and the KV cache's device memory (worker/sleep.py); no request may be running."""
        self.sleep_state.sleep(level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Take back the memory of the parts named ("weights", "kv_cache"; None: both)."""
        from tokenmill.worker.sleep import PARTS
        self.sleep_state.wake_up(list(PARTS if tags is None else tags))

    def prefetch_lora(self, lora) -> None:
        """Start reading a LoRA adapter into the host cache in the background (see lora/manager.py)."""
        if self.runner.lora is not None:
            self.runner.lora.prefetch(lora)

    def execute_model(self, sched: SchedulerOutput) -> None:
        self.runner.execute_model(sched)

    def sample_tokens(self, grammar: GrammarOutput | None):
        """The step's output handle: the runner's own without pipeline parallelism."""
        handle = self.runner.sample_tokens(grammar)
        if not self.pp:
            return handle
        out = None
        if self.runner.is_last_stage:
            # Now, not when someone asks: the next micro-batch on this stage may hold other requests, and the
            # runner's device-side hand-over of sampled ids only reaches back one step.
            out = handle.get()
            if self.result_sender is not None:
                self.result_sender.send(out)
        if self.broadcast_output:
            return BroadcastOutput(self.parallel_state, out if self.rank == output_rank(self.parallel_state)
                                   else None)
        return handle

    def start_profile(self) -> None:
        self.profiler.start()

    def stop_profile(self) -> None:
        self.profiler.stop()

    def close(self) -> None:
        """Release the result socket (sends still queued there get a second to leave)."""
        if self.result_sender is not None:
            self.result_sender.close()
            self.result_sender = None
