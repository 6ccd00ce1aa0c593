"""Launch configurations of the skinny GEMM (tokenmill/kernels/triton_gemv.py) and where the gemv takes a product.

`MEASURED_FASTER` is the measured table: a product (M bucket, N, K, prologue) takes the gemv path in the model
(`prefer_gemv`) only where a config of it beat cuBLAS on the H200; `default_config` is the heuristic for everything
else (with the table's plain-product configs as overrides, `TUNED`). tools/bench_gemv.py and tools/graph_ab.py are
how entries are found and checked.
"""
from __future__ import annotations

import dataclasses
import functools

import triton


@dataclasses.dataclass(frozen=True)
class GemvConfig:
    """One launch configuration. split_k is the requested number of K splits; the launch uses
    ceil(K / k_per_split) with k_per_split rounded up to a multiple of block_k, so it may use fewer."""

    block_n: int = 64
    block_k: int = 128
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3
    use_dot: bool = True
    prefetch: bool = False      # two W tiles in flight per program, both first ones before the PDL wait
    acc2d: bool = False         # FMA path: reduce over K every step (fewer registers, more programs per SM)
    xprefetch: bool = False     # x (and the prologue's residual / norm weight) loaded one K step ahead

    def __post_init__(self) -> None:
        for name in ("block_n", "block_k"):
            v = getattr(self, name)
            if v < 1 or v & (v - 1):
                raise ValueError(f"GemvConfig.{name} must be a power of two, got {v}")
            if self.use_dot and v < 16:
                raise ValueError(f"GemvConfig.{name} must be >= 16 with use_dot=True (tl.dot), got {v}")
        if self.split_k < 1:
            raise ValueError(f"GemvConfig.split_k must be >= 1, got {self.split_k}")
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"GemvConfig.num_warps must be 1, 2, 4, 8 or 16, got {self.num_warps}")
        if self.num_stages < 1:
            raise ValueError(f"GemvConfig.num_stages must be >= 1, got {self.num_stages}")
        if self.acc2d and self.use_dot:
            raise ValueError("GemvConfig.acc2d applies to the FMA path: it needs use_dot=False")


