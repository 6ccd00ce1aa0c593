"""KV-cache configuration."""
from __future__ import annotations

from dataclasses import dataclass

from tokenmill.config.utils import check_choices, check_range, config_field, not_supported_yet

KV_CACHE_DTYPES = ("auto", "bfloat16", "float16", "fp8", "fp8_e4m3", "fp8_e5m2")


@dataclass
class CacheConfig:
    """How the paged KV cache is laid out and sized."""
    block_size: int = config_field(16, help="Tokens per KV-cache block.")
    gpu_memory_utilization: float = config_field(
        0.92, help="Fraction of GPU memory this instance may use (weights, activations and KV cache).")
    swap_space: float = config_field(4, help="CPU swap space per GPU in GiB (accepted for compatibility; "
                                             "tokenmill preempts by recomputation).")
    kv_cache_dtype: str = config_field("auto", help="KV cache data type; auto = the model's dtype.",
                                       choices=KV_CACHE_DTYPES)
    num_gpu_blocks_override: int | None = config_field(
        None, help="Use exactly this many KV blocks instead of profiling (testing and debugging).")
    enable_prefix_caching: bool = config_field(True, help="Reuse the KV cache of shared prompt prefixes.")
    prefix_caching_hash_algo: str = config_field(
        "sha256", help="Hash for prefix-cache block keys.", choices=("sha256", "sha256_cbor", "xxhash", "xxhash_cbor"))
    cpu_offload_gb: float = config_field(0, help="GiB of weights to offload to CPU memory (not supported yet).")
    calculate_kv_scales: bool = config_field(False, help="Compute fp8 KV scales dynamically.")
    kv_cache_memory_bytes: int | None = config_field(
        None, help="KV cache size in bytes; overrides gpu_memory_utilization for sizing the pool.")

    def __post_init__(self) -> None:
        if self.enable_prefix_caching is None:
            self.enable_prefix_caching = True
        check_choices(self)
        if self.block_size is None:
            self.block_size = 16
        check_range("block_size", self.block_size, 1)
        check_range("gpu_memory_utilization", self.gpu_memory_utilization, 0, 1, lo_open=True)
        check_range("swap_space", self.swap_space, 0)
        check_range("num_gpu_blocks_override", self.num_gpu_blocks_override, 1)
        check_range("kv_cache_memory_bytes", self.kv_cache_memory_bytes, 1)
        if self.cpu_offload_gb:
            raise not_supported_yet("cpu_offload_gb", self.cpu_offload_gb)
        if self.kv_cache_dtype not in ("auto", "bfloat16", "float16"):
            raise not_supported_yet("kv_cache_dtype", self.kv_cache_dtype, "Use auto, bfloat16 or float16.")
        if self.prefix_caching_hash_algo.startswith("xxhash"):
            try:
                import xxhash  # noqa: F401
            except ImportError:
                raise ValueError("prefix_caching_hash_algo=xxhash needs the `xxhash` package: "
                                 "pip install xxhash") from None
