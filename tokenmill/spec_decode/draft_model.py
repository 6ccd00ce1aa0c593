"""The draft-model drafter: a smaller model with the target's vocabulary proposes k tokens greedily.

The draft's KV lives in cache tensors of its own that share the target's block ids and slot mapping: every position
the target holds a block for, the draft holds one too, so nothing is allocated for it apart from those tensors (the
scheduler reserves k slots past each step for the drafts' KV, see Scheduler._lookahead).

After each step the drafter catches up: it runs the tokens its cache has not seen (a prefill chunk, or the newly
accepted tokens plus the bonus token) in one varlen forward, whose last position gives draft 1, then k - 1 one-token
steps give drafts 2..k. Drafts 1..k-1 are written into the cache as they are fed, so the accepted ones need no
recomputing: per row, `valid` counts the positions whose draft KV matches the request's tokens and `ahead` the
drafted positions past it that hold the draft's own guesses, which become valid as the target accepts them.
A stale or skipped draft KV only lowers acceptance: verification keeps exactly the target's own tokens.

Rows in steady decoding (at most two tokens to catch up) propose through spec_decode/draft_graph.py: the catch-up
and the k - 1 steps in one CUDA graph replay. Others (a prompt just finished, a row that fell behind) run the
eager path above.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import torch

from tokenmill.attention import kv_cache_memory
from tokenmill.attention.backend import AttentionMetadata
from tokenmill.core.kv_cache_manager import cdiv
from tokenmill.forward_context import set_forward_context
from tokenmill.logger import init_logger
from tokenmill.spec_decode.proposer import DraftStep, Proposer

logger = init_logger(__name__)


def to_device(x: np.ndarray, device: torch.device) -> torch.Tensor:
    """A host array on `device` (staged in pinned memory on CUDA, so the copy does not wait for queued work)."""
    t = torch.from_numpy(x)
    return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t


class _DraftEngineConfig:
    """The two parts of a TokenmillConfig that models/loader.load_model reads, for the draft."""

    def __init__(self, model_config, load_config) -> None:
        self.model_config, self.load_config = model_config, load_config


class DraftModelProposer(Proposer):
    """Greedy drafts from a draft model run in the target's block tables.

    Contract beyond Proposer's: `load_model` before `initialize_kv_cache`; rows are the runner's InputBatch rows.
    Rows whose drafts would pass the draft's context (`draft max_model_len`) get none; the draft's catch-up per
    call is at most `max_num_batched_tokens` tokens (rows left behind catch up on later calls, without drafts
    meanwhile).
    """
    has_model = True

    def __init__(self, config, device: torch.device, kv_dtypes: dict) -> None:
        spec = config.speculative_config
        self.mc = spec.draft_model_config
        self.device = device
        self.dtype = self.mc.get_torch_dtype(device)
        self.kv_dtype = kv_dtypes.get(config.cache_config.kv_cache_dtype, self.dtype)
        load = config.load_config
        self.load_config = dataclasses.replace(load, load_format="dummy" if load.load_format == "dummy" else "auto")
        self.max_len = self.mc.max_model_len
        self.budget = config.scheduler_config.max_num_batched_tokens
        self.k = spec.num_speculative_tokens
        self.vocab = min(self.mc.vocab_size, config.model_config.vocab_size)
        self.model = None
        self.kv_caches: list[torch.Tensor] = []
        self.graphs = None  # a DraftProposalGraphs once the cache exists (graph_sizes given)

    # ----- set-up -----
    def load_model(self, backend_cls: type, target=None) -> None:
        from tokenmill.distributed import get_parallel_state, kv_heads_per_rank
        from tokenmill.models.loader import load_model
        self.model = load_model(_DraftEngineConfig(self.mc, self.load_config), self.device, backend_cls)
        if getattr(self.model, "rope_long_switch", None) is not None:
            raise ValueError(f"--speculative-config: the draft {self.mc.architecture} switches RoPE tables by "
                             "prompt length (LongRoPE or dynamic NTK scaling), which a draft model does not support yet.")
        text = self.mc.get_text_config()
        self.num_layers = text.num_hidden_layers
        self.num_kv_heads = kv_heads_per_rank(getattr(text, "num_key_value_heads", None) or text.num_attention_heads,
                                              get_parallel_state().tp_size)
        self.head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
        self.backend_cls = backend_cls

    def kv_cache_bytes_per_block(self, block_size: int) -> int:
        elem = torch.empty((), dtype=self.kv_dtype).element_size()
        return 2 * self.num_layers * block_size * self.num_kv_heads * self.head_dim * elem

    def initialize_kv_cache(self, num_blocks: int, block_size: int, max_num_reqs: int,
                            graph_sizes: list[int] | None = None, max_model_len: int = 0) -> None:
        """graph_sizes: batch sizes to capture the steady-state proposal for (CUDA graphs; None: eager)."""
        # One block more than the target's: the scratch block, where rows write positions that have no block
        # (drafts past their allocation near max_model_len), never read back as valid.
        self.block_size, self.scratch = block_size, num_blocks
        shape = self.backend_cls.kv_cache_shape(num_blocks + 1, block_size, self.num_kv_heads, self.head_dim)
        self.kv_caches = [kv_cache_memory.zeros(shape, self.kv_dtype, self.device)
                          for _ in range(self.num_layers)]
        self.valid = np.zeros(max_num_reqs, dtype=np.int64)
        self.ahead = np.zeros(max_num_reqs, dtype=np.int64)
        if graph_sizes:
            self.use_proposal_graphs(graph_sizes, cdiv(max_model_len, block_size), capture=True)

    def use_proposal_graphs(self, sizes: list[int], max_blocks: int, capture: bool) -> None:
        """Propose for steady-state rows through draft_graph.DraftProposalGraphs (capture=False: its body runs
        eagerly, as on the CPU)."""
        from tokenmill.spec_decode.draft_graph import DraftProposalGraphs
        self.graphs = DraftProposalGraphs(self.model, self.kv_caches, sizes, self.k, self.block_size, max_blocks,
                                          self.max_len, self.scratch, self.vocab, self.device, capture)

    @torch.inference_mode()
    def profile_run(self, num_tokens: int) -> None:
        ids = torch.zeros(num_tokens, dtype=torch.long, device=self.device)
        with set_forward_context(None, []):
            hidden = self.model(ids, ids, None)
            self.model.compute_logits(hidden[-1:])

    # ----- per request -----
    def add_request(self, req_id: str, row: int, num_computed: int) -> None:
        # A prefix hit's blocks hold the draft KV of the request that filled them (the drafter caught up on it).
        self.valid[row], self.ahead[row] = num_computed, 0

    # ----- one step -----
    @torch.inference_mode()
    def propose_batch(self, batch, step: DraftStep) -> list[list[int]]:
        rows, k = step.rows, step.k
        out: list[list[int]] = [[] for _ in range(len(rows))]
        valid, ahead = self.valid, self.ahead
        # Drafts the target accepted were fed to the draft already: their KV stands.
        valid[rows] += np.minimum(step.accepted, ahead[rows])
        ahead[rows] = 0
        ends = np.minimum(step.ends.astype(np.int64), self.max_len)
        need = np.maximum(ends - valid[rows], 0)
        # Within the budget, in batch order; a row cut short catches up later.
        take = np.minimum(need, np.maximum(self.budget - (np.cumsum(need) - need), 0))
        n_tok = batch.num_tokens[rows].astype(np.int64)
        propose = (step.propose & (take == need) & (step.ends <= self.max_len) & (n_tok + k - 1 <= self.max_len))
        fast = np.zeros(len(rows), dtype=bool)
        if self.graphs is not None:
            fast = propose & (need <= 2) & (n_tok >= 2)
            if fast.sum() > self.graphs.max_size:
                fast &= np.cumsum(fast) <= self.graphs.max_size
        run = np.flatnonzero((take > 0) & ~fast)
        if len(run):
            first = self._catch_up(batch, rows[run], valid[rows[run]], take[run], propose[run])
            valid[rows[run]] += take[run]
            sel = run[propose[run]]
            if len(sel):
                self._collect(out, sel, self._decode(batch, rows[sel], first, k))
        sel = np.flatnonzero(fast)
        if len(sel):
            r = rows[sel]
            drafts = self.graphs.propose(batch, r)
            valid[r] = n_tok[sel]
            self.ahead[r] = self._ahead(batch, r, n_tok[sel], k)
            self._collect(out, sel, drafts)
        return out

    @staticmethod
    def _collect(out: list[list[int]], sel: np.ndarray, drafts: np.ndarray) -> None:
        for i, d in zip(sel.tolist(), drafts.tolist()):
            out[i] = d

    def _ahead(self, batch, rows: np.ndarray, base: np.ndarray, k: int) -> np.ndarray:
        """Drafted positions (from `base`, draft 1's) whose KV went into the rows' own blocks."""
        return np.clip(batch.num_blocks[rows].astype(np.int64) * self.block_size - base, 0, k - 1)

    def _catch_up(self, batch, rows, starts, counts, want) -> torch.Tensor:
        """Run positions [starts, starts + counts) of each row; the greedy next token after the rows in `want`."""
        cu = np.cumsum(counts)
        total = int(cu[-1])
        tok_row = np.repeat(np.arange(len(rows)), counts)
        pos = starts[tok_row] + (np.arange(total) - np.repeat(cu - counts, counts))
        r = rows[tok_row]
        ids = batch.token_ids[r, pos].astype(np.int64)
        qsl = np.zeros(len(rows) + 1, dtype=np.int64)
        qsl[1:] = cu
        seq_lens = starts + counts
        last = cu[want] - 1
        return self._forward(batch, rows, ids, pos, self._slots(batch, r, pos), qsl, seq_lens, last)

    def _decode(self, batch, rows, first: torch.Tensor, k: int) -> np.ndarray:
        """k drafts per row: `first`, then k - 1 one-token steps feeding each draft back; [len(rows), k] on the host
        (one wait for the device)."""
        n = len(rows)
        drafts = [first]
        base = batch.num_tokens[rows].astype(np.int64)  # draft 1 sits at this position
        qsl = np.arange(n + 1, dtype=np.int64)
        for i in range(k - 1):
            pos = base + i
            drafts.append(self._forward(batch, rows, None, pos, self._slots(batch, rows, pos), qsl, pos + 1,
                                        np.arange(n), ids_t=drafts[-1]))
        self.ahead[rows] = self._ahead(batch, rows, base, k)
        return torch.stack(drafts, dim=1).cpu().numpy()

    def _slots(self, batch, rows: np.ndarray, pos: np.ndarray) -> np.ndarray:
        return kv_slots(batch, rows, pos, self.block_size, self.scratch)

    def _forward(self, batch, rows, ids, pos, slots, qsl, seq_lens, last, ids_t=None) -> torch.Tensor:
        dev = self.device
        md = draft_metadata(batch, rows, slots, qsl, seq_lens, self.block_size, dev)
        if ids_t is None:
            ids_t = to_device(ids, dev)
        with set_forward_context(md, self.kv_caches):
            hidden = self.model(ids_t, to_device(pos.astype(np.int64), dev), None)
        logits = self.model.compute_logits(hidden[to_device(np.asarray(last, dtype=np.int64), dev)])
        return logits[:, :self.vocab].argmax(dim=-1)


def kv_slots(batch, rows: np.ndarray, pos: np.ndarray, block_size: int, scratch: int) -> np.ndarray:
    """The KV slot of each (row, position) in the target's block tables; positions past a row's blocks go to the
    drafter's scratch block."""
    col = pos // block_size
    held = col < batch.num_blocks[rows]
    block = np.where(held, batch.block_table[rows, np.minimum(col, batch.block_table.shape[1] - 1)], scratch)
    return block.astype(np.int64) * block_size + pos % block_size


def draft_metadata(batch, rows: np.ndarray, slots: np.ndarray, qsl: np.ndarray, seq_lens: np.ndarray,
                   block_size: int, dev: torch.device) -> AttentionMetadata:
    """Attention metadata of a drafter's varlen forward over the rows' block tables."""
    width = int(cdiv(int(seq_lens.max()), block_size))
    table = batch.block_table[rows, :width] if width <= batch.block_table.shape[1] else np.pad(
        batch.block_table[rows], ((0, 0), (0, width - batch.block_table.shape[1])))
    q_lens = np.diff(qsl)
    return AttentionMetadata(
        num_actual_tokens=len(slots), slot_mapping=to_device(slots, dev),
        query_start_loc=to_device(qsl.astype(np.int32), dev), seq_lens=to_device(seq_lens.astype(np.int32), dev),
        block_table=to_device(np.ascontiguousarray(table), dev), max_query_len=int(q_lens.max()),
        max_seq_len=int(seq_lens.max()), query_start_loc_cpu=qsl, seq_lens_cpu=seq_lens)
