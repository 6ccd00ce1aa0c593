"""The worker's memory budget checks (worker/worker.py)."""
from __future__ import annotations

import pytest


def test_state_that_cannot_fit_names_max_num_seqs():
    """A hybrid model's state is reserved for max_num_seqs requests before the KV cache: when that takes all the
    memory left (the 27B shape's default 256 sequences with prefix caching on an 80 GB card), the error names
    max_num_seqs and a value that fits, not the KV cache's block count."""
    from tokenmill.worker.worker import GiB, check_state_fits
    per_slot = int(0.143 * GiB)
    check_state_fits(17.75 * GiB, per_slot, 4, 4)                 # 9 slots: 1.3 GiB
    with pytest.raises(ValueError, match=r"max_num_seqs=256 .*--max-num-seqs (\d+) .*prefix caching") as e:
        check_state_fits(17.75 * GiB, per_slot, 256, 256)
    fit = int(e.value.args[0].split("--max-num-seqs ")[1].split()[0])
    assert fit > 0 and per_slot * (2 * fit + 1) <= 17.75 * GiB / 2
    with pytest.raises(ValueError, match="max_num_seqs=256") as e:
        check_state_fits(17.75 * GiB, per_slot, 256, 0)
    assert "prefix caching" not in e.value.args[0]
    check_state_fits(0.0, 0, 256, 0)                               # no recurrent layers: nothing to check
