"""The model runner: turns a SchedulerOutput into model inputs, runs the forward pass and samples."""
from __future__ import annotations

import numpy as np
import torch

from tokenmill import envs
from tokenmill.attention.backend import AttentionMetadata
from tokenmill.attention.registry import get_attention_backend
from tokenmill.config import TokenmillConfig
from tokenmill.core.kv_cache_manager import cdiv
from tokenmill.core.messages import LogprobsLists
from tokenmill.core.sched_output import GrammarOutput, ModelRunnerOutput, SchedulerOutput
from tokenmill.distributed import get_parallel_state, kv_heads_per_rank
from tokenmill.distributed.pp import StageLink, pp_layer_range
from tokenmill.forward_context import set_forward_context
from tokenmill.layers.sampler import LogprobsTensors, Sampler, compute_prompt_logprobs
from tokenmill.metrics.step_timing import TIMER
from tokenmill.models.loader import load_model
from tokenmill.worker.input_batch import InputBatch
from tokenmill.worker.sampling_state import SamplingState
from tokenmill.worker.transfer import to_device, to_host

_KV_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "fp8": torch.float8_e4m3fn,
              "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


class ModelRunner:
    """Owns the model, its KV cache and the persistent per-request input state.

    Per step: forget finished requests, add new ones, append new blocks, build flat inputs with numpy gathers, run
    the model, sample the requests whose known tokens are all computed, and append the sampled ids. The only
    device->host sync is the one that returns sampled ids.

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
        self._step: _StepState | None = None           # between execute_model and sample_tokens
        self._last_output: AsyncRunnerOutput | None = None
        self._prev_sampled: torch.Tensor | None = None  # the last step's sampled ids, on the device
        self._prev_index = np.zeros(self.max_num_reqs, dtype=np.int64)  # row -> index in _prev_sampled
        self._prev_gen = np.full(self.max_num_reqs, -1, dtype=np.int64)  # row generation when it sampled
        # Pinned host buffers the sampled ids are copied into, in turn (a fresh pinned tensor per step costs a
        # caching-allocator round trip). A buffer is reused three steps later: by then the runner has taken that
        # step's ids (`sample_tokens` calls the previous output's get() first).
        self._ids_host = [torch.empty(self.max_num_reqs, dtype=torch.long, pin_memory=True) for _ in range(3)] \
            if device.type == "cuda" else []
        self._ids_host_i = 0

    # ----- set-up -----
    def load_model(self) -> None:
        self.model = load_model(self.config, self.device, self.backend_cls)
        # (prompt length, position offset): requests with longer prompts read the second RoPE table (LongRoPE).
        self.rope_long_switch: tuple[int, int] | None = getattr(self.model, "rope_long_switch", None)
        text = self.config.model_config.get_text_config()
        ps = self.parallel = get_parallel_state()  # called inside the worker's use_parallel_state
        self.is_first_stage, self.is_last_stage = ps.pp_rank == 0, ps.pp_rank == ps.pp_size - 1
        self.num_layers = text.num_hidden_layers
        self.own_layers = range(*pp_layer_range(self.num_layers, ps.pp_rank, ps.pp_size))
        self.link = StageLink(ps, text.hidden_size, self.dtype, self.device) if ps.pp_size > 1 else None
        self.num_kv_heads = kv_heads_per_rank(  # this rank's share of the KV heads: its cache holds only those
            getattr(text, "num_key_value_heads", None) or text.num_attention_heads, ps.tp_size)
        self.head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads

    def kv_cache_bytes_per_block(self) -> int:
        elem = torch.empty((), dtype=self.kv_dtype).element_size()
        return 2 * len(self.own_layers) * self.block_size * self.num_kv_heads * self.head_dim * elem

    def initialize_kv_cache(self, num_blocks: int) -> None:
        shape = self.backend_cls.kv_cache_shape(num_blocks, self.block_size, self.num_kv_heads, self.head_dim)
        # Indexed by global layer; other stages' layers get an empty stand-in (they never run here).
        self.kv_caches = [torch.zeros(shape, dtype=self.kv_dtype, device=self.device) if i in self.own_layers
                          else torch.empty(0, dtype=self.kv_dtype, device=self.device)
                          for i in range(self.num_layers)]
        self.batch = InputBatch(self.max_num_reqs, self.max_model_len, cdiv(self.max_model_len, self.block_size))
        self.sampling = SamplingState(self.max_num_reqs, self.vocab_size, self.device,
                                      global_seed=self.config.model_config.seed,
                                      logprobs_mode=self.config.model_config.logprobs_mode)
        self.cuda_graphs = None
        if self.use_cuda_graphs():
            from tokenmill.worker.cuda_graph import CudaGraphRunner
            cc = self.config.compilation_config
            sizes = cc.capture_sizes(self.max_num_reqs)
            mixed = cc.mixed_capture_sizes(self.config.scheduler_config.max_num_batched_tokens, self.max_num_reqs)
            self.cuda_graphs = CudaGraphRunner(self.model, self.kv_caches, sizes, self.max_model_len,
                                               cdiv(self.max_model_len, self.block_size), self.device,
                                               mixed_sizes=mixed,
                                               prev_sampled=torch.zeros(self.max_num_reqs, dtype=torch.long,
                                                                        device=self.device))
            self.cuda_graphs.capture()

    def cuda_graph_output_bytes(self) -> int:
        """Device memory the CUDA graphs will keep for their logits (allocated after the KV cache is sized)."""
        if not self.use_cuda_graphs():
            return 0
        rows = self.config.compilation_config.graph_output_rows(
            self.max_num_reqs, self.config.scheduler_config.max_num_batched_tokens)
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

    # ----- one step -----
    def _update_states(self, sched: SchedulerOutput) -> None:
        b = self.batch
        for rid in sched.finished_req_ids:
            row = b.remove(rid)
            if row is not None:
                self.sampling.remove_request(row)
            self.prompt_logprobs.pop(rid, None)
        for new in sched.scheduled_new_reqs:
            row = b.add(new.req_id, new.prompt_token_ids, new.output_token_ids, new.block_ids,
                        new.num_computed_tokens)
            self.sampling.add_request(row, new.sampling_params)
            if new.sampling_params.prompt_logprobs is not None:
                self.prompt_logprobs[new.req_id] = new.sampling_params.prompt_logprobs
        c = sched.scheduled_cached_reqs
        for rid, blocks, num_computed in zip(c.req_ids, c.new_block_ids, c.num_computed_tokens):
            row = b.req_id_to_row[rid]
            b.append_blocks(row, blocks)
            b.num_computed_tokens[row] = num_computed
        if c.new_token_ids and not self.is_last_stage:
            # Tokens the last stage sampled since this request last ran (only it sampled them).
            for rid, toks in zip(c.req_ids, c.new_token_ids):
                if toks:
                    row, n = b.req_id_to_row[rid], len(toks)
                    b.token_ids[row, b.num_tokens[row]:b.num_tokens[row] + n] = toks
                    b.num_tokens[row] += n

    @torch.inference_mode()
    def execute_model(self, sched: SchedulerOutput) -> None:
        """Apply the plan's state changes, build the inputs and launch the forward pass (and the logits of the rows
        that sample). Nothing waits for the device; `sample_tokens` finishes the step."""
        self._update_states(sched)
        self._step = None
        if sched.is_empty:
            return
        b, dev = self.batch, self.device
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
        fixup = self._placeholder_fixup(input_ids, token_rows)
        prompt_lp: dict[str, LogprobsLists] = {}
        graph, graph_sampled, io_slot = None, False, None
        if self.cuda_graphs is not None:
            # Prompt logprobs need every token's hidden state; a mixed graph returns only each request's last.
            wants_prompt_lp = bool(self.prompt_logprobs) and any(r in self.prompt_logprobs for r in req_ids)
            fix_src = None
            if fixup is not None:  # the graph fills these ids from cuda_graphs.prev_sampled itself
                fix_src = np.full(total, -1, dtype=np.int64)
                fix_src[fixup[0]] = fixup[1]
            race = None
            if (not sched.grammar_req_ids and len(sample_idx) == len(rows)
                    and self.cuda_graphs.can_sample(len(rows), total)):
                # Every row plain temperature sampling: the (small) decode graph draws the tokens itself.
                race = self.sampling.plain_race_inputs(rows, b.num_prompt_tokens, b.num_tokens)
            graph = self.cuda_graphs.load(input_ids, rope_positions, slots, qsl, seq_lens, block_table,
                                          allow_mixed=not wants_prompt_lp, fix_src=fix_src, race=race)
            graph_sampled = race is not None and graph is not None and not graph[0]
            io_slot = self.cuda_graphs.last_io_slot if graph is not None else None
        if graph is not None:
            # The graph returns the logits of every request's last token (a chunk that does not end its prompt
            # samples nothing, so keep only the rows that do).
            TIMER.count("mixed_graph_steps" if graph[0] else "graph_steps")
            logits = self.cuda_graphs.run(graph, len(rows))
            if len(sample_idx) != len(rows):
                logits = logits[to_device(sample_idx, dev)]
        else:
            TIMER.count("eager_steps")
            md = AttentionMetadata(
                num_actual_tokens=total, slot_mapping=to_device(slots, dev),
                query_start_loc=to_device(qsl.astype(np.int32), dev),
                seq_lens=to_device(seq_lens.astype(np.int32), dev),
                block_table=to_device(block_table, dev),
                max_query_len=int(n_sched.max()), max_seq_len=int(seq_lens.max()),
                query_start_loc_cpu=qsl, seq_lens_cpu=seq_lens)
            ids_t = to_device(input_ids, dev)
            if fixup is not None:
                self._apply_fixup(ids_t, fixup)
            inter = None if self.is_first_stage else self.link.recv(total)
            with set_forward_context(md, self.kv_caches):
                hidden = self.model(ids_t, to_device(rope_positions, dev), inter)
            if not self.is_last_stage:
                self.link.send(hidden)  # returns at once: the next stage takes it from here
                return
            prompt_lp = self._prompt_logprobs(req_ids, rows, computed, n_sched, qsl, hidden)
            logits = None
            if len(sample_idx):
                logits = self.model.compute_logits(hidden[to_device(cu[sample_idx] - 1, dev)])
        self._step = _StepState(req_ids, rows, sample_idx, logits, prompt_lp, graph_sampled, io_slot)

    @torch.inference_mode()
    def sample_tokens(self, grammar: GrammarOutput | None) -> "AsyncRunnerOutput":
        """Mask constrained rows, sample, and start copying the ids to the host. The returned handle's `get()`
        waits for them. The sampled ids stay on the device so the next step can use them as inputs before the
        host sees them (the host records a placeholder -1 until then)."""
        st, b = self._step, self.batch
        self._step = None
        if st is None:
            return AsyncRunnerOutput.empty()
        if self._last_output is not None:
            self._last_output.get()  # the previous step's tokens must be on the host (penalties read them)
        sampled, lp, srows, pos, gens = None, None, st.rows[st.sample_idx], None, None
        ids_host = None  # pinned host memory the ids are (or will be) in
        if len(st.sample_idx):
            if st.graph_sampled and grammar is None:
                # The decode graph drew them already (every row plain temperature sampling), and with host IO
                # also wrote them to pinned host memory.
                sampled = self.cuda_graphs.prev_sampled[:len(srows)]
                self.cuda_graphs.sampled_replays += 1
                if st.io_slot is not None:
                    ids_host = self.cuda_graphs.host_io.out[st.io_slot, :len(srows)]
            else:
                if grammar is not None:
                    self._apply_grammar(grammar, st.req_ids, st.sample_idx, st.logits)
                meta = self.sampling.make_metadata(srows, b.token_ids, b.num_prompt_tokens, b.num_tokens)
                out = self.sampler(st.logits, meta)
                sampled, lp = out.sampled_token_ids, out.logprobs
                if self.cuda_graphs is not None:  # where the next step's graph reads its placeholder ids
                    self.cuda_graphs.prev_sampled[:len(srows)].copy_(sampled)
            pos = b.num_tokens[srows].astype(np.int64)
            gens = b.row_gen[srows].copy()
            b.token_ids[srows, pos] = -1  # placeholder until get()
            b.num_tokens[srows] += 1
            self._prev_sampled = sampled
            self._prev_index[srows] = np.arange(len(srows))
            self._prev_gen[srows] = gens
        if ids_host is None and sampled is not None and self._ids_host:
            self._ids_host_i = (self._ids_host_i + 1) % len(self._ids_host)
            ids_host = self._ids_host[self._ids_host_i][:len(srows)]
            ids_host.copy_(sampled, non_blocking=True)
        result = AsyncRunnerOutput(self, st, srows, pos, gens, sampled, lp, ids_host)
        self._last_output = result
        return result

    def _placeholder_fixup(self, input_ids: np.ndarray, token_rows: np.ndarray) -> np.ndarray | None:
        """Input positions whose token is still being sampled by the previous step, and where that step's sampled
        tensor holds it: a [2, n] (destination, source) index array, or None."""
        ph = np.flatnonzero(input_ids < 0)
        if not len(ph):
            return None
        r = token_rows[ph]
        if (self._prev_gen[r] != self.batch.row_gen[r]).any():
            raise RuntimeError("a placeholder token does not come from the previous step")
        input_ids[ph] = 0
        return np.stack([ph, self._prev_index[r]])

    def _apply_fixup(self, ids_dev: torch.Tensor, fixup: np.ndarray) -> None:
        idx = to_device(fixup, self.device)
        ids_dev.index_copy_(0, idx[0], self._prev_sampled.index_select(0, idx[1]))

    def _apply_grammar(self, grammar: GrammarOutput, req_ids: list[str], sample_idx: np.ndarray,
                       logits: torch.Tensor) -> None:
        """Mask the logits of constrained rows with their grammars' allowed tokens, for the batch at once."""
        from tokenmill.kernels.triton_bitmask import apply_bitmask
        pos = {req_ids[i]: j for j, i in enumerate(sample_idx)}
        rows = np.fromiter((pos[rid] for rid in grammar.req_ids), dtype=np.int64, count=len(grammar.req_ids))
        # One row per sampled request, covering every logits column: the scheduler's rows where constrained
        # (columns past the grammar's vocabulary disallowed), all ones elsewhere.
        # Built with numpy: torch's CPU ops on a tensor this size (32 rows x 49k tokens) fan out to its OpenMP
        # threads and took ~1.6 ms each on the H200 host.
        compact = grammar.bitmask.numpy() if isinstance(grammar.bitmask, torch.Tensor) else grammar.bitmask
        words = -(-logits.shape[1] // 32)
        full = np.full((logits.shape[0], words), -1, dtype=np.int32)
        w = min(compact.shape[1], words)
        full[rows, :w] = compact[:, :w]
        full[rows, w:] = 0
        apply_bitmask(logits, to_device(full, self.device), rows)

    def _prompt_logprobs(self, req_ids, rows, computed, n_sched, qsl, hidden) -> dict[str, LogprobsLists]:
        """Logprobs of the prompt tokens covered by this step's chunk (position p scores prompt token p + 1)."""
        if not self.prompt_logprobs:
            return {}
        b, out = self.batch, {}
        for i, rid in enumerate(req_ids):
            n = self.prompt_logprobs.get(rid)
            if n is None:
                continue
            row, start = rows[i], int(computed[i])
            end = min(start + int(n_sched[i]), int(b.num_prompt_tokens[row]) - 1)
            if end <= start:
                continue
            h = hidden[int(qsl[i]):int(qsl[i]) + (end - start)]
            targets = to_device(b.token_ids[row, start + 1:end + 1].astype(np.int64), self.device)
            lp = compute_prompt_logprobs(self.model.compute_logits(h), targets, n)
            out[rid] = lp.tolists()
        return out


class _StepState:
    """What execute_model leaves for sample_tokens (graph_sampled: the decode graph drew the tokens; io_slot: the
    host-IO slot that graph wrote them to, or None)."""
    __slots__ = ("req_ids", "rows", "sample_idx", "logits", "prompt_lp", "graph_sampled", "io_slot")

    def __init__(self, req_ids, rows, sample_idx, logits, prompt_lp, graph_sampled=False, io_slot=None) -> None:
        self.req_ids, self.rows, self.sample_idx, self.logits, self.prompt_lp, self.graph_sampled = \
            req_ids, rows, sample_idx, logits, prompt_lp, graph_sampled
        self.io_slot = io_slot


class AsyncRunnerOutput:
    """One step's result while its sampled ids travel to the host.

    Contract: `get()` waits for the copy (the step's one device->host sync), writes the ids over the runner's -1
    placeholders (rows whose request left meanwhile are skipped by their generation counter) and returns the
    ModelRunnerOutput. It is idempotent; the runner calls it itself before sampling the next step.
    """

    def __init__(self, runner: ModelRunner | None, st: _StepState | None, srows=None, pos=None, gens=None,
                 sampled: torch.Tensor | None = None, logprobs: LogprobsTensors | None = None,
                 sampled_host: torch.Tensor | None = None) -> None:
        """sampled_host: a pinned buffer the copy of `sampled` is already queued into (else one is made here)."""
        self._runner, self._st, self._srows, self._pos, self._gens = runner, st, srows, pos, gens
        self._result: ModelRunnerOutput | None = None
        self._event = None
        self._ids = sampled_host if sampled_host is not None else (
            to_host(sampled) if sampled is not None else None)
        self._lp = None if logprobs is None else LogprobsTensors(
            to_host(logprobs.token_ids), to_host(logprobs.logprobs), to_host(logprobs.ranks))
        if sampled is not None and sampled.is_cuda:
            self._event = torch.cuda.Event()
            self._event.record()

    @classmethod
    def empty(cls) -> "AsyncRunnerOutput":
        out = cls(None, None)
        out._result = ModelRunnerOutput(req_ids=[], sampled_token_ids=[])
        return out

    def get(self) -> ModelRunnerOutput:
        if self._result is not None:
            return self._result
        if self._event is not None:
            with TIMER.phase("wait_for_sampled_ids"):
                self._event.synchronize()
        st = self._st
        sampled: list[list[int]] = [[] for _ in st.req_ids]
        logprobs = None
        if self._ids is not None:
            ids = self._ids.tolist()
            b = self._runner.batch
            valid = b.row_gen[self._srows] == self._gens
            b.token_ids[self._srows[valid], self._pos[valid]] = np.asarray(ids, dtype=np.int32)[valid]
            for j, i in enumerate(st.sample_idx):
                sampled[i] = [ids[j]]
            if self._lp is not None:  # one row per sampled token, in request order: already the output's layout
                logprobs = self._lp.tolists()
        self._result = ModelRunnerOutput(req_ids=st.req_ids, sampled_token_ids=sampled, logprobs=logprobs,
                                         prompt_logprobs=st.prompt_lp)
        self._runner = self._st = self._ids = self._lp = None
        return self._result