# Where gemv beat cuBLAS (F.linear plus, for a prologue, the separate norm / SiLU kernel) by more than 3%, from
# `python3 tools/bench_gemv.py` on one H200 (torch 2.11, triton 3.6), 2026-11-30, each timed as a CUDA-graph replay:
# (M bucket, N, K, prologue) -> (best config, cuBLAS us, gemv us). Only these products take the gemv path in the
# model (`prefer_gemv`); everything else stays on cuBLAS, which was as fast or faster there.
MEASURED_FASTER: dict[tuple[int, int, int, str | None], tuple[GemvConfig, float, float]] = {
    (2, 1024, 2048, None): (GemvConfig(32, 128, 8, 4, 3, use_dot=True), 10.55, 5.66),
    (4, 1024, 2048, None): (GemvConfig(32, 128, 8, 4, 3, use_dot=True), 10.36, 5.71),
    (8, 1024, 2048, None): (GemvConfig(32, 256, 4, 4, 3, use_dot=True), 6.12, 5.78),
    (2, 1024, 3072, 'silu_mul'): (GemvConfig(16, 256, 8, 4, 1, use_dot=False), 9.12, 6.67),
    (2, 151936, 1024, None): (GemvConfig(128, 128, 1, 4, 3, use_dot=True), 75.85, 72.43),
    (4, 151936, 1024, None): (GemvConfig(128, 128, 1, 4, 3, use_dot=True), 77.03, 73.21),
    (8, 151936, 1024, None): (GemvConfig(64, 256, 1, 4, 3, use_dot=True), 78.0, 75.1),
    (1, 6144, 4096, None): (GemvConfig(64, 128, 1, 4, 5, use_dot=True), 16.46, 15.35),
    (2, 6144, 4096, None): (GemvConfig(64, 128, 1, 4, 5, use_dot=True), 15.82, 15.29),
    (2, 4096, 4096, None): (GemvConfig(64, 128, 4, 4, 3, use_dot=True), 13.19, 11.88),
    (4, 4096, 4096, None): (GemvConfig(64, 128, 2, 4, 5, use_dot=True), 13.31, 11.88),
    (8, 4096, 4096, None): (GemvConfig(64, 128, 2, 4, 5, use_dot=True), 13.3, 12.17),
    # Llama-3-8B's gate_up (at batch 1 with the SiLU-and-mul epilogue): dot 128 x 128 with 8 warps took the whole
    # batch-1 graph 2.3% lower than dot 64 x 256 with 4 (`tools/graph_ab.py llama-3-8b --context 256`, session 12).
    # The x prefetch: -0.10% more (session 14, `tools/device_run.sh s14b`). Not re-timed alone: the gemv figure is
    # the old config's.
    (1, 28672, 4096, None): (GemvConfig(128, 128, 1, 8, 3, use_dot=True, xprefetch=True), 59.54, 55.49),
    # One rank of Llama-3-8B at tensor_parallel_size 2 (`bench_gemv.py --shapes llama8b-tp2 --ms 1`, session 5).
    (1, 3072, 4096, 'rmsnorm'): (GemvConfig(32, 128, 6, 4, 1, use_dot=False), 13.77, 12.08),
    (1, 3072, 4096, None): (GemvConfig(64, 128, 6, 4, 3, use_dot=True), 11.72, 10.38),
    (1, 4096, 7168, None): (GemvConfig(64, 128, 2, 4, 5, use_dot=True), 20.00, 17.76),
    (1, 64128, 4096, None): (GemvConfig(64, 128, 1, 4, 5, use_dot=True), 124.24, 118.89),
    # Batch-1 products, PDL on, re-measured in session 9 with the two-tile prefetch and the acc2d FMA variant in
    # the sweep (`bench_gemv.py --shapes bs1,l3bs1 --ms 1 --deep --prefetch --acc2d`, 2026-12-01, three runs; the
    # gemv figure is the worst of them).
    (1, 4096, 1024, 'rmsnorm'): (GemvConfig(8, 1024, 1, 4, 1, use_dot=False, acc2d=True), 6.39, 4.13),
    (1, 1024, 2048, None): (GemvConfig(4, 2048, 1, 8, 1, use_dot=False, prefetch=True), 12.77, 2.51),
    (1, 6144, 1024, 'rmsnorm'): (GemvConfig(8, 512, 1, 4, 1, use_dot=False, acc2d=True), 7.95, 5.32),
    (1, 1024, 3072, 'silu_mul'): (GemvConfig(4, 2048, 1, 8, 1, use_dot=False, prefetch=True), 7.89, 4.24),
    (1, 151936, 1024, None): (GemvConfig(16, 256, 1, 4, 1, use_dot=False, prefetch=True, acc2d=True), 77.44, 72.35),
    # Llama-3-8B's qkv and o_proj were picked in the whole batch-1 graph, where they follow the short attention
    # kernels (`tools/graph_ab.py llama-3-8b --context 256`, session 12: -0.21% and -0.27% against the session-10
    # entries (8, 512) prefetch + acc2d and (8, 512) prefetch). qkv's x prefetch (the norm prologue's loads one K
    # step ahead) took the graph another 0.88% lower, o_proj's 0.15% (session 14, `tools/device_run.sh gun` and
    # `s14b`). They were not re-timed alone: the gemv figures are the session-10 entries'.
    (1, 6144, 4096, 'rmsnorm'): (GemvConfig(16, 512, 1, 8, 1, use_dot=False, prefetch=True, acc2d=True,
                                            xprefetch=True), 19.32, 16.76),
    (1, 4096, 4096, None): (GemvConfig(8, 512, 1, 4, 1, use_dot=False, prefetch=True, acc2d=True, xprefetch=True),
                            13.24, 10.84),
    # Llama-3-8B's down_proj after the separate SiLU-and-mul kernel (the fused form measured 33.0-33.4 us) and its
    # lm_head.
    (1, 4096, 14336, None): (GemvConfig(64, 256, 4, 4, 3, use_dot=True), 32.08, 30.53),
    (1, 128256, 4096, None): (GemvConfig(64, 128, 1, 4, 3, use_dot=True), 246.54, 238.54),
}
# (M bucket, N, K) -> GemvConfig overrides of the heuristic; the plain product's config where a fused one exists too.
def _tuned() -> dict[tuple[int, int, int], GemvConfig]:
    out: dict[tuple[int, int, int], GemvConfig] = {}
    for (m, n, k, _), (cfg, _, _) in sorted(MEASURED_FASTER.items(), key=lambda kv: kv[0][3] is not None):
        out.setdefault((m, n, k), cfg)
    return out


TUNED: dict[tuple[int, int, int], GemvConfig] = _tuned()


def prefer_gemv(m: int, n: int, k: int, prologue: str | None = None) -> GemvConfig | None:
    """The measured-faster config for this product, or None: use cuBLAS."""
    hit = MEASURED_FASTER.get((_m_bucket(m), n, k, prologue))
    return None if hit is None else hit[0]


def _m_bucket(m: int) -> int:
    return 1 << max(0, m - 1).bit_length()


@functools.lru_cache(maxsize=None)
def default_config(m: int, n: int, k: int, num_sms: int = 132) -> GemvConfig:
    """Heuristic: 64-wide N tiles and 128-deep K steps; split K until there are about two programs per SM, keeping
    at least one K step per split."""
    tuned = TUNED.get((_m_bucket(m), n, k))
    if tuned is not None:
        return tuned
    block_n, block_k = 64, min(128, max(16, triton.next_power_of_2(k)))
    n_tiles = triton.cdiv(n, block_n)
    target = 2 * num_sms
    split = 1
    if n_tiles < target:
        split = max(1, min(triton.cdiv(target, n_tiles), triton.cdiv(k, block_k), 32))
    return GemvConfig(block_n=block_n, block_k=block_k, split_k=split, num_warps=4, num_stages=3, use_dot=True)
