"""KV-cache configuration."""
from __future__ import annotations

from dataclasses import dataclass

from tokenmill.config.utils import check_choices, check_range, config_field, not_supported_yet

# vLLM's choices, so a vLLM command line parses; those after fp8_e5m2 are rejected in __post_init__.
KV_CACHE_DTYPES = ("auto", "bfloat16", "float16", "fp8", "fp8_e4m3", "fp8_e5m2", "fp8_ds_mla", "fp8_inc",
                   "fp8_per_token_head", "int8_per_token_head", "nvfp4", "turboquant_3bit_nc", "turboquant_4bit_nc",
                   "turboquant_k3v4_nc", "turboquant_k8v4")
SUPPORTED_KV_CACHE_DTYPES = KV_CACHE_DTYPES[:6]
SWAP_SPACE_MAX_FRACTION = 0.7  # vLLM refuses a swap space above this share of the host's memory


@dataclass
class CacheConfig:
    """How the paged KV cache is laid out and sized."""
    block_size: int = config_field(16, help="Tokens per KV-cache block.")
    gpu_memory_utilization: float = config_field(
        0.92, help="Fraction of GPU memory this instance may use (weights, activations and KV cache).")
    swap_space: float = config_field(
        4, help="CPU swap space per GPU in GiB, for vLLM 0.7's swap preemption. tokenmill preempts by recomputation, "
                "as vLLM's V1 engine does, so no swap space is allocated; as there, a value above 70% of the host's "
                "memory (counted once per tensor-parallel rank) is refused.")
    kv_cache_dtype: str = config_field(
        "auto", help="KV cache data type; auto = the model's dtype. bfloat16 under float32 activations on the CPU "
                     "(the default GGUF model) halves the K/V bytes a decode step reads. fp8 (= fp8_e4m3) and "
                     "fp8_e5m2 store K/V in one "
                     "byte, doubling the KV capacity, with per-layer k/v scales from the checkpoint (else 1.0); "
                     "fp8_e4m3 on GPU needs compute capability 8.9+.", choices=KV_CACHE_DTYPES)
    num_gpu_blocks_override: int | None = config_field(
        None, help="Use exactly this many KV blocks instead of profiling (testing and debugging).")
    enable_prefix_caching: bool = config_field(True, help="Reuse the KV cache of shared prompt prefixes.")
    prefix_caching_hash_algo: str = config_field(
        "sha256", help="Hash for prefix-cache block keys.", choices=("sha256", "sha256_cbor", "xxhash", "xxhash_cbor"))
    cpu_offload_gb: float = config_field(0, help="GiB of weights to offload to CPU memory (not supported yet).")
    calculate_kv_scales: bool = config_field(
        False, help="Compute fp8 KV scales from the first forward pass (deprecated in vLLM; not supported yet with "
                    "an fp8 cache, and without one there are no scales to compute).")
    kv_cache_memory_bytes: int | None = config_field(
        None, help="KV cache size in bytes; overrides gpu_memory_utilization for sizing the pool.")

    def verify_swap_space(self, ranks_per_host: int) -> None:
        """vLLM's check of swap_space against the host's memory (it allocates none either under V1)."""
        import os
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        wanted = self.swap_space * 2**30 * ranks_per_host
        if wanted > SWAP_SPACE_MAX_FRACTION * total:
            raise ValueError(f"swap_space={self.swap_space:g} GiB x {ranks_per_host} rank(s) is {wanted / 2**30:.2f} "
                             f"GiB, more than {SWAP_SPACE_MAX_FRACTION:.0%} of this host's {total / 2**30:.2f} GiB "
                             "of memory. Lower --swap-space.")

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
        if self.kv_cache_dtype not in SUPPORTED_KV_CACHE_DTYPES:
            raise not_supported_yet("kv_cache_dtype", self.kv_cache_dtype,
                                    f"Use one of {', '.join(SUPPORTED_KV_CACHE_DTYPES)}.")
        if self.calculate_kv_scales and self.kv_cache_dtype.startswith("fp8"):
            raise not_supported_yet(
                "calculate_kv_scales", True, "vLLM deprecates it; tokenmill uses the k_scale / v_scale tensors of the "
                "checkpoint, or 1.0 for a checkpoint without them. Drop --calculate-kv-scales.")
        if self.prefix_caching_hash_algo.startswith("xxhash"):
            try:
                import xxhash  # noqa: F401
            except ImportError:
                raise ValueError("prefix_caching_hash_algo=xxhash needs the `xxhash` package: "
                                 "pip install xxhash") from None
