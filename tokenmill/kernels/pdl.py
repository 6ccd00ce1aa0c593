"""Programmatic dependent launch (PDL) for the Triton kernels of a forward step.

Why: at decode batch sizes a step is a chain of ~200 short dependent kernels (a Qwen3-0.6B step: 113 products of
4-12 MB each plus attention), and each boundary costs a launch gap and a ramp-up in which HBM idles. With PDL
(Hopper and newer) a kernel is launched while its predecessor still runs; its programs may do work that does not
depend on the predecessor (the products issue their first weight loads: weights never change during a forward),
then block in `gdc_wait()` until the predecessor has completed and its writes are visible.

The contract every PDL kernel keeps (see `pdl_wait` for the code):
  * before `gdc_wait()` it only reads memory that no kernel of the step writes (weights; the step's metadata, such
    as positions, slots and sequence lengths, which host copies or a small decode graph's first kernel fill before
    the forward: that kernel is a plain launch, so nothing after it starts before it has completed; the RoPE
    tables), and writes nothing. Loads there run under the previous kernel's tail: at batch 1 a kernel's time is
    mostly its chain of dependent memory round trips after the wait, so every load moved before it shortens the
    step;
  * it calls `gdc_launch_dependents()` right after the wait, or, for the kinds of kernel in EARLY_KINDS (the
    products), before it. The successor's own wait still blocks until this kernel has completed (the trigger only
    decides when the successor's programs may become resident), so where the trigger sits never changes results,
    only how far ahead the next kernel can run. Only the products trigger early because in the batch-1 decode
    graphs on an H200 that was 0.34% (Qwen3-0.6B) and 0.06% (Llama-3-8B) faster than triggering after the wait,
    while early triggers in the short kernels between products (attention, norms, rope) were 16% and 0.2% slower:
    the next product's weight loads then run under those latency-bound kernels and slow them.
  * a program that the step's metadata shows has nothing to do (an unused decode split) returns before the wait;
    its exit counts as its trigger, and its SM slot is free at once. At least one program of every grid waits:
    a grid whose programs all returned before waiting would complete before its predecessor, and the kernel after
    it, whose wait covers only its own predecessor, could read the older kernel's output unfinished.
A kernel launched without PDL (cuBLAS, torch ops, NCCL) keeps plain stream order, and a PDL kernel after one of them
still waits on it, so mixing is safe. The launches work inside CUDA-graph capture (programmatic graph edges).

PDL is always on where the device supports it. `launch_mode` changes that within a block for the tests that check
results are bit-identical with plain stream order and with every kind triggering early.
"""
from __future__ import annotations

import contextlib
import functools
from typing import Iterable, Iterator

import torch
import triton
import triton.language as tl

from tokenmill import envs

try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # a Triton without griddepcontrol: PDL stays off
    gdc_wait = gdc_launch_dependents = None

_INTERPRETED = envs.TRITON_INTERPRET
KINDS = ("gemv", "attention", "norm", "rope", "act", "sampling", "lora")
EARLY_KINDS = frozenset({"gemv"})
_enabled = True
_early = EARLY_KINDS


@triton.jit
def pdl_wait(PDL: tl.constexpr):
    """Block until the previous kernel in the stream has completed (its writes visible), and let the next kernel
    launch: after the wait (PDL == 1) or before it (PDL == 2, an early trigger). A no-op when PDL is 0."""
    if PDL == 2:
        gdc_launch_dependents()
        gdc_wait()
    elif PDL:
        gdc_wait()
        gdc_launch_dependents()


@functools.lru_cache(maxsize=8)
def _device_supports(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def pdl_enabled(device: torch.device) -> bool:
    """True when kernels on `device` launch with PDL: a CUDA device of compute capability 9.0+, a Triton with
    griddepcontrol, not the CPU interpreter (and not turned off by `launch_mode`)."""
    if device.type != "cuda" or _INTERPRETED or gdc_wait is None or not _enabled:
        return False
    return _device_supports(device.index if device.index is not None else torch.cuda.current_device())


@contextlib.contextmanager
def launch_mode(enabled: bool = True, early: Iterable[str] = EARLY_KINDS) -> Iterator[None]:
    """Within the block, launches use PDL only if `enabled` (and the device supports it), and the kinds in `early`
    trigger their successor before their wait. For tests: results must not depend on either."""
    global _enabled, _early
    early = frozenset(early)
    unknown = early - set(KINDS)
    if unknown:
        raise ValueError(f"pdl.launch_mode: unknown kernel kind(s) {sorted(unknown)}; choose from "
                         f"{', '.join(KINDS)}")
    saved = _enabled, _early
    _enabled, _early = bool(enabled), early
    try:
        yield
    finally:
        _enabled, _early = saved


def launch_kwargs(device: torch.device, kind: str) -> dict:
    """Extra keyword arguments for a launch of a kernel of `kind` (one of KINDS): the PDL constexpr (0 off, 1
    trigger after the wait, 2 before it) and, when on, Triton's launch_pdl flag."""
    if pdl_enabled(device):
        return {"PDL": 2 if kind in _early else 1, "launch_pdl": True}
    return {"PDL": 0}
