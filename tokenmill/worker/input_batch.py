"""Persistent host-side state of the requests the runner holds, one row per request.

Rows are preallocated numpy arrays so each step's inputs are built by vectorized gathers instead of Python loops
over tokens.
"""
from __future__ import annotations

import numpy as np


class InputBatch:
    """Token ids, block tables and progress of up to `max_num_reqs` requests.

    Contract: `token_ids[r, :num_tokens[r]]` are all known tokens of the request in row r (prompt then outputs),
    `block_table[r, :num_blocks[r]]` its KV blocks in order.
    """

    def __init__(self, max_num_reqs: int, max_model_len: int, max_blocks_per_req: int) -> None:
        self.max_num_reqs = max_num_reqs
        self.token_ids = np.zeros((max_num_reqs, max_model_len + 1), dtype=np.int32)
        self.num_tokens = np.zeros(max_num_reqs, dtype=np.int32)
        self.num_prompt_tokens = np.zeros(max_num_reqs, dtype=np.int32)
        self.num_computed_tokens = np.zeros(max_num_reqs, dtype=np.int32)
        self.block_table = np.zeros((max_num_reqs, max_blocks_per_req), dtype=np.int32)
        self.num_blocks = np.zeros(max_num_reqs, dtype=np.int32)
        # Bumped whenever a row changes owner, so late results of a departed request are recognised and dropped.
        self.row_gen = np.zeros(max_num_reqs, dtype=np.int64)
        self.req_id_to_row: dict[str, int] = {}
        self._free_rows = list(range(max_num_reqs - 1, -1, -1))

    def add(self, req_id: str, prompt: list[int], outputs: list[int], block_ids: list[int],
            num_computed: int) -> int:
        if not self._free_rows:
            raise RuntimeError("InputBatch is full: the scheduler scheduled more than max_num_seqs requests.")
        row = self._free_rows.pop()
        self.row_gen[row] += 1
        self.req_id_to_row[req_id] = row
        p, o = len(prompt), len(outputs)
        self.token_ids[row, :p] = prompt
        if o:
            self.token_ids[row, p:p + o] = outputs
        self.num_prompt_tokens[row] = p
        self.num_tokens[row] = p + o
        self.num_computed_tokens[row] = num_computed
        self.num_blocks[row] = 0
        self.append_blocks(row, block_ids)
        return row

    def append_blocks(self, row: int, block_ids: list[int]) -> None:
        if block_ids:
            n = int(self.num_blocks[row])
            self.block_table[row, n:n + len(block_ids)] = block_ids
            self.num_blocks[row] = n + len(block_ids)

    def remove(self, req_id: str) -> int | None:
        row = self.req_id_to_row.pop(req_id, None)
        if row is not None:
            self.row_gen[row] += 1
            self._free_rows.append(row)
        return row

    def __contains__(self, req_id: str) -> bool:
        return req_id in self.req_id_to_row


class PendingTokens:
    """Where the tokens still being sampled by the step in flight stand in the batch (async scheduling).

    After a step samples, `record(rows, counts, row_gen)` marks the next counts[i] tokens of each row as
    placeholders (-1 in token_ids, counted in num_tokens) and remembers that the step's flat sampled tensor holds
    them from index sum(counts[:i]) on. The next step's inputs are built before those ids reach the host:
    `sources` maps its placeholder inputs to indices of that tensor. `fill` writes the ids once they arrive (rows
    that changed owner meanwhile are skipped by their generation counter). A row's record is valid only for the
    step right after it: a placeholder found later is an error.
    """

    def __init__(self, batch: InputBatch) -> None:
        self.batch = batch
        m = batch.max_num_reqs
        self._index = np.zeros(m, dtype=np.int64)    # row -> flat index of its first pending token
        self._pos = np.zeros(m, dtype=np.int64)      # row -> position of its first pending token
        self._gen = np.full(m, -1, dtype=np.int64)   # row generation when it sampled

    def record(self, rows: np.ndarray, counts: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Placeholders for the rows' new tokens; returns (row, position) of each flat token and the rows'
        generations, for `fill`."""
        b = self.batch
        pos = b.num_tokens[rows].astype(np.int64)
        gens = b.row_gen[rows].copy()
        if len(counts) and counts.max() == counts.min() == 1:   # one token each (no drafts): no repeats needed
            flat_rows, flat_pos, flat_gens, starts = rows, pos, gens, np.arange(len(rows))
        else:
            starts = np.cumsum(counts) - counts
            flat_rows, flat_gens = np.repeat(rows, counts), np.repeat(gens, counts)
            flat_pos = np.repeat(pos, counts) + (np.arange(int(counts.sum())) - np.repeat(starts, counts))
        b.token_ids[flat_rows, flat_pos] = -1
        b.num_tokens[rows] += counts.astype(np.int32)
        self._index[rows], self._pos[rows], self._gen[rows] = starts, pos, gens
        return flat_rows, flat_pos, flat_gens

    def sources(self, input_ids: np.ndarray, token_rows: np.ndarray, positions: np.ndarray) -> np.ndarray | None:
        """The input positions holding a placeholder and where the previous step's sampled tensor holds each: a
        [2, n] (destination, source) array, or None. The placeholders' input ids are set to 0."""
        ph = np.flatnonzero(input_ids < 0)
        if not len(ph):
            return None
        r = token_rows[ph]
        if (self._gen[r] != self.batch.row_gen[r]).any():
            raise RuntimeError("a placeholder token does not come from the previous step")
        input_ids[ph] = 0
        return np.stack([ph, self._index[r] + (positions[ph] - self._pos[r])])

    def fill(self, flat_rows: np.ndarray, flat_pos: np.ndarray, gens: np.ndarray, ids: np.ndarray) -> None:
        b = self.batch
        valid = b.row_gen[flat_rows] == gens
        b.token_ids[flat_rows[valid], flat_pos[valid]] = ids[valid]
