"""The EAGLE drafter: an EAGLE-1 / EAGLE-3 head (models/llama_eagle.py) proposes k tokens greedily from the target's
hidden states.

The head's input at draft position j is (token j + 1, a hidden state for position j): the target's (its final
hidden state for EAGLE-1, its auxiliary layers' for EAGLE-3) wherever the target has verified token j, else the
head's own output at j. The target hands its hidden states over through spec_decode/hidden_capture.py: its forward
writes them into a static buffer, row by row of the step's input, read here right after the step.

KV: as the draft model's (spec_decode/draft_model.py), in cache tensors of the head's own that share the target's
block ids and slot mapping (the scheduler reserves k slots past each step). After each step the head catches up on
every position the target ran whose next token is known (a prefill chunk's tokens; the last known token and the
accepted drafts of a decoding request) in one varlen forward, so every verified position's KV comes from the
target's hidden states, overwriting what the previous proposal wrote there from the head's own. The last of them
gives draft 1; then k - 1 one-token steps feed each draft and the head's output back.

What the target ran while the engine decoded without drafts (spec_decode/step_aside.py) is not seen by the head:
those positions keep stale KV, and a prefix hit keeps the KV the blocks' first request wrote (the last position
of a hit computed with that request's next token). Both only lower acceptance: verification keeps exactly the
target's tokens. The proposal runs eagerly (the draft model's CUDA-graph proposal is not used for EAGLE yet).
"""
from __future__ import annotations

import numpy as np
import torch

from tokenmill.attention import kv_cache_memory
from tokenmill.forward_context import set_forward_context
from tokenmill.logger import init_logger
from tokenmill.spec_decode.draft_model import draft_metadata, kv_slots, to_device
from tokenmill.spec_decode.proposer import DraftStep, Proposer

logger = init_logger(__name__)


