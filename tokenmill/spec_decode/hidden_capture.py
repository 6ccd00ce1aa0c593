"""The seam through which a target model hands an EAGLE head its hidden states.

A model that can feed an EAGLE head has `capture_hidden_states(capture)` (models/llama.py); once given a
HiddenCapture, every forward writes, for each of its input tokens in order, the residual stream entering each layer
of `layers` and / or its final (normed) hidden state into one preallocated buffer. The buffer is static, so the
writes are captured into the target's CUDA graphs like any other kernel; rows past the step's real tokens (graph
padding) hold garbage that nobody reads. Without a capture the model's forward is unchanged.
"""
from __future__ import annotations

import torch


class HiddenCapture:
    """Contract: `buffer[:T]` holds, after a target forward over T tokens, one row per token: the columns of
    slot s (s-th entry of `layers`, then `final` last) are `buffer[:, s * H:(s + 1) * H]`. `rows` bounds T (the
    largest step or captured graph); a larger forward raises."""

    def __init__(self, layers: tuple[int, ...], final: bool, rows: int, hidden_size: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.layers = layers  # a layer may be listed twice: `layer_input` fills each of its slots
        self._wanted = frozenset(layers)
        self.final = final
        self.H = hidden_size
        self.width = hidden_size * (len(layers) + int(final))
        self.buffer = torch.zeros((rows, self.width), dtype=dtype, device=device)

    def _cols(self, s: int, t: int) -> torch.Tensor:
        if t > self.buffer.shape[0]:
            raise RuntimeError(f"HiddenCapture: a forward of {t} tokens, more than the {self.buffer.shape[0]} rows "
                               "sized for it")
        return self.buffer[:t, s * self.H:(s + 1) * self.H]

    def wants(self, layer: int) -> bool:
        return layer in self._wanted

    def layer_input(self, layer: int, hidden: torch.Tensor, residual: torch.Tensor | None) -> None:
        """Record the residual stream entering `layer` (hidden + residual in tokenmill's deferred-add layers)."""
        t = hidden.shape[0]
        for s, li in enumerate(self.layers):
            if li == layer:
                if residual is None:
                    self._cols(s, t).copy_(hidden)
                else:
                    torch.add(hidden, residual, out=self._cols(s, t))

    def final_hidden(self, hidden: torch.Tensor) -> None:
        if self.final:
            self._cols(len(self.layers), hidden.shape[0]).copy_(hidden)
