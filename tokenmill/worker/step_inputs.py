"""One step's flat model inputs as the model runner builds them on the host."""
from __future__ import annotations

import numpy as np


class StepInputs:
    """One step's flat inputs (numpy, host side): per request (batch order) its runner row, scheduled and computed
    token counts, query_start_loc, context length and block-table row; per token its id (placeholders set to 0,
    see fixup), RoPE position and KV slot. sample_idx: the requests that sample; n_sample: how many tokens each
    samples, from its last n_sample positions; fixup: [2, n] (input position, index in the previous step's sampled
    ids) of the placeholder inputs, or None; groups: the slot mapping and block table of each KV cache group
    after the first (GroupBlockTables.step_tables), or None with one group."""
    __slots__ = ("req_ids", "rows", "n_sched", "computed", "qsl", "input_ids", "rope_positions", "slots",
                 "seq_lens", "block_table", "sample_idx", "n_sample", "fixup", "groups")

    def __init__(self, req_ids, rows, n_sched, computed, qsl, input_ids, rope_positions, slots, seq_lens,
                 block_table, sample_idx, n_sample, fixup, groups=None) -> None:
        self.req_ids, self.rows, self.n_sched, self.computed, self.qsl = req_ids, rows, n_sched, computed, qsl
        self.input_ids, self.rope_positions, self.slots = input_ids, rope_positions, slots
        self.seq_lens, self.block_table, self.sample_idx, self.n_sample = seq_lens, block_table, sample_idx, n_sample
        self.fixup, self.groups = fixup, groups

    @property
    def one_token_each(self) -> bool:
        return not len(self.n_sample) or int(self.n_sample.max()) == 1

    def sample_token_index(self) -> np.ndarray:
        """The flat token index of each sampled token: the last n_sample[j] tokens of request sample_idx[j]."""
        ends = self.qsl[1:][self.sample_idx]
        if self.one_token_each:
            return ends - 1
        starts, offsets = runs(ends - self.n_sample, self.n_sample)
        return starts + offsets


def runs(starts: np.ndarray, counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(starts[i] repeated counts[i] times, 0..counts[i]-1 within each run), vectorized."""
    rep = np.repeat(starts, counts)
    return rep, np.arange(len(rep)) - np.repeat(np.cumsum(counts) - counts, counts)
