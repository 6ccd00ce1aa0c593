"""The model runner: turns a SchedulerOutput into model inputs, runs the forward pass and samples."""
from __future__ import annotations

import numpy as np
import torch

from tokenmill import envs
from tokenmill.attention import kv_cache_memory
from tokenmill.attention.backend import AttentionMetadata
from tokenmill.attention.registry import get_attention_backend
from tokenmill.config import TokenmillConfig
from tokenmill.core.kv_cache_manager import cdiv
from tokenmill.core.sched_output import GrammarOutput, ModelRunnerOutput, SchedulerOutput
from tokenmill.distributed import get_parallel_state, kv_heads_per_rank
from tokenmill.distributed.pp import StageLink, pp_layer_range
from tokenmill.forward_context import set_forward_context
from tokenmill.layers.pooler import Pooler
from tokenmill.layers.sampler import LogprobsTensors, Sampler
from tokenmill.metrics.step_timing import TIMER
from tokenmill.models.loader import load_model
from tokenmill.worker.input_batch import InputBatch, PendingTokens
from tokenmill.worker.runner_output import AsyncRunnerOutput, StepState
from tokenmill.worker.sampling_state import SamplingState
from tokenmill.worker.spec_state import SpecDecodeState
from tokenmill.worker.step_inputs import StepInputs, runs
from tokenmill.worker.step_logits import apply_grammar, prompt_logprobs
from tokenmill.worker.transfer import to_device

__all__ = ["AsyncRunnerOutput", "ModelRunner"]
# The most tokens one request samples in one step (1; k + 1 once k draft tokens are verified): sizes the buffers
# the sampled ids pass through.
MAX_SAMPLED_PER_REQUEST = 1

_KV_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "fp8": torch.float8_e4m3fn,
              "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


