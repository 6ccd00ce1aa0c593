"""Programmatic dependent launch (PDL) for the Triton kernels of a forward step.

Why: at decode batch sizes a step is a chain of ~200 short dependent kernels (a Qwen3-0.6B step: 113 products of
4-12 MB each plus attention), and each boundary costs a launch gap and a ramp-up in which HBM idles. With PDL
(Hopper and newer) a kernel is launched while its predecessor still runs; its programs may do work that does not
depend on the predecessor (the products issue their first weight loads: weights never change during a forward),
then block in `gdc_wait()` until the predecessor has completed and its writes are visible.

The contract every PDL kernel keeps (see `wait_then_release` for the code):
  * before `gdc_wait()` it only reads memory that no kernel of the step writes (weights; the step's metadata, such
    as positions, slots and sequence lengths, which host copies fill before the forward; the RoPE tables), and
    writes nothing. Loads there run under the previous kernel's tail: at batch 1 a kernel's time is mostly its
    chain of dependent memory round trips after the wait, so every load moved before it shortens the step;
  * right after the wait it calls `gdc_launch_dependents()`, so its successor can start early but never runs
    ahead of this kernel's own wait: at most two kernels of the chain overlap.
A kernel launched without PDL (cuBLAS, torch ops, NCCL) keeps plain stream order, and a PDL kernel after one of them
still waits on it, so mixing is safe. The launches work inside CUDA-graph capture (programmatic graph edges).
"""
from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from tokenmill import envs

try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # a Triton without griddepcontrol: PDL stays off
    gdc_wait = gdc_launch_dependents = None

_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def wait_then_release(PDL: tl.constexpr):
    """Block until the previous kernel in the stream has completed (its writes visible), then let the next kernel
    launch. A no-op when the launch did not use PDL."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


@functools.lru_cache(maxsize=8)
def _device_supports(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def pdl_enabled(device: torch.device) -> bool:
    """True when kernels on `device` launch with PDL: a CUDA device of compute capability 9.0+, a Triton with
    griddepcontrol, not the CPU interpreter, and TOKENMILL_PDL not 0."""
    if device.type != "cuda" or _INTERPRETED or gdc_wait is None or not envs.TOKENMILL_PDL:
        return False
    return _device_supports(device.index if device.index is not None else torch.cuda.current_device())


def launch_kwargs(device: torch.device) -> dict:
    """Extra keyword arguments for a kernel launch: the PDL constexpr and, when on, Triton's launch_pdl flag."""
    if pdl_enabled(device):
        return {"PDL": True, "launch_pdl": True}
    return {"PDL": False}
