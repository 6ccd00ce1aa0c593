"""One step's result while it travels to the host: the handle `ModelRunner.sample_tokens` returns."""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from tokenmill.core.sched_output import ModelRunnerOutput
from tokenmill.layers.sampler import LogprobsTensors
from tokenmill.metrics.step_timing import TIMER
from tokenmill.worker.transfer import to_host

if TYPE_CHECKING:
    from tokenmill.worker.input_batch import PendingTokens


class StepState:
    """What execute_model leaves for sample_tokens.

    sample_idx: the batch indices of the requests that sample (or, for a pooling model, are pooled) this step;
    n_sample: how many tokens each of them samples (1; k + 1 when k drafts are verified); logits: one row per token
    sampled, request after request; pooled: [len(sample_idx), H] pooled states instead (a pooling model);
    graph_sampled: the graph drew the tokens itself, into its prev_sampled and the host ring's out[io_slot];
    seq_lens: each request's context length after the step's tokens, qsl: the step's query_start_loc (both set by
    execute_model).
    """
    __slots__ = ("req_ids", "rows", "sample_idx", "n_sample", "logits", "prompt_lp", "pooled", "graph_sampled",
                 "io_slot", "seq_lens", "qsl")

    def __init__(self, req_ids, rows, sample_idx, n_sample, logits=None, prompt_lp=None, pooled=None,
                 graph_sampled=False, io_slot=None) -> None:
        self.req_ids, self.rows, self.sample_idx, self.n_sample = req_ids, rows, sample_idx, n_sample
        self.logits, self.prompt_lp, self.pooled = logits, prompt_lp or {}, pooled
        self.graph_sampled, self.io_slot = graph_sampled, io_slot
        self.seq_lens = self.qsl = None


class AsyncRunnerOutput:
    """One step's result while its sampled ids (or pooled states) travel to the host.

    Contract: `get()` waits for the copy (the step's one device->host sync), writes the ids over the batch's -1
    placeholders (`PendingTokens.fill`; rows whose request left meanwhile are skipped) and returns the
    ModelRunnerOutput. It is idempotent; the runner calls it itself before sampling the next step.
    """

    def __init__(self, pending: PendingTokens | None, st: StepState | None, placed=None,
                 sampled: torch.Tensor | None = None, logprobs: LogprobsTensors | None = None,
                 sampled_host: torch.Tensor | None = None, pooled: torch.Tensor | None = None) -> None:
        """placed: (rows, positions, generations) of each sampled token (`PendingTokens.record`); sampled_host: a
        pinned buffer the copy of `sampled` is already queued into (else one is made here)."""
        self._pending, self._st, self._placed = pending, st, placed
        self._result: ModelRunnerOutput | None = None
        self._event = None
        self._ids = sampled_host if sampled_host is not None else (
            to_host(sampled) if sampled is not None else None)
        self._lp = None if logprobs is None else LogprobsTensors(
            to_host(logprobs.token_ids), to_host(logprobs.logprobs), to_host(logprobs.ranks))
        self._pooled = None if pooled is None else to_host(pooled)
        on_device = sampled if sampled is not None else pooled
        if on_device is not None and on_device.is_cuda:
            self._event = torch.cuda.Event()
            self._event.record()

    @classmethod
    def ready(cls, result: ModelRunnerOutput) -> "AsyncRunnerOutput":
        """A result already on the host (speculative decoding verifies drafts there)."""
        out = cls(None, None)
        out._result = result
        return out

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
        logprobs, pooler_output = None, None
        if self._ids is not None:
            ids = self._ids.tolist()
            self._pending.fill(*self._placed, np.asarray(ids, dtype=np.int32))
            if len(ids) == len(st.sample_idx):      # one token each
                for j, i in enumerate(st.sample_idx):
                    sampled[i] = [ids[j]]
            else:
                ends = np.cumsum(st.n_sample).tolist()
                for j, i in enumerate(st.sample_idx):
                    sampled[i] = ids[ends[j] - int(st.n_sample[j]):ends[j]]
            if self._lp is not None:  # one row per sampled token, in request order: already the output's layout
                logprobs = self._lp.tolists()
        if self._pooled is not None:
            pooler_output = [None] * len(st.req_ids)
            for j, i in enumerate(st.sample_idx):
                pooler_output[i] = self._pooled[j]
        self._result = ModelRunnerOutput(req_ids=st.req_ids, sampled_token_ids=sampled, logprobs=logprobs,
                                         prompt_logprobs=st.prompt_lp, pooler_output=pooler_output)
        self._pending = self._st = self._ids = self._lp = self._pooled = None
        return self._result
