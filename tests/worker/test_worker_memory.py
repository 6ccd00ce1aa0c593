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


def test_the_suggested_max_num_seqs_balances_state_and_kv():
    """The Qwen3.5-27B shape on an 80 GB card, 8,800-token requests (measured there: 64 sequences left the KV
    cache 15.9 requests and gave 205 out tok/s on 64 x 8k-in prompts; the balanced 28 gave 25.5 and 314): each
    sequence costs its state slot plus one max_model_len request's KV, so the suggestion holds as many of each."""
    from tokenmill.worker.worker import GiB, balanced_num_seqs, check_state_fits
    left, per_slot, request_kv = 20.74 * GiB, int(0.188 * GiB), int(0.537 * GiB)
    fit = balanced_num_seqs(left, per_slot, False, request_kv)
    assert fit == 28
    state = per_slot * (fit + 1)
    assert (left - state) // request_kv >= fit - 1 and (left - state - per_slot) // request_kv < fit + 1
    assert balanced_num_seqs(left, per_slot, True, request_kv) < fit        # checkpoints cost a slot each
    with pytest.raises(ValueError, match=r"--max-num-seqs 28 leaves the KV cache room for as many requests"):
        check_state_fits(left, per_slot, 256, 0, request_kv)


def test_the_memory_profile_warns_when_state_slots_outnumber_the_kv_caches_requests(monkeypatch, caplog):
    """The GPU memory profile's arithmetic on the CPU (torch.cuda's readings stubbed): 64 state slots beside a KV
    cache of ~16 requests is logged with the balanced --max-num-seqs; a balanced setting is not."""
    import logging
    from types import SimpleNamespace

    import torch

    from tokenmill.worker.worker import GiB, Worker
    total = 80 * GiB
    for name in ("empty_cache", "reset_peak_memory_stats", "synchronize"):
        monkeypatch.setattr(torch.cuda, name, lambda *a: None)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *a: int(51.26 * GiB))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (total - int(51.26 * GiB), total))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda *a: int(51.26 * GiB))
    per_slot = int(0.188 * GiB)
    model = SimpleNamespace(state_specs=lambda: [SimpleNamespace(bytes_per_request=per_slot)])
    runner = SimpleNamespace(profile_run=lambda n: None, cuda_graph_output_bytes=lambda: 0, model=model)

    def budget(max_num_seqs: int) -> int:
        w = Worker.__new__(Worker)
        w.runner = runner
        w.config = SimpleNamespace(
            cache_config=SimpleNamespace(gpu_memory_utilization=0.9, enable_prefix_caching=False),
            scheduler_config=SimpleNamespace(max_num_seqs=max_num_seqs, max_num_batched_tokens=8192),
            model_config=SimpleNamespace(max_model_len=8800))
        return w._profile_gpu_blocks(1, int(0.537 * GiB))

    with caplog.at_level(logging.WARNING, logger="tokenmill.worker.worker"):
        kv = budget(64)
    assert 0 < kv < 64 * 0.537 * GiB
    assert "max_num_seqs=64 reserves recurrent state for 64 requests" in caplog.text
    assert "--max-num-seqs 28 would hold 28 of each" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="tokenmill.worker.worker"):
        budget(28)
    assert "reserves recurrent state" not in caplog.text
