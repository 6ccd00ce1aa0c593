import os
import re

import pytest
import torch

from tokenmill.attention import kv_cache_memory


def _rss_mib() -> float:
    with open("/proc/self/status") as f:
        return int(re.search(r"VmRSS:\s+(\d+) kB", f.read()).group(1)) / 1024


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn])
def test_cpu_zeros_are_zero_contiguous_and_writable(dtype):
    t = kv_cache_memory.zeros((2, 5, 16, 3, 8), dtype, "cpu")
    assert t.shape == (2, 5, 16, 3, 8) and t.dtype == dtype and t.is_contiguous() and t.device.type == "cpu"
    assert torch.count_nonzero(t.float()) == 0
    t[1, 4] = 1
    assert t.float().sum().item() == 16 * 3 * 8
    assert torch.count_nonzero(t[0].float()) == 0


def test_views_keep_the_mapping_alive():
    view = kv_cache_memory.zeros((4, 1024), torch.float32, "cpu")[2]
    view.fill_(3.0)  # the base tensor is gone; its mapping must still be there
    assert torch.all(view == 3.0)


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="needs Linux /proc")
def test_cpu_pages_are_not_written_at_allocation():
    # torch.zeros writes every page (its resident size grows by the whole tensor); the mapping's pages come on
    # first write, so a 256 MiB cache costs nothing until it is used.
    before = _rss_mib()
    t = kv_cache_memory.zeros((64, 1024, 1024), torch.float32, "cpu")
    assert _rss_mib() - before < 32
    t[:8].fill_(1.0)  # 32 MiB written: now resident
    assert _rss_mib() - before >= 28


def test_empty_and_non_cpu_shapes():
    assert kv_cache_memory.zeros((0, 4), torch.float32, "cpu").shape == (0, 4)
    if torch.cuda.is_available():
        assert kv_cache_memory.zeros((2, 3), torch.bfloat16, "cuda").device.type == "cuda"


def test_available_host_bytes_reads_meminfo():
    got = kv_cache_memory.available_host_bytes()
    if os.path.exists("/proc/meminfo"):
        assert got is not None and 0 < got <= os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    else:
        assert got is None
