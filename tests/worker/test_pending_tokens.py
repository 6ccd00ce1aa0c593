"""The runner's bookkeeping of tokens still being sampled (async scheduling) with several tokens per request per
step: placeholders, where the next step's inputs find them, and the step's output once the ids arrive (CPU)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from tokenmill.worker.input_batch import InputBatch, PendingTokens
from tokenmill.worker.model_runner import StepInputs
from tokenmill.worker.runner_output import AsyncRunnerOutput, StepState


def _batch():
    b = InputBatch(8, 32, 4)
    for i, rid in enumerate("abc"):
        b.add(rid, [10 * (i + 1) + k for k in range(3)], [], [i], 0)
    return b, PendingTokens(b)


def test_runs_of_placeholders_and_their_sources():
    b, p = _batch()
    rows = np.array([b.req_id_to_row[r] for r in "abc"])
    flat_rows, flat_pos, gens = p.record(rows, np.array([2, 3, 1]))
    assert flat_rows.tolist() == [rows[0]] * 2 + [rows[1]] * 3 + [rows[2]]
    assert flat_pos.tolist() == [3, 4, 3, 4, 5, 3] and b.num_tokens[rows].tolist() == [5, 6, 4]
    assert (b.token_ids[rows[1], 3:6] == -1).all() and b.token_ids[rows[1], 2] == 22
    # The next step feeds each request's known tokens from position 3 on: all placeholders of this step.
    token_rows = np.repeat(rows, [2, 3, 1])
    positions = flat_pos.copy()
    ids = b.token_ids[token_rows, positions].astype(np.int64)
    fix = p.sources(ids, token_rows, positions)
    assert fix.tolist() == [[0, 1, 2, 3, 4, 5], [0, 1, 2, 3, 4, 5]] and (ids == 0).all()
    # a step that feeds only each request's last pending token finds it at the end of its run
    last = np.array([4, 5, 3])
    ids = b.token_ids[rows, last].astype(np.int64)
    assert p.sources(ids, rows, last).tolist() == [[0, 1, 2], [1, 4, 5]]
    # ids arrive; a row whose request left meanwhile is skipped
    b.remove("c")
    p.fill(flat_rows, flat_pos, gens, np.array([7, 8, 9, 10, 11, 12], dtype=np.int32))
    assert b.token_ids[rows[0], 3:5].tolist() == [7, 8] and b.token_ids[rows[1], 3:6].tolist() == [9, 10, 11]
    assert b.token_ids[rows[2], 3] == -1


def test_a_placeholder_from_an_older_step_is_an_error():
    b, p = _batch()
    row = np.array([b.req_id_to_row["a"]])
    p.record(row, np.array([1]))
    b.remove("a")
    new = b.add("d", [1, 2, 3], [], [0], 0)
    b.token_ids[new, 3] = -1   # (never the case: a placeholder with no step behind it)
    with pytest.raises(RuntimeError, match="previous step"):
        p.sources(np.array([-1]), np.array([new]), np.array([3]))


def test_sample_token_index_takes_each_requests_last_tokens():
    qsl = np.array([0, 4, 5, 9])
    inp = StepInputs(["a", "b", "c"], np.arange(3), np.diff(qsl), np.zeros(3), qsl, *([None] * 5),
                     np.array([0, 2]), np.array([1, 1]), None)
    assert inp.sample_token_index().tolist() == [3, 8]
    inp.n_sample = np.array([2, 3])
    assert inp.sample_token_index().tolist() == [2, 3, 6, 7, 8] and not inp.one_token_each


def test_the_output_splits_the_flat_ids_per_request():
    b, p = _batch()
    rows = np.array([b.req_id_to_row[r] for r in "abc"])
    st = StepState(["a", "x", "b", "c"], np.array([rows[0], 7, rows[1], rows[2]]), np.array([0, 2, 3]),
                   np.array([2, 3, 1]))
    placed = p.record(rows, st.n_sample)
    sampled = torch.tensor([7, 8, 9, 10, 11, 12])
    out = AsyncRunnerOutput(p, st, placed, sampled).get()
    assert out.req_ids == ["a", "x", "b", "c"]
    assert out.sampled_token_ids == [[7, 8], [], [9, 10, 11], [12]]
    assert b.token_ids[rows[2], 3] == 12 and out.pooler_output is None
