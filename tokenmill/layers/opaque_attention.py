"""Attention as one opaque op, so torch.compile can trace a decoder stack around it.

The attention backends read their per-step metadata (numpy arrays, plans cached per step) from the forward context;
dynamo can neither trace that nor should it guard on it. Under compilation a layer calls `attention(q, k, v, id)`
instead: one graph node that, at run time, calls the layer's own eager attention (cache write and attention over
the paged cache), returning [T, heads x head_dim]. It is registered through torch.library's low-level API rather
than `custom_op`, whose Python wrapper costs tens of microseconds a call (30 calls a step on a CPU step of ~10 ms).
"""
from __future__ import annotations

import itertools
import weakref

import torch

# id -> a weak reference to the layer's Attention module
_LAYERS: dict[int, weakref.ref] = {}
_OUT: dict[int, int] = {}
_IDS = itertools.count()

_LIB = torch.library.Library("tokenmill", "FRAGMENT")
_LIB.define("opaque_attention(Tensor q, Tensor k, Tensor v, int layer) -> Tensor")


def register(layer, out_features: int) -> int:
    """An id for `layer` (an attention.layer.Attention, held weakly so it can be freed) to pass to `attention`."""
    i = next(_IDS)
    _LAYERS[i] = weakref.ref(layer, lambda _, i=i: (_LAYERS.pop(i, None), _OUT.pop(i, None)))
    _OUT[i] = out_features
    return i


def _run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int) -> torch.Tensor:
    return _LAYERS[layer]().forward_opaque(q, k, v)


def _fake(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int) -> torch.Tensor:
    return q.new_empty(q.shape[0], _OUT[layer])


_LIB.impl("opaque_attention", _run, "CPU")
torch.library.register_fake("tokenmill::opaque_attention", _fake, lib=_LIB)

attention = torch.ops.tokenmill.opaque_attention.default
