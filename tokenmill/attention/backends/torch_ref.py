"""Pure-PyTorch paged attention: the CPU backend and the oracle the GPU kernels are checked against."""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from tokenmill.attention.backend import AttentionBackend, AttentionMetadata
from tokenmill.kernels.kv_fp8 import dequantize, is_fp8, quantize, require_scales


def write_kv(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor,
             k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> None:
    """Scatter K/V of each token into its slot. kv_cache [2, N, bs, H, D]; k, v [T, H, D]. An fp8 cache stores
    fp8(x / scale)."""
    _, n, bs, h, d = kv_cache.shape
    flat = kv_cache.view(2, n * bs, h, d)
    if is_fp8(kv_cache.dtype):
        require_scales(k_scale, v_scale)
        # index_copy_ has no fp8 kernel on CPU; the bytes are the same through a uint8 view.
        k = quantize(k, k_scale, kv_cache.dtype).view(torch.uint8)
        v = quantize(v, v_scale, kv_cache.dtype).view(torch.uint8)
        flat = flat.view(torch.uint8)
    flat[0].index_copy_(0, slot_mapping, k.to(flat.dtype))
    flat[1].index_copy_(0, slot_mapping, v.to(flat.dtype))


class TorchRefBackend(AttentionBackend):
    """Straightforward and exact: decodes are batched into one padded attention, prefills run one request each.
    An fp8 cache is dequantised (float(fp8) * scale) right after the gather, so it works on any device. With a
    sliding window only the blocks holding keys inside some query's window are gathered."""

    name = "TORCH_REF"

    def forward(self, q, k, v, kv_cache, md: AttentionMetadata, k_scale=None, v_scale=None):
        t = md.num_actual_tokens
        q = q[:t].view(t, self.num_heads, self.head_size)
        k = k[:t].view(t, self.num_kv_heads, self.head_size)
        v = v[:t].view(t, self.num_kv_heads, self.head_size)
        write_kv(kv_cache, k, v, md.slot_mapping[:t], k_scale, v_scale)
        if md.max_query_len == 1 and self._sdpa_decode_ok(q, kv_cache):
            return self._decode_sdpa(q, kv_cache, md)
        scales = (k_scale, v_scale)
        out = torch.empty_like(q)
        qsl, seq_lens = md.query_start_loc_cpu, md.seq_lens_cpu
        query_lens = qsl[1:] - qsl[:-1]
        decode_rows = (query_lens == 1).nonzero()[0]
        if len(decode_rows):
            self._decode(q, kv_cache, md, decode_rows, out, scales)
        for i in (query_lens > 1).nonzero()[0]:
            s, e = int(qsl[i]), int(qsl[i + 1])
            out[s:e] = self._prefill(q[s:e], kv_cache, self._prefill_plan(md, int(i), kv_cache, q), scales,
                                     (k[s:e], v[s:e]))
        return out.view(t, self.num_heads * self.head_size)

    def _prefill_plan(self, md: AttentionMetadata, i: int, kv_cache: torch.Tensor, q: torch.Tensor):
        """What every layer of a kind gathers and masks for request i's chunk of this step (computed by the first
        layer, reused by the others): (the ids of its K blocks then its V blocks in the cache viewed as
        [2 x blocks, ...], or None when the chunk attends to its own K/V only; keys read; the query x key mask).
        A chunk with nothing before it attends to its K/V as computed rather than gathering them back, where the
        cache holds exactly those values (its dtype is the activations'); a bf16 or fp8 cache is read back, so that
        a prefix-cache hit computes what the miss did."""
        w = self.sliding_window
        plan_key = ("torch_ref_prefill", w, i, kv_cache.dtype == q.dtype)
        plan = md.plans.get(plan_key)
        if plan is not None:
            return plan
        seq_len = int(md.seq_lens_cpu[i])
        ql = int(md.query_start_loc_cpu[i + 1] - md.query_start_loc_cpu[i])
        ctx = seq_len - ql
        n, bs = kv_cache.shape[1], kv_cache.shape[2]
        first = max(ctx - w + 1, 0) // bs if w is not None else 0   # the first block any query's window reaches
        length = seq_len - first * bs
        ids = None
        if ctx or kv_cache.dtype != q.dtype:
            blocks = md.block_table[i, first:first + -(-length // bs)].long()
            ids = torch.cat((blocks, blocks + n))
        # Query j sits at position ctx + j and sees keys 0..ctx + j (with a window W: ctx + j - W + 1..ctx + j).
        kpos = first * bs + torch.arange(length, device=q.device)[None, :]
        qpos = (ctx + torch.arange(ql, device=q.device))[:, None]
        mask = kpos <= qpos
        if w is not None:
            mask &= kpos > qpos - w
        plan = md.plans[plan_key] = (ids, length, mask)
        return plan

    def _prefill(self, q: torch.Tensor, kv_cache: torch.Tensor, plan, scales,
                 fresh: tuple[torch.Tensor, torch.Tensor]):
        """One request's chunk (plan: `_prefill_plan`'s); fresh: the chunk's own K/V."""
        ids, length, mask = plan
        if ids is None:
            key, value = fresh
        else:
            _, n, bs, h, d = kv_cache.shape
            # K and V blocks in one gather: index_select along dim 0 copies whole contiguous blocks.
            kv = kv_cache.view(2 * n, bs, h, d).index_select(0, ids).view(2, -1, h, d)
            key, value = kv[0, :length], kv[1, :length]
        group = self.num_heads // self.num_kv_heads
        key = dequantize(key, scales[0], q.dtype)
        value = dequantize(value, scales[1], q.dtype)
        if self.logits_soft_cap is None and not q.is_cuda:
            # Batched 4-D inputs with grouped heads take torch's fused CPU attention (3-D inputs with repeated
            # K/V heads take its unfused path: 15.3 against 6.6 ms a layer for a 500-token prompt, 2 cores).
            o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], key.transpose(0, 1)[None],
                                               value.transpose(0, 1)[None], attn_mask=mask, scale=self.scale,
                                               enable_gqa=group > 1)[0]
            return o.transpose(0, 1)
        key = key.repeat_interleave(group, dim=1).transpose(0, 1)  # [Hq, L, D]
        value = value.repeat_interleave(group, dim=1).transpose(0, 1)
        if self.logits_soft_cap is None:
            o = F.scaled_dot_product_attention(q.transpose(0, 1), key, value, attn_mask=mask, scale=self.scale)
        else:
            scores = self._capped(torch.matmul(q.transpose(0, 1).float(), key.float().transpose(1, 2)) * self.scale)
            scores = scores.masked_fill(~mask, float("-inf"))
            o = torch.matmul(scores.softmax(dim=-1), value.float()).to(q.dtype)
        return o.transpose(0, 1)

    def _capped(self, scores: torch.Tensor) -> torch.Tensor:
        c = self.logits_soft_cap
        return scores if c is None else torch.tanh(scores / c) * c

    def _decode_plan(self, md: AttentionMetadata, rows: np.ndarray, bs: int, dev: torch.device):
        """What every layer of one step gathers and masks for its decode rows (the same block table, lengths and
        window in every layer of a kind): computed by the first layer, reused by the others."""
        w = self.sliding_window
        key = ("torch_ref_decode", w, bs)
        plan = md.plans.get(key)
        if plan is not None:
            return plan
        rows_t = torch.as_tensor(rows, device=dev)
        lens = md.seq_lens_cpu[rows].astype(np.int64)
        # Row r reads its blocks from first[r] on: 0, or the block of its oldest key in the window.
        first = np.maximum(lens - w, 0) // bs if w is not None else np.zeros_like(lens)
        nb = int((-(-lens // bs) - first).max())
        cols = first[:, None] + np.arange(nb)[None, :]
        width = md.block_table.shape[1]
        cols_t = torch.as_tensor(np.minimum(cols, width - 1), device=dev)
        ids = md.block_table[rows_t[:, None], cols_t].long().reshape(-1)           # [B * nb]
        span = nb * bs
        kpos = first[:, None] * bs + np.arange(span)[None, :]
        valid = kpos < lens[:, None]
        if w is not None:
            valid &= kpos >= lens[:, None] - w
        valid_t = torch.as_tensor(valid, device=dev)
        plan = md.plans[key] = (ids, span, md.query_start_loc[rows_t].long(), valid_t,
                                ~valid_t[:, None, None, :], None if w is None else ~valid_t[:, :, None, None])
        return plan

    def _sdpa_decode_ok(self, q: torch.Tensor, kv_cache: torch.Tensor) -> bool:
        """A CPU step of decodes only, fp32 activations, full attention without soft-capping: torch's fused
        attention op replaces the dozen small ops of `_decode` (the CPU step is bound by per-op overhead). The cache
        is fp32 or bf16; from a bf16 cache the gathered K/V are attended to in bf16 (q rounded to bf16; the op
        accumulates in fp32) rather than widened first, which would copy them once more: a step of many rows is
        bound by those bytes (default model, 2 cores, AMX, 32 rows: converting first saved nothing, 84 -> 82 ms a
        step; bf16 attention 67). The CUDA oracle keeps the explicit path."""
        return (not q.is_cuda and q.dtype == torch.float32 and kv_cache.dtype in (torch.float32, torch.bfloat16)
                and self.sliding_window is None and self.logits_soft_cap is None)

    def _decode_sdpa(self, q: torch.Tensor, kv_cache: torch.Tensor, md: AttentionMetadata) -> torch.Tensor:
        _, _, bs, h, d = kv_cache.shape
        b = md.num_actual_tokens
        key = ("torch_ref_sdpa", bs)
        plan = md.plans.get(key)
        if plan is None:
            ids, span, _, valid, _, _ = self._decode_plan(md, np.arange(b), bs, q.device)
            # Columns past a row's length (its last block's tail, shorter rows' padding) are masked out.
            # One gather of K and V on dim 0 of the [2 * blocks, ...] view (see forward_decode_qkv).
            n = kv_cache.shape[1]
            plan = md.plans[key] = (torch.cat((ids, ids + n)), span,
                                    None if bool(valid.all()) else valid[:, None, None, :])
        ids, span, mask = plan
        kv = kv_cache.view(-1, bs, h, d).index_select(0, ids).view(2, b, span, h, d).transpose(2, 3)
        # The query heads sharing a KV head go in as that head's queries (one decode row needs no causal mask):
        # torch's CPU attention then runs B x KV-heads problems, each reading its K/V once, instead of B x
        # query-heads problems of one query (32 rows x 96 keys, 9 / 3 heads: 0.31 -> 0.15 ms fp32, 0.19 -> 0.13 bf16).
        o = F.scaled_dot_product_attention(q.view(b, h, self.num_heads // h, d).to(kv.dtype), kv[0], kv[1],
                                           attn_mask=mask, scale=self.scale)
        return o.reshape(b, self.num_heads * d).to(q.dtype)

    def forward_decode_qkv(self, qkv: torch.Tensor, positions: torch.Tensor, rotary_emb, q_norm, k_norm,
                           kv_cache: torch.Tensor, md: AttentionMetadata) -> torch.Tensor | None:
        """A step of decodes straight from the fused qkv output (Attention.forward_qkv), or None where it does
        not apply (the unfused path then runs). The same arithmetic as rotary_emb + forward in about half the ops:
        q and k heads rotate together, K and V go into the cache in one scatter and come back in one gather, and
        a row's keys are cut to its length instead of masked when the step has one row. Worth it where the step
        is bound by per-op overhead (the CPU: 33 -> 30 ms a token, default model, 2 cores)."""
        if (qkv.is_cuda or md.max_query_len != 1 or q_norm is not None or not self._sdpa_decode_ok(qkv, kv_cache)
                or not rotary_emb.is_neox_style or rotary_emb.rotary_dim != self.head_size):
            return None
        t, nh, h, d = md.num_actual_tokens, self.num_heads, self.num_kv_heads, self.head_size
        cos, sin = rotary_emb._cos_sin(positions, qkv.dtype)   # the step's tables, cached for its every layer
        qk = rotary_emb.rotate_heads(qkv[:, :(nh + h) * d].view(-1, nh + h, d), cos, sin)[:t]
        return self._decode_rows(qk[:, :nh], torch.cat((qk[:, nh:], qkv[:t, (nh + h) * d:].view(t, h, d))),
                                 kv_cache, md)

    def forward_decode(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                       md: AttentionMetadata) -> torch.Tensor | None:
        """A step of decodes from rotated q [T, heads x D] and new k, v [T, KV heads x D] (compiled models call
        this through layers/opaque_attention.py), or None where it does not apply (then `forward`)."""
        if md.max_query_len != 1 or not self._sdpa_decode_ok(q, kv_cache):
            return None
        t, nh, h, d = md.num_actual_tokens, self.num_heads, self.num_kv_heads, self.head_size
        return self._decode_rows(q[:t].view(t, nh, d), torch.cat((k[:t].view(t, h, d), v[:t].view(t, h, d))),
                                 kv_cache, md)

    def _decode_rows(self, q: torch.Tensor, kv_new: torch.Tensor, kv_cache: torch.Tensor,
                     md: AttentionMetadata) -> torch.Tensor:
        """One decode token per row: q [T, heads, D] rotated, kv_new [2T, KV heads, D] (the rows' K then V)."""
        t, nh, h, d = md.num_actual_tokens, self.num_heads, self.num_kv_heads, self.head_size
        _, n, bs, _, _ = kv_cache.shape
        key = ("torch_ref_qkv", bs)
        plan = md.plans.get(key)
        if plan is None:
            ids, span, _, valid, _, _ = self._decode_plan(md, np.arange(t), bs, q.device)
            if t == 1:  # cut to the one row's length: no mask
                mask, span = None, int(md.seq_lens_cpu[0])
            else:
                mask = None if bool(valid.all()) else torch.zeros(valid.shape, dtype=kv_cache.dtype).masked_fill(
                    ~valid, float("-inf"))[:, None, None, :]
            # K and V move through the cache viewed as [2 * blocks, ...]: index_select / index_copy_ on dim 0
            # copy whole rows, 4x faster than on dim 1 of [2, blocks, ...] (16 rows of 256 tokens, default
            # model's heads, 2 cores: 1.09 against 0.25 ms a layer).
            slots = md.slot_mapping[:t]
            plan = md.plans[key] = (torch.cat((ids, ids + n)), span, mask, torch.cat((slots, slots + n * bs)))
        ids, span, mask, slots = plan
        kv_cache.view(2 * n * bs, h, d).index_copy_(0, slots, kv_new.to(kv_cache.dtype))
        kv = kv_cache.view(2 * n, bs, h, d).index_select(0, ids).view(2, t, -1, h, d)[:, :, :span].transpose(2, 3)
        # A bf16 cache under fp32 activations: attention in bf16 (see _sdpa_decode_ok). The query heads of a KV
        # head go in as that head's queries (see _decode_sdpa).
        o = F.scaled_dot_product_attention(q.reshape(t, h, nh // h, d).to(kv.dtype), kv[0], kv[1],
                                           attn_mask=mask, scale=self.scale)
        return o.reshape(t, nh * d).to(kv_new.dtype)

    def _decode(self, q, kv_cache, md: AttentionMetadata, rows, out, scales) -> None:
        _, _, bs, h, d = kv_cache.shape
        ids, span, token_idx, valid, score_mask, value_mask = self._decode_plan(md, rows, bs, q.device)
        b = len(rows)
        k = dequantize(kv_cache[0].index_select(0, ids).view(b, span, h, d), scales[0], q.dtype)
        v = dequantize(kv_cache[1].index_select(0, ids).view(b, span, h, d), scales[1], q.dtype)
        if value_mask is not None:
            # Padded columns may name any block (freed ones included): zero them so 0-weights times junk stay 0.
            v = v.masked_fill(value_mask, 0)
        group = self.num_heads // self.num_kv_heads
        qd = q[token_idx].view(b, self.num_kv_heads, group, d).float()          # [B, Hkv, G, D]
        scores = self._capped(torch.matmul(qd, k.float().permute(0, 2, 3, 1)) * self.scale)  # [B, Hkv, G, L]
        scores = scores.masked_fill(score_mask, float("-inf"))
        o = torch.matmul(scores.softmax(dim=-1), v.float().permute(0, 2, 1, 3))  # [B, Hkv, G, D]
        out[token_idx] = o.reshape(b, self.num_heads, d).to(out.dtype)
