"""The runner's side of a KV cache in several layer groups (core/kv_cache_groups.py): each group's layers have
their own cache tensors and block ids, so each group has its own block table and slot mapping."""
from __future__ import annotations

import dataclasses

import numpy as np
import torch

from tokenmill.attention.backend import AttentionMetadata
from tokenmill.worker.transfer import to_device


class GroupBlockTables:
    """Block tables of groups 1.. (the InputBatch keeps group 0's), one row per batch row.

    Contract: `add(row, ids)` starts a row's tables (ids: the lists of groups 1.. in order), `append(row, ids)`
    extends them, in the order the scheduler hands block ids out; `step_tables(...)` gives one step's slot mapping and
    block table of each group after the first, `metadata(md, those, device)` the step's AttentionMetadata per
    layer, group 0's being `md` itself (only the slot mapping and block table differ).
    """

    def __init__(self, num_groups: int, max_num_reqs: int, max_blocks_per_req: int, block_size: int,
                 layer_group: list[int]) -> None:
        self.num_groups = num_groups
        self.block_size = block_size
        self.layer_group = layer_group  # global layer index -> its group
        self.tables = np.zeros((num_groups - 1, max_num_reqs, max_blocks_per_req), dtype=np.int32)
        self.counts = np.zeros((num_groups - 1, max_num_reqs), dtype=np.int64)

    def add(self, row: int, ids: list[list[int]]) -> None:
        self.counts[:, row] = 0
        self.append(row, ids)

    def append(self, row: int, ids: list[list[int]]) -> None:
        for g, group_ids in enumerate(ids):
            if group_ids:
                n = int(self.counts[g, row])
                self.tables[g, row, n:n + len(group_ids)] = group_ids
                self.counts[g, row] = n + len(group_ids)

    def step_tables(self, rows: np.ndarray, token_rows: np.ndarray, positions: np.ndarray, num_table_cols: int
                    ) -> list[tuple[np.ndarray, np.ndarray]]:
        """(slot mapping [tokens] int64, block table [len(rows), num_table_cols] int32) of each group 1.., in
        order, for a step of requests in batch rows `rows` whose tokens sit in batch rows token_rows at
        `positions`."""
        bs = self.block_size
        out = []
        for g in range(self.num_groups - 1):
            table = self.tables[g]
            slots = table[token_rows, positions // bs].astype(np.int64) * bs + positions % bs
            out.append((slots, table[rows, :num_table_cols]))
        return out

    def metadata(self, md: AttentionMetadata, groups: list[tuple[np.ndarray, np.ndarray]],
                 device: torch.device) -> list[AttentionMetadata]:
        """Per layer: its group's metadata for the step, from `step_tables`' output (group 0's is `md`)."""
        per_group = [md] + [dataclasses.replace(md, slot_mapping=to_device(slots, device),
                                                block_table=to_device(table, device)) for slots, table in groups]
        return [per_group[g] for g in self.layer_group]
