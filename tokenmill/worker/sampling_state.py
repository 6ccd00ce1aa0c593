"""Persistent per-row sampling parameters for the model runner.

Each running request owns a runner row. `add_request` writes its parameters into preallocated numpy arrays once;
every step `make_metadata` turns the rows being sampled into a `SamplingMetadata` with array gathers and a couple
of host->device copies, so the per-step cost does not grow with Python loops over requests. Rare features
(logit_bias, allowed_token_ids, bad words, min_tokens) live in small dicts keyed by row, and only rows that use
them are looped over.
"""
from __future__ import annotations

import random

import numpy as np
import torch

from tokenmill.layers.sampler import LOGPROBS_MODES, SamplingMetadata
from tokenmill.sampling_params import SamplingParams
from tokenmill.worker.transfer import PinnedRing, to_device

_GREEDY_EPS = 1e-5
_NO_LOGPROBS = -2  # sentinel in the logprobs-count array (-1 means the whole vocabulary)
# Rows of the packed float array, gathered and copied to the device in one go.
_TEMP, _TOP_P, _MIN_P, _FREQ, _PRES, _REP = range(6)
_F_DEFAULTS = np.array([1.0, 1.0, 0.0, 0.0, 0.0, 1.0], dtype=np.float32)


def _padded(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _to_int64_seed(seed: int) -> int:
    """Fold any Python int into the int64 range (the RNG hashes all 64 bits)."""
    s = seed & 0xFFFFFFFFFFFFFFFF
    return s - (1 << 64) if s >= (1 << 63) else s


class SamplingState:
    """Sampling parameters of up to `max_num_reqs` running requests, indexed by runner row.

    Contract: rows are owned by the caller (the runner); `add_request(row, params)` before the row is sampled,
    `remove_request(row)` when it leaves. Requests without a seed get one from a `random.Random(global_seed)`
    owned by this object, so a run is reproducible given the global seed and the order requests arrive.
    """

    def __init__(self, max_num_reqs: int, vocab_size: int, device: torch.device, global_seed: int = 0,
                 logprobs_mode: str = "raw_logprobs", packed_upload: bool | None = None,
                 max_rows: int | None = None) -> None:
        """max_rows: the most logits rows one step samples (max_num_reqs; more when speculative decoding samples
        every verified position of a request)."""
        if logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"logprobs_mode must be one of {LOGPROBS_MODES}, got {logprobs_mode!r}")
        self.max_num_reqs = max_num_reqs
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self.logprobs_mode = logprobs_mode
        self._rng = random.Random(global_seed)

        self._f = np.repeat(_F_DEFAULTS[:, None], max_num_reqs, axis=1)   # [6, M] float32
        self._top_k = np.zeros(max_num_reqs, dtype=np.int64)
        self._seed = np.zeros(max_num_reqs, dtype=np.int64)
        self._num_logprobs = np.full(max_num_reqs, _NO_LOGPROBS, dtype=np.int64)
        # Rare features, row -> data.
        self._logit_bias: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self._allowed: dict[int, np.ndarray] = {}
        self._bad_words: dict[int, list[list[int]]] = {}
        self._min_tokens: dict[int, tuple[int, np.ndarray]] = {}
        # Rows sampled by the plain temperature draw alone (no top-k/p, min-p, penalties, logprobs or rare
        # features): such batches can be sampled inside a CUDA graph (see plain_race_inputs).
        self._plain = np.zeros(max_num_reqs, dtype=bool)
        # row -> position in the current batch (-1 = not in it); lets rare-feature loops find their batch index.
        self._batch_pos = np.full(max_num_reqs, -1, dtype=np.int64)
        # On CUDA the per-step int and float parameters go in one copy from a reused pinned buffer into one
        # persistent device buffer (the tensors of a step's metadata are views of it, valid until the next step's
        # make_metadata, which the sampler of this step precedes in stream order).
        self._ring: PinnedRing | None = None
        self._dev_buf: torch.Tensor | None = None
        if packed_upload is None:   # tests force it on the CPU to check the packed layout
            packed_upload = self.device.type == "cuda"
        if packed_upload:
            rows = max(max_rows or 0, max_num_reqs)
            nbytes = 3 * 8 * _padded(rows, 2) + 6 * 4 * _padded(rows, 4)
            self._ring = PinnedRing(nbytes)
            self._dev_buf = torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    # ----- lifecycle -----
    def add_request(self, row: int, params: SamplingParams) -> None:
        self.remove_request(row)
        v = self.vocab_size
        greedy = params.temperature < _GREEDY_EPS
        self._f[:, row] = (0.0 if greedy else params.temperature, params.top_p, params.min_p,
                           params.frequency_penalty, params.presence_penalty, params.repetition_penalty)
        self._top_k[row] = params.top_k if 0 < params.top_k < v else 0   # k >= V keeps everything: off
        seed = params.seed if params.seed is not None else self._rng.getrandbits(64)
        self._seed[row] = _to_int64_seed(seed)
        self._num_logprobs[row] = _NO_LOGPROBS if params.logprobs is None else params.logprobs

        # Token ids outside the vocabulary are dropped here (validation is the processor's job; this is defensive).
        if params.logit_bias:
            items = [(t, b) for t, b in params.logit_bias.items() if 0 <= t < v]
            if items:
                self._logit_bias[row] = (np.array([t for t, _ in items], dtype=np.int64),
                                         np.array([b for _, b in items], dtype=np.float32))
        if params.allowed_token_ids is not None:
            self._allowed[row] = np.array([t for t in params.allowed_token_ids if 0 <= t < v], dtype=np.int64)
        words = [list(w) for w in (params.bad_words_token_ids or []) if w and all(0 <= t < v for t in w)]
        if words:
            self._bad_words[row] = words
        stop_ids = [t for t in params.all_stop_token_ids if 0 <= t < v]
        if params.min_tokens > 0 and stop_ids:
            self._min_tokens[row] = (params.min_tokens, np.array(sorted(stop_ids), dtype=np.int64))
        f = self._f[:, row]
        self._plain[row] = (not greedy and self._top_k[row] == 0 and f[_TOP_P] >= 1 and f[_MIN_P] <= 0
                            and f[_FREQ] == 0 and f[_PRES] == 0 and f[_REP] == 1
                            and self._num_logprobs[row] == _NO_LOGPROBS
                            and not any(row in d for d in (self._logit_bias, self._allowed, self._bad_words,
                                                           self._min_tokens)))

    def remove_request(self, row: int) -> None:
        self._plain[row] = False
        self._f[:, row] = _F_DEFAULTS
        self._top_k[row] = 0
        self._seed[row] = 0
        self._num_logprobs[row] = _NO_LOGPROBS
        for d in (self._logit_bias, self._allowed, self._bad_words, self._min_tokens):
            d.pop(row, None)

    # ----- per step -----
    def plain_race_inputs(self, rows: np.ndarray, num_prompt_tokens: np.ndarray, num_tokens: np.ndarray
                          ) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
        """(seeds int64, RNG positions int64, temperatures float32) of `rows` when every one of them is sampled by
        the plain temperature draw alone, else None. The draw from these equals what `make_metadata` plus the
        sampler would pick for the same token counts (a temperature of 1 divides exactly)."""
        if not len(rows) or not self._plain[rows].all():
            return None
        n_out = num_tokens[rows].astype(np.int64) - num_prompt_tokens[rows].astype(np.int64)
        return self._seed[rows], n_out, self._f[_TEMP, rows]

    def make_metadata(self, rows: np.ndarray, token_ids: np.ndarray, num_prompt_tokens: np.ndarray,
                      num_tokens: np.ndarray, position_offsets: np.ndarray | None = None) -> SamplingMetadata:
        """Metadata for sampling the next token of `rows` (runner rows, in batch order).

        token_ids[r, :num_tokens[r]] are row r's known tokens (prompt then outputs); the token being sampled is
        output number num_tokens[r] - num_prompt_tokens[r], which is also its RNG position. A request sampling
        several tokens in one step appears in `rows` once per token, and position_offsets (0, 1, ... per run)
        moves each token's RNG position past the ones before it (penalties see the known tokens only).
        """
        rows = np.asarray(rows, dtype=np.int64)
        dev = self.device
        f = self._f[:, rows]                                        # [6, B] copy
        greedy = f[_TEMP] < _GREEDY_EPS
        all_greedy, all_random = bool(greedy.all()), not bool(greedy.any())
        n_prompt = num_prompt_tokens[rows].astype(np.int64)
        n_out = num_tokens[rows].astype(np.int64) - n_prompt

        nl = self._num_logprobs[rows]
        max_lp = None
        if (nl != _NO_LOGPROBS).any():
            max_lp = -1 if (nl == -1).any() else int(nl.max())
        md = SamplingMetadata(all_greedy=all_greedy, all_random=all_random, max_num_logprobs=max_lp,
                              logprobs_mode=self.logprobs_mode)

        has_freq, has_pres, has_rep = bool((f[_FREQ] != 0).any()), bool((f[_PRES] != 0).any()), \
            bool((f[_REP] != 1).any())
        if not all_greedy:
            f[_TEMP][greedy] = 1.0  # greedy rows: divide by 1 (their sample comes from the argmax anyway)
        need_temp = not all_greedy and bool((f[_TEMP] != 1).any())
        need_top_p = not all_greedy and bool((f[_TOP_P] < 1).any())
        need_min_p = not all_greedy and bool((f[_MIN_P] > 0).any())
        need_f = need_temp or need_top_p or need_min_p or has_freq or has_pres or has_rep
        top_k = self._top_k[rows]
        rng_pos = n_out if position_offsets is None else n_out + position_offsets
        ints_h = None if all_greedy else np.stack([self._seed[rows], rng_pos, top_k])
        ints, ft = self._upload(ints_h, f if need_f else None)
        if need_f:
            md.temperature = ft[_TEMP] if need_temp else None
            md.top_p = ft[_TOP_P] if need_top_p else None
            md.min_p = ft[_MIN_P] if need_min_p else None
            md.frequency_penalties = ft[_FREQ] if has_freq else None
            md.presence_penalties = ft[_PRES] if has_pres else None
            md.repetition_penalties = ft[_REP] if has_rep else None

        if not all_greedy:
            has_top_k = bool((top_k > 0).any())
            md.seeds, md.positions = ints[0], ints[1]
            if has_top_k:
                md.top_k, md.max_top_k = ints[2], int(top_k.max())
            if not all_random:
                md.greedy_mask = to_device(greedy, dev)

        if has_freq or has_pres or has_rep:
            pen = (f[_FREQ] != 0) | (f[_PRES] != 0) | (f[_REP] != 1)
            md.output_token_counts = self._counts(token_ids, rows, n_prompt, np.where(pen, n_out, 0))
            if has_rep:
                # Prompt presence only matters to the repetition penalty; rows without one get an empty window.
                zeros = np.zeros_like(n_prompt)
                md.prompt_token_mask = self._counts(token_ids, rows, zeros, np.where(f[_REP] != 1, n_prompt, 0),
                                                    presence_only=True)

        if self._logit_bias or self._allowed or self._bad_words or self._min_tokens:
            self._rare_features(md, rows, token_ids, num_tokens, n_out)
        return md

    def _upload(self, ints: np.ndarray | None, floats: np.ndarray | None
                ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """ints [3, B] int64 and floats [6, B] float32 (either may be None) on the device.

        In the packed buffer every row starts 16-byte aligned (rows padded to 2 int64s / 4 float32s): Triton
        specializes a kernel on whether each pointer argument is 16-byte aligned, so with unpadded rows the
        sampling kernels would see the positions row aligned or not by the parity of B, and compile a second
        variant in the middle of serving (~0.4 s of one step)."""
        if self._ring is None:
            return (None if ints is None else to_device(ints, self.device),
                    None if floats is None else to_device(floats, self.device))
        b = next((a.shape[1] for a in (ints, floats) if a is not None), 0)
        ishape = (0 if ints is None else len(ints), _padded(b, 2))
        fshape = (0 if floats is None else len(floats), _padded(b, 4))
        ni, nf = 8 * ishape[0] * ishape[1], 4 * fshape[0] * fshape[1]
        if ni + nf == 0:
            return None, None
        src, arr = self._ring.next()
        if ints is not None:
            arr[:ni].view(np.int64).reshape(ishape)[:, :b] = ints
        if floats is not None:
            arr[ni:ni + nf].view(np.float32).reshape(fshape)[:, :b] = floats
        self._dev_buf[:ni + nf].copy_(src[:ni + nf], non_blocking=True)
        self._ring.queued()
        return (None if ints is None else self._dev_buf[:ni].view(torch.int64).view(ishape)[:, :b],
                None if floats is None else self._dev_buf[ni:ni + nf].view(torch.float32).view(fshape)[:, :b])

    def _counts(self, token_ids: np.ndarray, rows: np.ndarray, start: np.ndarray, length: np.ndarray,
                presence_only: bool = False) -> torch.Tensor:
        """[B, V] float32 counts (or, with presence_only, a bool mask) of the tokens
        token_ids[rows[i], start[i]:start[i]+length[i]], by pad + scatter: padding slots point at an extra column V
        that is sliced off, so there is no per-token Python."""
        b, v = len(rows), self.vocab_size
        width = int(length.max()) if b else 0
        out = torch.zeros(b, v + 1, dtype=torch.bool if presence_only else torch.float32, device=self.device)
        if width > 0:
            cols = np.arange(width, dtype=np.int64)
            idx = np.minimum(start[:, None] + cols, token_ids.shape[1] - 1)
            window = token_ids[rows[:, None], idx].astype(np.int64)
            window[cols[None, :] >= length[:, None]] = v
            index = to_device(window, self.device)
            if presence_only:
                out.scatter_(1, index, True)
            else:
                out.scatter_add_(1, index, torch.ones(index.shape, dtype=torch.float32, device=self.device))
        return out[:, :v]

    def _rare_features(self, md: SamplingMetadata, rows: np.ndarray, token_ids: np.ndarray,
                       num_tokens: np.ndarray, n_out: np.ndarray) -> None:
        """Logit bias, allowed ids, bad words and min_tokens: Python loops only over rows that use them."""
        dev, bpos = self.device, self._batch_pos
        bpos[rows] = np.arange(len(rows))
        try:
            def in_batch(d: dict) -> list[tuple[int, int]]:
                return [(r, int(bpos[r])) for r in d if bpos[r] >= 0]

            def index(pairs_r: list[np.ndarray], pairs_t: list[np.ndarray]) -> torch.Tensor | None:
                if not pairs_r:
                    return None
                return to_device(np.stack([np.concatenate(pairs_r), np.concatenate(pairs_t)]), dev)

            br, bt, bv = [], [], []
            for r, i in in_batch(self._logit_bias):
                toks, vals = self._logit_bias[r]
                br.append(np.full(len(toks), i, dtype=np.int64)), bt.append(toks), bv.append(vals)
            md.logit_bias_index = index(br, bt)
            if br:
                md.logit_bias_values = to_device(np.concatenate(bv), dev)

            allowed = in_batch(self._allowed)
            if allowed:
                toks = [self._allowed[r] for r, _ in allowed]
                local = np.concatenate([np.full(len(t), j, dtype=np.int64) for j, t in enumerate(toks)])
                mask = torch.ones(len(allowed), self.vocab_size, dtype=torch.bool, device=dev)
                mask[to_device(local, dev), to_device(np.concatenate(toks), dev)] = False
                md.allowed_rows = to_device(np.array([i for _, i in allowed], dtype=np.int64), dev)
                md.allowed_mask = mask

            wr, wt = [], []
            for r, i in in_batch(self._bad_words):
                end, out_len = int(num_tokens[r]), int(n_out[i])
                banned = set()
                for w in self._bad_words[r]:
                    prefix = w[:-1]
                    # The prefix must be the tail of the *outputs* (vLLM never matches into the prompt).
                    if len(prefix) <= out_len and (not prefix or
                                                   token_ids[r, end - len(prefix):end].tolist() == prefix):
                        banned.add(w[-1])
                if banned:
                    wr.append(np.full(len(banned), i, dtype=np.int64)), wt.append(np.array(sorted(banned)))
            md.bad_words_index = index(wr, wt)

            mr, mt = [], []
            for r, i in in_batch(self._min_tokens):
                min_tokens, stop_ids = self._min_tokens[r]
                if n_out[i] < min_tokens:
                    mr.append(np.full(len(stop_ids), i, dtype=np.int64)), mt.append(stop_ids)
            md.min_tokens_index = index(mr, mt)
        finally:
            bpos[rows] = -1
