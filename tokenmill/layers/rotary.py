"""Rotary position embeddings with a precomputed cos/sin table.

Inverse frequencies come from transformers' own RoPE initialisers (default, linear, dynamic, yarn, llama3,
longrope...), so every scaling type a HF config can name matches HF exactly; the table is built once in fp32.
"""
from __future__ import annotations

import torch
from torch import nn

from tokenmill.transformers_utils.config_snapshot import hf_config_object


def compute_inv_freq(hf_config, head_dim: int, max_model_len: int,
                     partial_rotary: bool = True) -> tuple[torch.Tensor, float, int]:
    """Returns (inv_freq [rotary_dim / 2], attention scaling applied to cos/sin, rotary_dim). For LongRoPE these are
    the short factors; `long_inv_freq` gives the long ones.

    partial_rotary: whether the architecture rotates only `partial_rotary_factor` of each head (HF's Phi-3 and
    Qwen3.5 do). HF's Llama, Mistral, Qwen2, Qwen3 and Gemma rotate the whole head whatever the config says with
    the default RoPE, and fail with any other type; tokenmill does the same and refuses the latter."""
    from tokenmill.transformers_utils.config import get_rope_params
    params = get_rope_params(hf_config)
    rope_type = params.get("rope_type", "default")
    partial = params.get("partial_rotary_factor", getattr(hf_config, "partial_rotary_factor", 1.0)) or 1.0
    if not partial_rotary and partial != 1.0:
        if rope_type != "default":
            name = getattr(hf_config, "class_name", type(hf_config).__name__)
            raise ValueError(f"partial_rotary_factor={partial} with rope type {rope_type!r} is not supported for "
                             f"{name} (HF transformers rotates the whole head for this "
                             "architecture and cannot run this combination).")
        partial = 1.0  # as HF: the default RoPE of these architectures reads no partial_rotary_factor
    rotary_dim = int(head_dim * partial)
    if rope_type == "default":
        base = float(params["rope_theta"])
        exps = torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim
        return 1.0 / (base ** exps), 1.0, rotary_dim
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    if rope_type not in ROPE_INIT_FUNCTIONS:
        raise ValueError(f"Unsupported rope type {rope_type!r}; supported: default, "
                         f"{', '.join(ROPE_INIT_FUNCTIONS)}.")
    # Dynamic NTK: the plain frequencies, HF's within max_position_embeddings (longer prompts read the table of
    # `long_inv_freq`, see transformers_utils.config.longrope_switch).
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf_config_object(hf_config), torch.device("cpu"))
    return inv_freq.float(), float(scaling), rotary_dim


