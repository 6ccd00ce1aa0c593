"""The Gated DeltaNet token mixer (Qwen3.5's / Qwen3-Next's linear-attention layers), tensor parallel by heads.

Per token: in_proj_qkv -> causal depthwise conv1d + SiLU -> split q / k / v heads; beta = sigmoid(in_proj_b x),
g = -exp(A_log) * softplus(in_proj_a x + dt_bias); the gated delta rule (layers/gated_deltanet_ops.py); a gated
RMSNorm with z = in_proj_z x; out_proj. Each rank holds Hk / tp key heads and the Hv / tp value heads that read
them (so Hk must divide by tp), and out_proj sums over ranks.

State: the forward context's `recurrent` entry (worker/state_cache.py) gives this layer's conv state
[slots, conv_dim, K - 1] and delta-rule state [slots, Hv, dk, dv] (float32), each request's slot, and whether the
request continues from its slot's state (it has computed tokens) or starts from zeros. A request with one token
and a state is a decode step: all of those are updated together; the others (prefills, prefill chunks) run one
sequence at a time. Without a `recurrent` entry (the profiling run) the whole batch runs as one sequence from
zeros and nothing is stored. On CUDA the decode rows run kernels/triton_gdn_decode.py (two launches: the conv
update; the gating, delta rule and gated RMSNorm), in place on the state caches; the CPU runs the torch ops.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.distributed import get_parallel_state
from tokenmill.forward_context import get_forward_context
from tokenmill.layers import gated_deltanet_ops as ops
from tokenmill.layers.linear import ColumnParallelLinear, MergedColumnParallelLinear, RowParallelLinear, divide


class GatedDeltaNet(nn.Module):
    """One linear-attention layer; `forward(x [T, hidden]) -> [T, hidden]`. `state_shapes()` gives this rank's
    ((conv_dim, K - 1), (Hv, dk, dv)) per request."""

    # Device types whose decode rows run the fused Triton kernels (tests add "cpu" to run them interpreted).
    fused_decode_devices = frozenset({"cuda"})

    def __init__(self, cfg, layer_idx: int, quant_config=None, prefix: str = "") -> None:
        super().__init__()
        ps = get_parallel_state()
        tp, rank = ps.tp_size, ps.tp_rank
        self.layer_idx = layer_idx
        self.hk, self.hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        self.dk, self.dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        if self.hv % self.hk:
            raise ValueError(f"linear_num_value_heads ({self.hv}) must be a multiple of linear_num_key_heads "
                             f"({self.hk}).")
        self.hk_here = divide(self.hk, tp, "linear_num_key_heads")
        self.hv_here = self.hv // tp
        key_dim, value_dim = self.hk * self.dk, self.hv * self.dv
        self.kernel = cfg.linear_conv_kernel_dim
        if getattr(cfg, "hidden_act", "silu") != "silu":
            raise ValueError(f"Gated DeltaNet: unsupported hidden_act {cfg.hidden_act!r} (only silu).")
        self.in_proj_qkv = MergedColumnParallelLinear(cfg.hidden_size, [key_dim, key_dim, value_dim],
                                                      quant_config=quant_config, prefix=f"{prefix}.in_proj_qkv")
        self.in_proj_z = ColumnParallelLinear(cfg.hidden_size, value_dim, quant_config=quant_config,
                                              prefix=f"{prefix}.in_proj_z")
        # b and a are tiny (one value per head): kept unquantized and stacked into one product.
        self.in_proj_ba = MergedColumnParallelLinear(cfg.hidden_size, [self.hv, self.hv],
                                                     prefix=f"{prefix}.in_proj_ba")
        self.out_proj = RowParallelLinear(value_dim, cfg.hidden_size, quant_config=quant_config,
                                          prefix=f"{prefix}.out_proj")
        kd_here, vd_here = self.hk_here * self.dk, self.hv_here * self.dv
        self.split = (kd_here, kd_here, vd_here)
        self.conv_dim = 2 * kd_here + vd_here
        # Checkpoint layout: conv1d.weight [2 * key_dim + value_dim, 1, K]; this rank's rows are its slice of each
        # of q, k and v, like in_proj_qkv's.
        self.conv1d = nn.Module()
        self.conv1d.weight = nn.Parameter(torch.empty(self.conv_dim, 1, self.kernel), requires_grad=False)
        self.conv1d.weight.weight_loader = self._load_conv(rank, (key_dim, key_dim, value_dim))
        self.A_log = nn.Parameter(torch.empty(self.hv_here), requires_grad=False)
        self.dt_bias = nn.Parameter(torch.empty(self.hv_here), requires_grad=False)
        for p in (self.A_log, self.dt_bias):
            p.weight_loader = self._load_heads(rank)
        self.norm = nn.Module()
        self.norm.weight = nn.Parameter(torch.ones(self.dv), requires_grad=False)
        self.eps = cfg.rms_norm_eps

    def _load_conv(self, rank: int, full_sizes: tuple[int, ...]):
        def load(param, loaded, shard_id=None):
            parts = loaded.split(list(full_sizes), dim=0)
            mine = [p.narrow(0, rank * here, here) for p, here in zip(parts, self.split)]
            param.data.copy_(torch.cat(mine).reshape(param.shape))
        return load

    def _load_heads(self, rank: int):
        def load(param, loaded, shard_id=None):
            param.data.copy_(loaded.narrow(0, rank * self.hv_here, self.hv_here))
        return load

    def state_shapes(self) -> tuple[tuple[int, int], tuple[int, int, int]]:
        return (self.conv_dim, self.kernel - 1), (self.hv_here, self.dk, self.dv)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[0]
        mixed = self.in_proj_qkv(x)
        z = self.in_proj_z(x).view(t, self.hv_here, self.dv)
        b, a = self.in_proj_ba(x).split([self.hv_here, self.hv_here], dim=-1)
        w = self.conv1d.weight[:, 0, :]
        st = get_forward_context().recurrent
        # On CUDA the decode rows take two fused launches (conv update, gating, delta rule and gated norm, in place
        # on the state caches) instead of ~45 small torch kernels: they write their rows of h; the torch path below
        # then runs only for prefill rows (or everything, on the CPU and in the profiling run).
        fused = st is not None and x.device.type in self.fused_decode_devices and len(st.decode_idx) > 0
        h = torch.empty(t, self.hv_here, self.dv, dtype=x.dtype, device=x.device) if fused else None
        if fused:
            from tokenmill.kernels.triton_gdn_decode import gdn_decode   # triton: a CUDA-only import
            gdn_decode(mixed, z, b, a, w, self.A_log, self.dt_bias, self.norm.weight, self.eps,
                       st.conv[self.layer_idx], st.ssm[self.layer_idx], st.decode_tokens, st.decode_slots, h,
                       hk=self.hk_here, hv=self.hv_here, dk=self.dk, dv=self.dv)
            if not len(st.prefill_idx):
                return self.out_proj(h.reshape(t, self.hv_here * self.dv))
        beta = b.float().sigmoid()
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias.float())
        out = torch.empty(t, self.hv_here, self.dv, dtype=x.dtype, device=x.device)
        if st is None:
            conv, _ = ops.causal_conv1d(mixed, w, None)
            out[:] = self._rule(conv, g, beta, None)[0]
        else:
            conv_cache, ssm_cache = st.conv[self.layer_idx], st.ssm[self.layer_idx]
            if len(st.decode_idx) and not fused:
                tok, slots = st.decode_tokens, st.decode_slots
                cstate = conv_cache.index_select(0, slots)
                conv = ops.causal_conv1d_update(mixed.index_select(0, tok), w, cstate)
                conv_cache.index_copy_(0, slots, cstate)
                sstate = ssm_cache.index_select(0, slots)
                q, k, v = self._heads(conv)
                o = ops.delta_rule_decode(q, k, v, g.index_select(0, tok), beta.index_select(0, tok), sstate)
                ssm_cache.index_copy_(0, slots, sstate)
                out.index_copy_(0, tok, o)
            for i in st.prefill_idx:
                qsl = st.query_start_loc_cpu
                s0, s1, slot = int(qsl[i]), int(qsl[i + 1]), int(st.slots_cpu[i])
                has = bool(st.has_state[i])
                # The chunk in pieces ending where a prefix-cache checkpoint is saved (core/state_checkpoints.py),
                # the state carried from piece to piece.
                cuts = st.saves.get(i, ())
                a = s0
                for b, ckpt in [(s0 + off, c) for off, c in cuts] + [(s1, None)]:
                    if b > a:
                        conv, cnew = ops.causal_conv1d(mixed[a:b], w, conv_cache[slot] if has else None)
                        conv_cache[slot].copy_(cnew)
                        o, snew = self._rule(conv, g[a:b], beta[a:b], ssm_cache[slot] if has else None)
                        ssm_cache[slot].copy_(snew)
                        out[a:b] = o
                        a, has = b, True
                    if ckpt is not None:
                        conv_cache[ckpt].copy_(conv_cache[slot])
                        ssm_cache[ckpt].copy_(ssm_cache[slot])
                if fused:  # the decode rows of h are done: normalise this sequence's rows only
                    h[s0:s1] = ops.gated_rms_norm(out[s0:s1], z[s0:s1], self.norm.weight, self.eps)
        if not fused:
            h = ops.gated_rms_norm(out, z, self.norm.weight, self.eps)
        return self.out_proj(h.reshape(t, self.hv_here * self.dv))

    def _heads(self, conv: torch.Tensor):
        t = conv.shape[0]
        q, k, v = conv.split(self.split, dim=-1)
        return (q.reshape(t, self.hk_here, self.dk), k.reshape(t, self.hk_here, self.dk),
                v.reshape(t, self.hv_here, self.dv))

    def _rule(self, conv, g, beta, state):
        q, k, v = self._heads(conv)
        return ops.delta_rule_prefill(q, k, v, g, beta, state)


def recurrent_state_bytes(shapes: dict[int, tuple[tuple[int, ...], tuple[int, ...]]], conv_dtype: torch.dtype) -> int:
    """Bytes of one request's recurrent state over the layers of `shapes` (per layer ((conv_dim, K - 1),
    (Hv, dk, dv)), as `state_shapes()` gives them): the conv state in conv_dtype, the delta-rule state in float32."""
    elem = torch.empty((), dtype=conv_dtype).element_size()
    return sum(math.prod(c) * elem + math.prod(s) * 4 for c, s in shapes.values())