class ModelRunner:
    """Owns the model, its KV cache and the persistent per-request input state.

    One step path: `execute_model` applies the plan (forget finished requests, add new ones, append blocks),
    `_prepare_inputs` builds the flat inputs with numpy gathers, and one forward runs them: `_forward_graph` (a
    captured graph that fits) or else `_forward_eager`, both giving the logits of the tokens that sample; then
    `sample_tokens` runs the sampler (or hands on the graph's own draw) and records the sampled ids as
    placeholders for the next step. With a `pooler` set (a pooling model) the forward is eager and the pooled
    hidden states of the requests whose prompt ends take the sampler's place. A request samples n_sample tokens
    (1 today; k + 1 once k drafts are verified) and every step of the path carries that count. The only
    device->host sync is the one that returns the step's results.

    Under pipeline parallelism the runner holds its stage's layers and their KV cache only: a stage other than the
    first receives the micro-batch's hidden states from the previous stage, one other than the last sends its own
    on and samples nothing; such stages learn the sampled tokens from the scheduler (`new_token_ids`).
    """

    def __init__(self, config: TokenmillConfig, device: torch.device) -> None:
        self.config = config
        self.device = device
        mc, cc, sc = config.model_config, config.cache_config, config.scheduler_config
        self.dtype = mc.get_torch_dtype(device)
        self.kv_dtype = _KV_DTYPES.get(cc.kv_cache_dtype, self.dtype)
        self.block_size = cc.block_size
        self.max_model_len = mc.max_model_len
        self.max_num_reqs = sc.max_num_seqs
        self.vocab_size = mc.vocab_size
        self.backend_cls = get_attention_backend(envs.TOKENMILL_ATTENTION_BACKEND, device)
        self.model: torch.nn.Module | None = None
        self.link: StageLink | None = None  # pipeline parallelism: to/from the neighbouring stages
        self.kv_caches: list[torch.Tensor] = []
        # On CUDA the random draw is one compiled kernel instead of ~15 int64 passes over [batch, vocab].
        self.sampler = Sampler(fuse_noise=device.type == "cuda")
        self.batch: InputBatch | None = None
        self.sampling: SamplingState | None = None
        self.prompt_logprobs: dict[str, int] = {}
        self.pooler: Pooler | None = None  # set: the model runs as a pooling model (no sampling)
        self.lora = None  # a LoRAModelManager when enable_lora
        self.compiled = None  # a cpu_compile.CompiledSteps (the model's steps compiled) with -O3 on the CPU
        self.pending: PendingTokens | None = None       # where the step in flight's tokens go (placeholders)
        self._step: StepState | None = None             # between execute_model and sample_tokens
        self._verify = False                             # the step in _step verifies drafts / proposes
        self._last_output: AsyncRunnerOutput | None = None
        self._prev_sampled: torch.Tensor | None = None  # the last step's sampled ids (flat), on the device
        # Pinned host buffers the sampled ids are copied into, in turn (a fresh pinned tensor per step costs a
        # caching-allocator round trip). A buffer is reused three steps later: by then the runner has taken that
        # step's ids (`sample_tokens` calls the previous output's get() first).
        # Speculative decoding: the drafter and the step's drafts (worker/spec_state.py).
        spec = self.spec = config.speculative_config
        self.spec_state = SpecDecodeState(config, device, _KV_DTYPES) if spec is not None else None
        self.proposer = self.spec_state.proposer if spec is not None else None
        self.max_sampled = self.max_num_reqs * (1 + spec.num_speculative_tokens if spec is not None
                                                else MAX_SAMPLED_PER_REQUEST)
        self._ids_host = [torch.empty(self.max_sampled, dtype=torch.long, pin_memory=True) for _ in range(3)] \
            if device.type == "cuda" else []
        self._ids_host_i = 0

    # ----- set-up -----
    def load_model(self) -> None:
        self.model = load_model(self.config, self.device, self.backend_cls)
        # (prompt length, position offset): requests with longer prompts read the second RoPE table (LongRoPE).
        self.rope_long_switch: tuple[int, int] | None = getattr(self.model, "rope_long_switch", None)
        text = self.config.model_config.get_text_config()
        if self.config.lora_config is not None:
            from tokenmill.lora.manager import LoRAModelManager
            mc = self.config.model_config
            self.lora = LoRAModelManager(self.model, self.config.lora_config, self.dtype, self.device, text,
                                         [*mc.served_model_name, mc.model or ""],
                                         self.config.scheduler_config.max_num_batched_tokens)
        ps = self.parallel = get_parallel_state()  # called inside the worker's use_parallel_state
        self.is_first_stage, self.is_last_stage = ps.pp_rank == 0, ps.pp_rank == ps.pp_size - 1
        self.num_layers = text.num_hidden_layers
        self.own_layers = range(*pp_layer_range(self.num_layers, ps.pp_rank, ps.pp_size))
        # Hybrid models (Gated DeltaNet): a paged KV cache only for the attention layers, a state slot pool for
        # the recurrent ones (worker/state_cache.py).
        shapes = getattr(self.model, "recurrent_state_shapes", None)
        self.state_shapes = shapes() if shapes is not None else {}
        attn = set(getattr(self.model, "attention_layers", self.own_layers))
        self.kv_layers = [i for i in self.own_layers if i in attn]
        self.state_cache = None
        self.link = StageLink(ps, text.hidden_size, self.dtype, self.device) if ps.pp_size > 1 else None
        self.num_kv_heads = kv_heads_per_rank(  # this rank's share of the KV heads: its cache holds only those
            getattr(text, "num_key_value_heads", None) or text.num_attention_heads, ps.tp_size)
        self.head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
        if self.proposer is not None and self.proposer.has_model:
            self.proposer.load_model(self.backend_cls, self.model)

    def kv_cache_bytes_per_block(self) -> int:
        elem = torch.empty((), dtype=self.kv_dtype).element_size()
        own = 2 * len(self.kv_layers) * self.block_size * self.num_kv_heads * self.head_dim * elem
        # A draft model keeps its KV in the same blocks (cache tensors of its own).
        return own + (self.proposer.kv_cache_bytes_per_block(self.block_size) if self.proposer is not None else 0)

    def kv_layer_groups(self) -> list[int] | None:
        """Each layer's KV cache group when the model has several (full attention beside sliding windows, see
        core/kv_cache_groups.py), else None."""
        from tokenmill.core.kv_cache_groups import kv_groups
        from tokenmill.core.kv_cache_spec import config_attention_specs
        specs = config_attention_specs(self.config)
        groups = kv_groups(specs) if specs else []
        if len(groups) <= 1:
            return None
        layer_group = [0] * len(specs)
        for g, (_, layers) in enumerate(groups):
            for i in layers:
                layer_group[i] = g
        return layer_group

    def initialize_kv_cache(self, num_blocks: int | tuple[int, ...]) -> None:
        """num_blocks: one count, or one per KV cache group (kv_layer_groups) for a model with several."""
        layer_group = self.kv_layer_groups()
        counts = num_blocks if isinstance(num_blocks, tuple) else (num_blocks,) * (max(layer_group or [0]) + 1)

        def cache(i: int) -> torch.Tensor:
            n = counts[layer_group[i] if layer_group else 0]
            shape = self.backend_cls.kv_cache_shape(n, self.block_size, self.num_kv_heads, self.head_dim)
            return kv_cache_memory.zeros(shape, self.kv_dtype, self.device)
        # Indexed by global layer; other stages' layers get an empty stand-in (they never run here).
        self.kv_caches = [cache(i) if i in self.kv_layers
                          else torch.empty(0, dtype=self.kv_dtype, device=self.device) for i in range(self.num_layers)]
        if self.state_shapes:
            from tokenmill.worker.state_cache import RecurrentStateCache
            from tokenmill.core.state_checkpoints import num_checkpoint_slots
            self.state_cache = RecurrentStateCache(self.state_shapes, self.max_num_reqs, self.dtype, self.device,
                                                   num_checkpoints=num_checkpoint_slots(self.config))
        max_blocks = cdiv(self.max_model_len, self.block_size)
        self.batch = InputBatch(self.max_num_reqs, self.max_model_len, max_blocks)
        self.group_tables = None
        if layer_group:
            from tokenmill.worker.kv_group_tables import GroupBlockTables
            self.group_tables = GroupBlockTables(len(counts), self.max_num_reqs, max_blocks, self.block_size,
                                                 layer_group)
        self.pending = PendingTokens(self.batch)
        if self.proposer is not None:
            graph_sizes = None
            if self.use_cuda_graphs():  # the drafter's graphs cover the batches the verify graphs do
                graph_sizes = self.config.compilation_config.verify_capture_sizes(
                    self.max_num_reqs, 1 + self.spec.num_speculative_tokens)
            self.proposer.initialize_kv_cache(counts[0], self.block_size, self.max_num_reqs, graph_sizes,
                                              self.max_model_len)
        self.sampling = SamplingState(self.max_num_reqs, self.vocab_size, self.device,
                                      global_seed=self.config.model_config.seed,
                                      logprobs_mode=self.config.model_config.logprobs_mode,
                                      max_rows=self.max_sampled)
        self.cuda_graphs = None
        if self.use_cuda_graphs():
            from tokenmill.worker.cuda_graph import CudaGraphRunner
            cc = self.config.compilation_config
            sizes = cc.capture_sizes(self.max_num_reqs)
            mixed = cc.mixed_capture_sizes(self.config.scheduler_config.max_num_batched_tokens, self.max_num_reqs)
            recurrent = None
            # Verifying k drafts: uniform graphs of k + 1 tokens per request too (when every request of a step
            # verifies exactly k; a step with fewer runs eagerly).
            q = 1 if self.spec is None else 1 + self.spec.num_speculative_tokens
            if self.state_cache is not None:
                # Decode graphs only: a step with a prefill row runs its recurrent layers one sequence at a time.
                from tokenmill.worker.state_cache import GraphRecurrentStep
                recurrent, mixed = GraphRecurrentStep(self.state_cache, max(sizes)), []
            self.cuda_graphs = CudaGraphRunner(self.model, self.kv_caches, sizes, self.max_model_len,
                                               cdiv(self.max_model_len, self.block_size), self.device,
                                               mixed_sizes=mixed, recurrent=recurrent,
                                               prev_sampled=torch.zeros(self.max_sampled, dtype=torch.long,
                                                                        device=self.device),
                                               vocab_size=self.vocab_size, dtype=self.dtype,
                                               verify_sizes={q: cc.verify_capture_sizes(self.max_num_reqs, q)}
                                               if recurrent is None else None, layer_group=layer_group)
            self.cuda_graphs.capture()
        if self.compiled is None and self.config.compilation_config.torch_compile:
            from tokenmill.worker.cpu_compile import compile_steps
            self.compiled = compile_steps(self, min(counts))

    def release_kv_cache(self) -> None:
        """Drop the KV cache, the recurrent state and everything that points into them (the CUDA graphs, the
        drafter's cache, the last step's handles); `initialize_kv_cache` builds them again. No request may be
        running."""
        self.cuda_graphs = None
        self.kv_caches = []
        self.state_cache = None
        self._step = self._last_output = self._prev_sampled = None
        if self.proposer is not None:
            self.proposer.release_kv_cache()

    def cuda_graph_output_bytes(self) -> int:
        """Device memory the CUDA graphs will keep for their logits, one buffer all of them share (allocated after
        the KV cache is sized)."""
        if not self.use_cuda_graphs():
            return 0
        q = 1 if self.spec is None else 1 + self.spec.num_speculative_tokens
        rows = self.config.compilation_config.graph_output_rows(
            self.max_num_reqs, self.config.scheduler_config.max_num_batched_tokens, q)
        return rows * self.vocab_size * self.dtype.itemsize

    def use_cuda_graphs(self) -> bool:
        """Graphs need a device, a backend without host-side planning per step, and enforce_eager off; pipeline
        stages run eagerly (the graphs capture a whole model's forward, not a stage's send/receive)."""
        return (self.device.type == "cuda" and not self.config.model_config.enforce_eager and self.link is None
                and self.config.compilation_config.graphs_enabled
                and getattr(self.backend_cls, "supports_cuda_graphs", False))

    @torch.inference_mode()
    def profile_run(self, num_tokens: int) -> None:
        """A forward over `num_tokens` dummy tokens without a KV cache, to measure peak activation memory."""
        ids = torch.zeros(num_tokens, dtype=torch.long, device=self.device)
        inter = None
        if not self.is_first_stage:  # stand-in activations: no stage exchanges anything while profiling
            from tokenmill.distributed.pp import IntermediateTensors
            h = torch.zeros(num_tokens, self.link.hidden_size, dtype=self.dtype, device=self.device)
            inter = IntermediateTensors(h, h.clone())
        with set_forward_context(None, []):
            hidden = self.model(ids, ids, inter)
            if self.is_last_stage:
                self.model.compute_logits(hidden[-min(num_tokens, self.max_num_reqs):])
        if self.proposer is not None:
            del hidden
            self.proposer.profile_run(num_tokens)

    # ----- one step: prepare inputs -> forward (graph or eager) -> sampler | pooler -> outputs -----
    def _update_states(self, sched: SchedulerOutput) -> None:
        b = self.batch
        for rid in sched.finished_req_ids:
            row = b.remove(rid)
            if row is not None:
                self.sampling.remove_request(row)
            self.prompt_logprobs.pop(rid, None)
            if self.lora is not None:
                self.lora.remove_request(rid)
            if self.spec_state is not None:
                self.spec_state.remove(rid)
        for new in sched.scheduled_new_reqs:
            ids = new.block_ids
            if self.group_tables is not None:  # one list per KV cache group
                ids = ids[0]
            row = b.add(new.req_id, new.prompt_token_ids, new.output_token_ids, ids, new.num_computed_tokens)
            if new.state_load is not None:  # a prefix hit on a hybrid model: the state saved where it ends
                self.state_cache.restore(row, new.state_load)
            if self.group_tables is not None:
                self.group_tables.add(row, new.block_ids[1:])
            self.sampling.add_request(row, new.sampling_params)
            if self.lora is not None:
                self.lora.add_request(new.req_id, new.lora_request)
            if new.sampling_params.prompt_logprobs is not None:
                self.prompt_logprobs[new.req_id] = new.sampling_params.prompt_logprobs
            if self.spec_state is not None:
                self.spec_state.add_request(new.req_id, row, new.sampling_params, new.num_computed_tokens)
        c = sched.scheduled_cached_reqs
        for rid, blocks, num_computed in zip(c.req_ids, c.new_block_ids, c.num_computed_tokens):
            row = b.req_id_to_row[rid]
            if self.group_tables is not None:
                self.group_tables.append(row, blocks[1:])
                blocks = blocks[0]
            b.append_blocks(row, blocks)
            b.num_computed_tokens[row] = num_computed
        if c.new_token_ids and not self.is_last_stage:
            # Tokens the last stage sampled since this request last ran (only it sampled them).
            for rid, toks in zip(c.req_ids, c.new_token_ids):
                if toks:
                    row, n = b.req_id_to_row[rid], len(toks)
                    b.token_ids[row, b.num_tokens[row]:b.num_tokens[row] + n] = toks
                    b.num_tokens[row] += n
        if self.spec_state is not None:  # drafts sit after the known tokens without counting as known
            self.spec_state.begin_step(sched.scheduled_spec_decode_tokens, b)

    @torch.inference_mode()
    def execute_model(self, sched: SchedulerOutput) -> None:
        """Apply the plan's state changes, build the inputs and launch the forward pass (and the logits of the
        tokens that sample). Nothing waits for the device; `sample_tokens` finishes the step."""
        self._update_states(sched)
        self._step = None
        # A speculative step verifies its drafts and proposes the next ones; with speculation stepped aside
        # (core/scheduler: drafting off) the step samples as without a drafter.
        self._verify = self.spec is not None and (sched.propose_drafts or bool(sched.scheduled_spec_decode_tokens))
        if sched.is_empty:
            return
        inp = self._prepare_inputs(sched)
        if self.lora is not None:  # the step's adapters into slots, its lora map to the layers' deltas
            self.lora.activate(inp.req_ids, inp.n_sched)
        try:
            step = self._forward_graph(sched, inp)
            self._step = step if step is not None else self._forward_eager(inp, sched.state_saves)
            if self._step is not None:
                self._step.seq_lens, self._step.qsl = inp.seq_lens, inp.qsl
        finally:
            if self.lora is not None:
                self.lora.deactivate()

    def _prepare_inputs(self, sched: SchedulerOutput) -> StepInputs:
        """The step's flat inputs, built with numpy gathers over the batch's rows (no per-token Python)."""
        b = self.batch
        req_ids = list(sched.num_scheduled_tokens)
        rows = np.fromiter((b.req_id_to_row[r] for r in req_ids), dtype=np.int64, count=len(req_ids))
        n_sched = np.fromiter(sched.num_scheduled_tokens.values(), dtype=np.int64, count=len(req_ids))
        computed = b.num_computed_tokens[rows].astype(np.int64)
        cu = np.cumsum(n_sched)
        total = int(cu[-1])
        req_of_token = np.repeat(np.arange(len(rows)), n_sched)
        positions = computed[req_of_token] + (np.arange(total) - np.repeat(cu - n_sched, n_sched))
        token_rows = rows[req_of_token]
        input_ids = b.token_ids[token_rows, positions].astype(np.int64)
        slots = b.block_table[token_rows, positions // self.block_size].astype(np.int64) * self.block_size \
            + positions % self.block_size
        rope_positions = positions
        if self.rope_long_switch is not None:
            length, offset = self.rope_long_switch
            rope_positions = positions + np.where(b.num_prompt_tokens[token_rows] > length, offset, 0)
        seq_lens = computed + n_sched
        qsl = np.zeros(len(rows) + 1, dtype=np.int64)
        qsl[1:] = cu
        block_table = b.block_table[rows, :int(cdiv(int(seq_lens.max()), self.block_size))]
        sample_idx = np.nonzero(seq_lens >= b.num_tokens[rows])[0]
        # Tokens each sampling request samples: 1 (k + 1 once k draft tokens are verified).
        n_sample = np.ones(len(sample_idx), dtype=np.int64)
        if self.spec_state is not None and self.spec_state.drafts:
            n_sample += self.spec_state.num_drafts(req_ids, sample_idx)
        fixup = self.pending.sources(input_ids, token_rows, positions)
        groups = None if self.group_tables is None else self.group_tables.step_tables(
            rows, token_rows, positions, block_table.shape[1])
        return StepInputs(req_ids, rows, n_sched, computed, qsl, input_ids, rope_positions, slots, seq_lens,
                          block_table, sample_idx, n_sample, fixup, groups)

    def _forward_graph(self, sched: SchedulerOutput, inp: StepInputs) -> StepState | None:
        """Run the step through a captured graph (its first kernel takes the inputs from the host ring); None when
        none applies (the eager path then runs the same inputs)."""
        cg = self.cuda_graphs
        if cg is None or self.pooler is not None:
            return None
        state_slots = None
        if self.state_cache is not None:
            # A recurrent layer's graph continues every row from its slot's state: a request's first token (no
            # state yet) or a prefill chunk runs eagerly.
            if not inp.one_token_each or not (inp.computed > 0).all() or sched.state_saves:
                return None
            state_slots = inp.rows
        n, total = len(inp.rows), len(inp.input_ids)
        # Prompt logprobs need every token's hidden state; a mixed graph returns only each request's last.
        wants_prompt_lp = bool(self.prompt_logprobs) and any(r in self.prompt_logprobs for r in inp.req_ids)
        fix_src = None
        if inp.fixup is not None:  # the graph fills these ids from cuda_graphs.prev_sampled itself
            fix_src = np.full(total, -1, dtype=np.int64)
            fix_src[inp.fixup[0]] = inp.fixup[1]
        race = None
        if not sched.grammar_req_ids and len(inp.sample_idx) == n and cg.can_sample(n, total):
            # Every row plain temperature sampling: the (small) decode graph draws the tokens itself.
            race = self.sampling.plain_race_inputs(inp.rows, self.batch.num_prompt_tokens, self.batch.num_tokens)
        key = cg.load(inp.input_ids, inp.rope_positions, inp.slots, inp.qsl, inp.seq_lens, inp.block_table,
                      allow_mixed=not wants_prompt_lp and inp.one_token_each, fix_src=fix_src, race=race,
                      state_slots=state_slots, groups=inp.groups)
        if key is None:
            return None
        TIMER.count("graph_steps" if key.q else "mixed_graph_steps")
        logits = cg.run(key, n)
        # A uniform graph returns every token's logits, a mixed one each request's last: keep the sampled ones
        # (a chunk that does not end its prompt samples nothing). With one token per request (q <= 1) a token's
        # row is its request's.
        if len(inp.sample_idx) != n or key.q > 1:
            sel = inp.sample_idx if key.q <= 1 else inp.sample_token_index()
            if len(sel) != logits.shape[0]:
                logits = logits[to_device(sel, self.device)]
        graph_sampled = race is not None
        return StepState(inp.req_ids, inp.rows, inp.sample_idx, inp.n_sample, logits, None, None, graph_sampled,
                         cg.last_io_slot if graph_sampled else None)

    def _forward_eager(self, inp: StepInputs, state_saves: dict | None = None) -> StepState | None:
        """Run the step op by op; None on a pipeline stage that is not the last (it sends its hidden states on).
        state_saves: the scheduler's recurrent-state checkpoints for this step (hybrid models)."""
        TIMER.count("eager_steps")
        dev, total = self.device, len(inp.input_ids)
        md = AttentionMetadata(
            num_actual_tokens=total, slot_mapping=to_device(inp.slots, dev),
            query_start_loc=to_device(inp.qsl.astype(np.int32), dev),
            seq_lens=to_device(inp.seq_lens.astype(np.int32), dev),
            block_table=to_device(inp.block_table, dev),
            max_query_len=int(inp.n_sched.max()), max_seq_len=int(inp.seq_lens.max()),
            query_start_loc_cpu=inp.qsl, seq_lens_cpu=inp.seq_lens)
        ids_t = to_device(inp.input_ids, dev)
        if inp.fixup is not None:
            idx = to_device(inp.fixup, dev)
            ids_t.index_copy_(0, idx[0], self._prev_sampled.index_select(0, idx[1]))
        inter = None if self.is_first_stage else self.link.recv(total)
        layer_md = None if inp.groups is None else self.group_tables.metadata(md, inp.groups, dev)
        recurrent = None
        if self.state_cache is not None:
            saves = {i: state_saves[rid] for i, rid in enumerate(inp.req_ids) if state_saves and rid in state_saves}
            recurrent = self.state_cache.step(inp.rows, inp.qsl, inp.computed, saves)
        with set_forward_context(md, self.kv_caches, layer_md, recurrent=recurrent):
            model = self.model if self.compiled is None else self.compiled
            hidden = model(ids_t, to_device(inp.rope_positions, dev), inter)
        if not self.is_last_stage:
            self.link.send(hidden)  # returns at once: the next stage takes it from here
            return None
        prompt_lp = prompt_logprobs(self.model, self.batch, self.prompt_logprobs, inp, hidden, self.device)
        if self.pooler is not None:
            return StepState(inp.req_ids, inp.rows, inp.sample_idx, inp.n_sample, None, prompt_lp,
                             self._pool(inp, hidden))
        logits = None
        if len(inp.sample_idx):
            logits = self.model.compute_logits(hidden[to_device(inp.sample_token_index(), dev)])
        return StepState(inp.req_ids, inp.rows, inp.sample_idx, inp.n_sample, logits, prompt_lp)

    def _pool(self, inp: StepInputs, hidden: torch.Tensor) -> torch.Tensor:
        """The pooled states of the requests whose prompt ends this step ([len(sample_idx), H] float32)."""
        b = self.batch
        if (inp.computed > 0).any() or (inp.seq_lens < b.num_prompt_tokens[inp.rows]).any():
            raise NotImplementedError("A pooling model needs each prompt computed in one step: chunked prefill and "
                                      "prefix-cache hits are not supported for pooling yet.")
        pooled = self.pooler(hidden[:len(inp.input_ids)], to_device(inp.qsl, self.device))
        return pooled if len(inp.sample_idx) == len(inp.rows) else pooled[to_device(inp.sample_idx, self.device)]

    @torch.inference_mode()
    def sample_tokens(self, grammar: GrammarOutput | None) -> AsyncRunnerOutput:
        """Mask constrained rows, sample (or hand on the pooled states), and start copying the ids to the host.
        The returned handle's `get()` waits for them. The sampled ids stay on the device so the next step can use
        them as inputs before the host sees them (the batch holds a placeholder -1 until then)."""
        st = self._step
        self._step = None
        if st is None:
            return AsyncRunnerOutput.empty()
        if self._last_output is not None:
            self._last_output.get()  # the previous step's tokens must be on the host (penalties read them)
        if st.pooled is not None:
            result = self._last_output = AsyncRunnerOutput(None, st, pooled=st.pooled)
            return result
        if self._verify:
            result = self._last_output = AsyncRunnerOutput.ready(self._sample_and_verify(st, grammar))
            return result
        sampled, lp, ids_host, placed = None, None, None, None
        if len(st.sample_idx):
            sampled, lp, ids_host = self._sample(st, grammar)
            placed = self.pending.record(st.rows[st.sample_idx], st.n_sample)
            self._prev_sampled = sampled
        if ids_host is None and sampled is not None and self._ids_host:
            self._ids_host_i = (self._ids_host_i + 1) % len(self._ids_host)
            ids_host = self._ids_host[self._ids_host_i][:len(sampled)]
            ids_host.copy_(sampled, non_blocking=True)
        result = self._last_output = AsyncRunnerOutput(self.pending, st, placed, sampled, lp, ids_host)
        return result

    def _sample(self, st: StepState, grammar: GrammarOutput | None):
        """(sampled ids [sum(n_sample)] on the device, logprobs or None, the pinned host buffer the ids already go
        to or None)."""
        b, cg = self.batch, self.cuda_graphs
        srows = st.rows[st.sample_idx]
        if st.graph_sampled and grammar is None:
            # The decode graph drew them already (every row plain temperature sampling) and wrote them to the
            # host ring too.
            cg.sampled_replays += 1
            return cg.prev_sampled[:len(srows)], None, cg.host_io.out[st.io_slot, :len(srows)]
        if grammar is not None:
            apply_grammar(grammar, st.req_ids, st.sample_idx, st.n_sample, st.logits, self.device)
        offsets = None
        if len(st.logits) != len(srows):   # several tokens per request: one logits row each, RNG positions apart
            srows, offsets = runs(srows, st.n_sample)
        meta = self.sampling.make_metadata(srows, b.token_ids, b.num_prompt_tokens, b.num_tokens, offsets)
        out = self.sampler(st.logits, meta)
        if cg is not None:  # where the next step's graph reads its placeholder ids
            cg.prev_sampled[:len(out.sampled_token_ids)].copy_(out.sampled_token_ids)
        return out.sampled_token_ids, out.logprobs, None

    def _sample_and_verify(self, st: StepState, grammar: GrammarOutput | None) -> ModelRunnerOutput:
        """Speculative decoding's sample step: the target's draw at every verified position, the tokens kept
        (worker/spec_state.SpecDecodeState.accept) written into the batch, then the next step's drafts. Waits for the
        device (the drafts are made on the host from the kept tokens)."""
        b, spec = self.batch, self.spec_state
        sampled: list[list[int]] = [[] for _ in st.req_ids]
        logprobs, keep = None, np.zeros(0, dtype=np.int64)
        if len(st.sample_idx):
            ids, lp, _ = self._sample(st, grammar)
            n_sample = st.n_sample.astype(np.int64)
            with TIMER.phase("spec_wait_targets"):
                ids_host = ids.cpu().numpy()
            keep, targets = spec.accept(st.req_ids, st.sample_idx, n_sample, ids_host)
            run, offs = runs(np.cumsum(n_sample) - n_sample, keep)
            kept_at = run + offs                       # flat index of each kept token
            tokens = targets[kept_at]
            rows = st.rows[st.sample_idx]
            b.token_ids[np.repeat(rows, keep), np.repeat(b.num_tokens[rows].astype(np.int64), keep) + offs] = tokens
            b.num_tokens[rows] += keep.astype(np.int32)
            if lp is not None:
                sel = to_device(kept_at, lp.token_ids.device)
                logprobs = LogprobsTensors(lp.token_ids[sel], lp.logprobs[sel], lp.ranks[sel]).tolists()
            flat, ends = tokens.tolist(), np.cumsum(keep).tolist()
            for j, i in enumerate(st.sample_idx):
                sampled[i] = flat[ends[j] - int(keep[j]):ends[j]]
        # (a draft model catches up on prefill chunks too, so this runs on steps that sample nothing)
        with TIMER.phase("spec_propose"):
            next_drafts = spec.propose(b, st.req_ids, st.rows, st.sample_idx, keep, st.seq_lens, st.qsl)
        return ModelRunnerOutput(req_ids=st.req_ids, sampled_token_ids=sampled, logprobs=logprobs,
                                 prompt_logprobs=st.prompt_lp, spec_token_ids=next_drafts)
