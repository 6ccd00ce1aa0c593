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