class EagleProposer(Proposer):
    """Greedy drafts from an EAGLE head.

    Contract beyond Proposer's: `load_model(backend_cls, target)` before `initialize_kv_cache` (it attaches the
    hidden-state capture to the target, before the target's CUDA graphs are captured); `propose_batch` must run
    after the target's forward of the same step and before the next (it reads the capture buffer), and needs
    DraftStep's first / count / flat. Rows whose drafts would pass max_model_len get none.
    """
    has_model = True

    def __init__(self, config, device: torch.device, kv_dtypes: dict) -> None:
        spec = config.speculative_config
        self.head_cfg = spec.eagle_head
        self.device = device
        self.dtype = config.model_config.get_torch_dtype(device)
        self.kv_dtype = kv_dtypes.get(config.cache_config.kv_cache_dtype, self.dtype)
        self.dummy = config.load_config.load_format == "dummy"
        self.seed = config.model_config.seed
        self.max_len = config.model_config.max_model_len
        self.k = spec.num_speculative_tokens
        sc, cc = config.scheduler_config, config.compilation_config
        # The most tokens one target forward runs: a step's budget, or a captured graph's padded size.
        self.capture_rows = max(sc.max_num_batched_tokens, cc.max_cudagraph_capture_size or 512,
                                sc.max_num_seqs * (1 + self.k))
        self.model = None
        self.kv_caches: list[torch.Tensor] = []

    # ----- set-up -----
    def load_model(self, backend_cls: type, target=None) -> None:
        from tokenmill.config.spec_eagle import normalized_name
        from tokenmill.models.llama_eagle import Eagle3Head, EagleHead
        from tokenmill.models.loader import _default_dtype, _load_dummy
        from tokenmill.models.weight_mapping import process_weights_after_loading
        from tokenmill.spec_decode.hidden_capture import HiddenCapture
        hc, cfg = self.head_cfg, self.head_cfg.hf_config
        if target is None or not hasattr(target, "capture_hidden_states"):
            raise ValueError(f"--speculative-config: the target {type(target).__name__} cannot feed an EAGLE head "
                             "its hidden states.")
        with _default_dtype(self.dtype), torch.device(self.device):
            if hc.method == "eagle3":
                head = Eagle3Head(cfg, self.max_len, backend_cls, len(hc.aux_layer_ids), hc.draft_vocab_size,
                                  hc.has_fc_bias)
            else:
                head = EagleHead(cfg, self.max_len, backend_cls, hc.has_fc_bias)
        head.eval()
        if self.dummy:
            _load_dummy(head, self.seed)
        else:
            from tokenmill.models.weight_utils import iter_safetensors_weights, safetensors_files
            try:
                safetensors_files(hc.path)
            except FileNotFoundError as e:  # the published EAGLE-1 heads ship pytorch_model.bin
                raise ValueError(f"--speculative-config: the {hc.method} head {hc.path!r} has no safetensors "
                                 "weights; convert its .bin once: python -c \"import torch, safetensors.torch as s; "
                                 "s.save_file(torch.load('pytorch_model.bin', weights_only=True), "
                                 f"'model.safetensors')\" (in that directory). ({str(e).splitlines()[0]})") from None
            with torch.no_grad():
                loaded = head.load_weights((normalized_name(n), t) for n, t in
                                           iter_safetensors_weights(hc.path, use_tqdm=False))
            missing = head.own_weight_names(hc.has_embedding) - loaded
            if missing:
                raise ValueError(f"--speculative-config: the {hc.method} head {hc.path!r} lacks "
                                 f"{len(missing)} tensors, e.g. {sorted(missing)[:5]}.")
        head.share_target(target, hc.has_embedding or self.dummy)
        with torch.no_grad():
            process_weights_after_loading(head)
        self.model = head
        H = cfg.hidden_size
        self.capture = HiddenCapture(hc.aux_layer_ids, not hc.aux_layer_ids, self.capture_rows, H, self.dtype,
                                     self.device)
        target.capture_hidden_states(self.capture)
        attn = head.layers[0].self_attn
        self.num_kv_heads, self.head_dim = attn.num_kv_heads, attn.head_dim
        self.backend_cls = backend_cls
        logger.info("EAGLE head %s (%s%s) drafts %d tokens from the target's %s", hc.path, hc.method,
                    f", draft vocabulary {hc.draft_vocab_size}" if hc.method == "eagle3" else "", self.k,
                    f"layers {list(hc.aux_layer_ids)}" if hc.aux_layer_ids else "final hidden states")

    def kv_cache_bytes_per_block(self, block_size: int) -> int:
        elem = torch.empty((), dtype=self.kv_dtype).element_size()
        return 2 * block_size * self.num_kv_heads * self.head_dim * elem

    def initialize_kv_cache(self, num_blocks: int, block_size: int, max_num_reqs: int,
                            graph_sizes: list[int] | None = None, max_model_len: int = 0) -> None:
        # One block more than the target's: the scratch block for positions without a block (see draft_model).
        self.block_size, self.scratch = block_size, num_blocks
        shape = self.backend_cls.kv_cache_shape(num_blocks + 1, block_size, self.num_kv_heads, self.head_dim)
        self.kv_caches = [kv_cache_memory.zeros(shape, self.kv_dtype, self.device)]

    @torch.inference_mode()
    def profile_run(self, num_tokens: int) -> None:
        ids = torch.zeros(num_tokens, dtype=torch.long, device=self.device)
        hidden = self.model.combine(self.capture.buffer[:num_tokens])
        with set_forward_context(None, []):
            out, _ = self.model(ids, ids, hidden)
            self.model.compute_logits(out[-1:])

    # ----- one step -----
    @torch.inference_mode()
    def propose_batch(self, batch, step: DraftStep) -> list[list[int]]:
        rows, k = step.rows, step.k
        out: list[list[int]] = [[] for _ in range(len(rows))]
        if step.first is None or not len(rows):
            return out
        n_tok = batch.num_tokens[rows].astype(np.int64)
        first = step.first.astype(np.int64)
        # Positions whose target hidden state this step made and whose next token is known.
        count = np.maximum(np.minimum(first + step.count, n_tok - 1) - first, 0)
        propose = step.propose & (count > 0) & (first + count == n_tok - 1) & (n_tok + k - 1 <= self.max_len)
        run = np.flatnonzero(count > 0)
        if not len(run):
            return out
        want = propose[run]
        hidden, first_drafts = self._catch_up(batch, rows[run], first[run], count[run],
                                              step.flat[run].astype(np.int64), want)
        sel = run[want]
        if len(sel):
            drafts = self._decode(batch, rows[sel], n_tok[sel], first_drafts, hidden, k)
            for i, d in zip(sel.tolist(), drafts.tolist()):
                out[i] = d
        return out

    def _catch_up(self, batch, rows, starts, counts, flat, want) -> tuple[torch.Tensor, torch.Tensor]:
        """Run draft positions [starts, starts + counts) of each row from the target's hidden states; (the head's
        fed-back output, the greedy draft 1) at the last position of the rows in `want`."""
        cu = np.cumsum(counts)
        total = int(cu[-1])
        tok_row = np.repeat(np.arange(len(rows)), counts)
        offset = np.arange(total) - np.repeat(cu - counts, counts)
        pos = starts[tok_row] + offset
        r = rows[tok_row]
        ids = batch.token_ids[r, pos + 1].astype(np.int64)
        src = to_device(flat[tok_row] + offset, self.device)
        hidden = self.model.combine(self.capture.buffer.index_select(0, src))
        qsl = np.zeros(len(rows) + 1, dtype=np.int64)
        qsl[1:] = cu
        last = cu[want] - 1
        return self._forward(batch, rows, to_device(ids, self.device), pos, qsl, starts + counts, last, hidden)

    def _decode(self, batch, rows, n_tok, first: torch.Tensor, hidden: torch.Tensor, k: int) -> np.ndarray:
        """k drafts per row: `first`, then k - 1 one-token steps, each feeding the last draft and the head's output
        at the position before; [len(rows), k] on the host (one wait for the device)."""
        drafts = [first]
        qsl = np.arange(len(rows) + 1, dtype=np.int64)
        for i in range(k - 1):
            pos = n_tok - 1 + i  # the position of the token fed (the draft before)
            hidden, x = self._forward(batch, rows, drafts[-1], pos, qsl, pos + 1, np.arange(len(rows)), hidden)
            drafts.append(x)
        return torch.stack(drafts, dim=1).cpu().numpy()

    def _forward(self, batch, rows, ids_t, pos, qsl, seq_lens, last, hidden) -> tuple[torch.Tensor, torch.Tensor]:
        """One varlen head forward; (fed-back output, target-vocabulary greedy token) at the flat indices `last`."""
        r = np.repeat(rows, np.diff(qsl))
        slots = kv_slots(batch, r, pos, self.block_size, self.scratch)
        md = draft_metadata(batch, rows, slots, qsl, seq_lens, self.block_size, self.device)
        with set_forward_context(md, self.kv_caches):
            for_logits, fed = self.model(ids_t, to_device(pos.astype(np.int64), self.device), hidden)
        idx = to_device(np.asarray(last, dtype=np.int64), self.device)
        greedy = self.model.compute_logits(for_logits[idx]).argmax(dim=-1)
        return fed[idx], self.model.to_target_ids(greedy)