def long_inv_freq(hf_config, max_model_len: int) -> torch.Tensor:
    """The inverse frequencies of prompts past the pretraining length (see transformers_utils.config.longrope_switch):
    LongRoPE's long factors, or dynamic NTK's base stretched for max_model_len."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from tokenmill.transformers_utils.config import get_rope_params
    rope_type = get_rope_params(hf_config)["rope_type"]
    inv_freq, _ = ROPE_INIT_FUNCTIONS[rope_type](hf_config_object(hf_config), torch.device("cpu"),
                                        seq_len=max_model_len)
    return inv_freq.float()


class RotaryEmbedding(nn.Module):
    """Applies RoPE (neox layout: the two halves of the rotary dims rotate together) to q and k in place of a copy."""

    def __init__(self, inv_freq: torch.Tensor, head_dim: int, rotary_dim: int, max_position: int,
                 scaling: float = 1.0, is_neox_style: bool = True, long_inv_freq: torch.Tensor | None = None,
                 long_prompt_len: int | None = None) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.rotary_dim = rotary_dim
        self.is_neox_style = is_neox_style
        # With `long_inv_freq` (LongRoPE), rows [max_position, 2 * max_position) hold the long factors' table:
        # position p of a request whose prompt is longer than long_prompt_len is looked up at p + long_offset.
        self.long_offset = max_position if long_inv_freq is not None else 0
        self.long_prompt_len = long_prompt_len if long_inv_freq is not None else None
        t = torch.arange(max_position, dtype=torch.float32)  # on the default device (the model's, at build time)
        freqs = t[:, None] * inv_freq.to(t.device)[None, :]
        if long_inv_freq is not None:
            freqs = torch.cat([freqs, t[:, None] * long_inv_freq.to(t.device)[None, :]])
        self.register_buffer("cos_cache", freqs.cos() * scaling, persistent=False)
        self.register_buffer("sin_cache", freqs.sin() * scaling, persistent=False)
        self._rows = None   # (positions, dtype, cos, sin) of the step being run (see _cos_sin)
        self._full = None   # (cos, [cos, cos], [-sin, sin]) of that step (see rotate_heads)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        t = x.shape[0]
        x = x.view(t, -1, self.head_dim)
        if self.is_neox_style and self.rotary_dim == self.head_dim:
            return self.rotate_heads(x, cos, sin).reshape(t, -1)
        rot, rest = x[..., :self.rotary_dim], x[..., self.rotary_dim:]
        if self.is_neox_style:
            x1, x2 = rot.chunk(2, dim=-1)
            out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
        else:
            x1, x2 = rot[..., 0::2], rot[..., 1::2]
            out = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
        if rest.shape[-1]:
            out = torch.cat((out, rest), dim=-1)
        return out.reshape(t, -1)

    def rotate_heads(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [T, H, head_dim] rotated over all its dims, neox layout, as a new tensor; cos, sin from `_cos_sin`.
        The halves' rotation [x1 cos - x2 sin, x2 cos + x1 sin] is x * [cos, cos] + roll(x) * [-sin, sin]
        (roll(x) = [x2, x1]): the same products and sums, rounded alike, in four ops instead of eight."""
        cos2, sin2 = self._full_tables(cos, sin)
        return x * cos2 + x.roll(self.head_dim // 2, -1) * sin2

    def _full_tables(self, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """([cos, cos], [-sin, sin]) of the step's rows, built once per step beside them (see _cos_sin)."""
        if torch.compiler.is_compiling():  # no module state in a compiled graph: inductor fuses these anyway
            return torch.cat((cos, cos), -1), torch.cat((-sin, sin), -1)
        hit = self._full
        if hit is not None and hit[0] is cos:
            return hit[1], hit[2]
        cos2, sin2 = torch.cat((cos, cos), -1), torch.cat((-sin, sin), -1)
        self._full = (cos, cos2, sin2)
        return cos2, sin2

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        if q.is_cuda:  # in place on the q/k views of the fused qkv output
            from tokenmill.kernels.triton_norm_rope_act import rotary_embedding
            return rotary_embedding(positions, q, k, self.cos_cache, self.sin_cache, self.head_dim,
                                    self.rotary_dim, self.is_neox_style)
        cos, sin = self._cos_sin(positions, q.dtype)
        if torch.compiler.is_compiling():  # inductor fuses the rotations; no pointer tricks to trace
            return self._rotate(q, cos, sin), self._rotate(k, cos, sin)
        esize = q.element_size()
        if (q.dim() == 2 and q.stride() == k.stride() and q.stride(-1) == 1
                and k.data_ptr() == q.data_ptr() + q.shape[-1] * esize):
            # q and k side by side in the fused qkv output (the usual case): one rotation of both heads' sets
            # halves the small ops, which bound the CPU step.
            qk = self._rotate(q.as_strided((q.shape[0], q.shape[1] + k.shape[1]), q.stride()), cos, sin)
            return qk[:, :q.shape[1]], qk[:, q.shape[1]:]
        return self._rotate(q, cos, sin), self._rotate(k, cos, sin)

    def _cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The table rows of `positions` ([T, 1, rotary_dim / 2] each). Every layer of a step passes the same
        positions tensor: the rows are looked up once per step. Callers pass a fresh tensor per forward (the
        runners build positions from host arrays each step); one refilled in place would need its own call."""
        if torch.compiler.is_compiling():  # the compiled graph looks the rows up once for all its layers
            return self.cos_cache[positions].to(dtype)[:, None, :], self.sin_cache[positions].to(dtype)[:, None, :]
        hit = self._rows
        if hit is not None and hit[0] is positions and hit[1] == dtype:
            return hit[2], hit[3]
        cos = self.cos_cache[positions].to(dtype)[:, None, :]
        sin = self.sin_cache[positions].to(dtype)[:, None, :]
        self._rows = (positions, dtype, cos, sin)
        return cos, sin
