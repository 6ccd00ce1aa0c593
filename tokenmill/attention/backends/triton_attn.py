"""Triton paged attention: store K/V, then prefill/chunked rows through the varlen prefill kernel and query_len-1
rows through the split-K decode kernel (a batch may mix both; each kernel skips the other's rows on the device).

Host-side planning reads only host values of the metadata (max_query_len, max_seq_len, query_start_loc_cpu), never
device tensors, so there is no sync; a pure-decode step (max_query_len <= 1) does no host work beyond the launches.
An fp8 cache is quantised by the store kernel and dequantised inside the attention kernels, with the layer's k/v
scales read from device memory (kernels/kv_fp8.py).
"""
from __future__ import annotations

import numpy as np
import torch

from tokenmill.attention.backend import AttentionBackend, AttentionMetadata
from tokenmill.kernels.kv_fp8 import check_triton_fp8_support, is_fp8
from tokenmill.kernels.triton_decode_attention import decode_attention, decode_config, decode_num_splits
from tokenmill.kernels.triton_decode_rope_attention import decode_rope_attention
from tokenmill.kernels.triton_kv_store import store_kv
from tokenmill.kernels.triton_prefill_attention import prefill_attention


class TritonAttentionBackend(AttentionBackend):
    """Paged prefill + split-K decode kernels; bf16 / fp16 / fp32 caches and fp8 (e4m3, e5m2) caches with scales."""

    name = "TRITON"
    supports_cuda_graphs = True  # pure-decode steps plan nothing on the host; captured mixed batches neither
    supports_prestored_kv = True  # forward(q, None, None, ...) when the K/V of the step are already in the cache
    FUSED_DECODE_MAX_ROWS = 16    # forward_decode_qkv: the small decode batches of the gemv regime
    FUSED_WITH_QK_NORM = False    # forward_decode_qkv also for models with per-head q/k norms (see there)

    def __init__(self, num_heads: int, head_size: int, num_kv_heads: int, scale: float,
                 sliding_window: int | None = None, logits_soft_cap: float | None = None) -> None:
        super().__init__(num_heads, head_size, num_kv_heads, scale, sliding_window, logits_soft_cap)
        # Fixed split count for the decode kernel (set it before capturing CUDA graphs: a captured launch keeps the
        # count it was captured with); None = a heuristic from the batch size and md.max_seq_len per call.
        self.decode_num_splits: int | None = None

    def _decode_splits(self, md: AttentionMetadata, dtype: torch.dtype) -> int:
        if self.decode_num_splits is not None:
            return self.decode_num_splits
        hq, hkv, d = self.num_heads, self.num_kv_heads, self.head_size
        rows = md.seq_lens.shape[0]
        keys = md.max_seq_len if self.sliding_window is None else min(md.max_seq_len, self.sliding_window)
        return decode_num_splits(rows, hkv, keys, md.seq_lens.device,
                                 block_n=decode_config(d, hq // hkv, dtype, rows)[0])

    def forward_decode_qkv(self, qkv, positions, rotary_emb, q_norm, k_norm, kv_cache,
                           md: AttentionMetadata) -> torch.Tensor | None:
        """A pure decode step straight from the qkv projection: RoPE, K/V store and attention in one stage-1 launch
        (kernels/triton_decode_rope_attention.py); None where that does not apply: prefill or mixed rows, more
        than FUSED_DECODE_MAX_ROWS rows, per-head q/k norms, an fp8 cache, logit soft-capping (not in that kernel).

        Why these limits: timed as the whole batch-1 decode graph on an H200, the fused launch makes Llama-3-8B
        1.6-1.7% faster than the separate rope/store kernel, but Qwen3-0.6B (q/k norms) 0.6% slower at a
        ~1266-token context and 1.1% slower at ~256, so models with q/k norms keep the separate kernel
        (FUSED_WITH_QK_NORM = True takes them too). Batches above FUSED_DECODE_MAX_ROWS have no such figure and
        keep it as well."""
        if md.captured_mixed or md.max_query_len > 1 or kv_cache.dtype != qkv.dtype \
                or (q_norm is not None and not self.FUSED_WITH_QK_NORM) \
                or md.seq_lens.shape[0] > self.FUSED_DECODE_MAX_ROWS or self.logits_soft_cap is not None:
            return None
        return decode_rope_attention(
            qkv, positions, md.slot_mapping, kv_cache, rotary_emb.cos_cache, rotary_emb.sin_cache,
            md.query_start_loc, md.seq_lens, md.block_table, num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads, head_dim=self.head_size, scale=self.scale,
            num_splits=self._decode_splits(md, qkv.dtype), rotary_dim=rotary_emb.rotary_dim,
            is_neox=rotary_emb.is_neox_style, num_tokens=md.num_actual_tokens,
            q_norm_weight=None if q_norm is None else q_norm.weight,
            k_norm_weight=None if k_norm is None else k_norm.weight,
            eps=q_norm.eps if q_norm is not None else 1e-6, sliding_window=self.sliding_window)

    def forward(self, q, k, v, kv_cache, md: AttentionMetadata, k_scale=None, v_scale=None):
        fp8 = is_fp8(kv_cache.dtype)
        if fp8 and kv_cache.is_cuda:
            check_triton_fp8_support(kv_cache.dtype, kv_cache.device.index or 0)
        t = md.num_actual_tokens
        hq, hkv, d = self.num_heads, self.num_kv_heads, self.head_size
        q = q[:t].view(t, hq, d)
        if k is not None:  # None: the caller already stored this step's K/V (fused rope + store)
            store_kv(k[:t].view(t, hkv, d), v[:t].view(t, hkv, d), kv_cache, md.slot_mapping[:t], k_scale, v_scale)
        out = torch.empty((t, hq, d), dtype=q.dtype, device=q.device)
        kc, vc = kv_cache[0], kv_cache[1]
        # A captured mixed batch runs both kernels, each skipping the other's rows on the device.
        has_prefill = md.captured_mixed or md.max_query_len > 1
        has_decode = md.captured_mixed or not has_prefill or bool((np.diff(md.query_start_loc_cpu) == 1).any())
        if has_prefill:
            prefill_attention(q, kc, vc, out, md.query_start_loc, md.seq_lens, md.block_table, self.scale,
                              num_tokens=t, skip_single=has_decode, max_query_len=md.max_query_len,
                              k_scale=k_scale, v_scale=v_scale, sliding_window=self.sliding_window,
                              softcap=self.logits_soft_cap)
        if has_decode:
            decode_attention(q, kc, vc, out, md.query_start_loc, md.seq_lens, md.block_table, self.scale,
                             num_splits=self._decode_splits(md, q.dtype), k_scale=k_scale, v_scale=v_scale,
                             sliding_window=self.sliding_window, softcap=self.logits_soft_cap)
        return out.view(t, hq * d)
