"""Pipeline parallelism: which decoder layers a stage owns, the placeholders for the rest, and the link that
passes one micro-batch's hidden states + residual from a stage to the next.

Models stay free of communication: a stage's model takes `IntermediateTensors` in (all but the first stage) and
returns them (all but the last stage); the model runner moves them over the PP group with `StageLink`.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from tokenmill.distributed.parallel_state import ParallelState


def pp_layer_range(num_layers: int, pp_rank: int, pp_size: int) -> tuple[int, int]:
    """[start, end) of the decoder layers stage `pp_rank` owns: an even split; the remainder goes one layer each to
    the stages just before the last, counting backwards from the second-to-last (the last stage also runs the
    final norm, the LM head and sampling, and the first the embedding, which costs little). 5 layers on 2 stages:
    [0, 3) and [3, 5); 10 on 4: 2, 3, 3, 2."""
    if num_layers < pp_size:
        raise ValueError(f"num_hidden_layers ({num_layers}) is smaller than pipeline_parallel_size ({pp_size}); "
                         "every stage needs at least one layer.")
    sizes = [num_layers // pp_size] * pp_size
    for i in range(num_layers % pp_size):
        sizes[-2 - i] += 1
    start = sum(sizes[:pp_rank])
    return start, start + sizes[pp_rank]


class PPMissingLayer(nn.Module):
    """Stands where a module of another pipeline stage would be: holds no parameters (so nothing is allocated or
    loaded for it) and must never run."""

    def forward(self, *args, **kwargs):
        raise RuntimeError("A layer of another pipeline stage was called on this stage.")


def is_pp_missing(module: nn.Module) -> bool:
    return isinstance(module, PPMissingLayer)


def missing_prefixes(model: nn.Module) -> tuple[str, ...]:
    """Parameter-name prefixes ("model.layers.3.", "lm_head.", ...) that belong to other stages: checkpoint
    tensors starting with one of them are skipped by this stage's loader."""
    return tuple(f"{name}." for name, m in model.named_modules() if isinstance(m, PPMissingLayer))


@dataclass
class IntermediateTensors:
    """What one stage hands the next for a micro-batch: the hidden states and the residual stream, [T, H] each."""
    hidden: torch.Tensor
    residual: torch.Tensor


class StageLink:
    """Point-to-point transfer of IntermediateTensors between neighbouring stages of one TP rank's PP group.

    Contract: every stage processes micro-batches in the same order, so stage s's k-th `send` is stage s+1's k-th
    `recv` (the transport delivers in order). `send` does not wait for the receiver: the tensors are kept alive
    until their transfer completes, so the first stage can launch the next micro-batch while the others compute.
    TP ranks of a stage each send their own (identical, all-reduced) copy to their peer in the next stage.
    """

    def __init__(self, state: ParallelState, hidden_size: int, dtype: torch.dtype, device: torch.device) -> None:
        self.state = state
        self.hidden_size, self.dtype, self.device = hidden_size, dtype, device
        self.prev_rank = state.rank - state.tp_size if state.pp_rank > 0 else None
        self.next_rank = state.rank + state.tp_size if state.pp_rank < state.pp_size - 1 else None
        self._pending: list[tuple[object, torch.Tensor]] = []

    def send(self, tensors: IntermediateTensors) -> None:
        import torch.distributed as dist
        self._pending = [(w, t) for w, t in self._pending if not w.is_completed()]
        # One message per micro-batch: a single transfer keeps send/recv matching trivial.
        buf = torch.stack((tensors.hidden, tensors.residual)).contiguous()
        self._pending.append((dist.isend(buf, dst=self.next_rank, group=self.state.pp_group), buf))

    def drain(self) -> None:
        """Wait for the sends still in flight (before the groups are torn down: a gloo send dropped unfinished at
        exit could abort the process)."""
        pending, self._pending = self._pending, []
        for work, _ in pending:
            try:
                work.wait()
            except Exception:  # a peer already gone: nothing left to deliver
                pass

    def recv(self, num_tokens: int) -> IntermediateTensors:
        import torch.distributed as dist
        buf = torch.empty((2, num_tokens, self.hidden_size), dtype=self.dtype, device=self.device)
        dist.recv(buf, src=self.prev_rank, group=self.state.pp_group)
        return IntermediateTensors(buf[0], buf[1])
