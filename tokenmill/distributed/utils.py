"""Small helpers for sharding arithmetic and rendezvous addresses."""
from __future__ import annotations

import socket


def divide(numerator: int, denominator: int, what: str) -> int:
    """numerator / denominator, or a ValueError naming `what` when it does not divide."""
    if numerator % denominator:
        raise ValueError(f"{what} ({numerator}) is not divisible by tensor_parallel_size ({denominator}); pick a "
                         f"tensor_parallel_size that divides it.")
    return numerator // denominator


def kv_heads_per_rank(num_kv_heads: int, tp_size: int) -> int:
    """KV heads each TP rank holds: an even split, or one replicated head when there are fewer heads than ranks."""
    if num_kv_heads >= tp_size:
        return divide(num_kv_heads, tp_size, "num_key_value_heads")
    if tp_size % num_kv_heads:
        raise ValueError(f"tensor_parallel_size ({tp_size}) must be a multiple of num_key_value_heads "
                         f"({num_kv_heads}) when it is larger, so each KV head is replicated evenly.")
    return 1


def get_open_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]
