"""Chained block hashes for automatic prefix caching.

A full block's key is hash(parent block's key, the block's token ids). Chaining makes one key identify the whole
prefix up to and including that block, so a lookup walks the request's keys until the first miss. A request's
`cache_salt` goes into the root of its chain: requests share cached blocks only when their salts are equal (vLLM's
`cache_salt`, which keeps one tenant from probing another's prompts through cache-hit timing). A request's LoRA
adapter goes into the root the same way: the same prompt under two adapters (or one and none) has different KV.
"""
from __future__ import annotations

import hashlib
from array import array
from typing import Callable

_ROOT = b"tokenmill-root"


def _sha256(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


def _xxhash(data: bytes) -> bytes:
    import xxhash
    return xxhash.xxh3_128_digest(data)


def get_hash_fn(algo: str) -> Callable[[bytes], bytes]:
    if algo in ("sha256", "sha256_cbor"):
        return _sha256
    if algo in ("xxhash", "xxhash_cbor"):
        return _xxhash
    raise ValueError(f"Unknown prefix_caching_hash_algo {algo!r}; allowed: sha256, sha256_cbor, xxhash, xxhash_cbor.")


def hash_block(hash_fn: Callable[[bytes], bytes], parent: bytes | None, token_ids: list[int]) -> bytes:
    return hash_fn((parent or _ROOT) + array("q", token_ids).tobytes())


def salted_root(hash_fn: Callable[[bytes], bytes], salt: str | None) -> bytes | None:
    """The parent of a request's first block: the shared root (None) without a salt."""
    return None if salt is None else hash_fn(_ROOT + b"/salt/" + salt.encode("utf-8"))


class BlockHasher:
    """Computes the keys of a request's blocks that became full since the last call."""

    def __init__(self, block_size: int, algo: str, long_rope_prompt_len: int | None = None) -> None:
        self.block_size = block_size
        self.hash_fn = get_hash_fn(algo)
        # LongRoPE: prompts longer than this are encoded with the other RoPE table, so they chain from another root.
        self.long_rope_prompt_len = long_rope_prompt_len

    def __call__(self, request) -> list[bytes]:
        bs = self.block_size
        start = len(request.block_hashes)
        end = request.num_tokens // bs
        if start:
            parent = request.block_hashes[-1]
        else:
            salt = request.cache_salt
            lora = getattr(request, "lora_request", None)
            if lora is not None:
                salt = f"{salt or ''}\x00lora:{lora.cache_key()}"
            if self.long_rope_prompt_len is not None and request.num_prompt_tokens > self.long_rope_prompt_len:
                salt = f"{salt or ''}\x00long-rope"
            parent = salted_root(self.hash_fn, salt)
        tokens = request.all_token_ids
        new = []
        for i in range(start, end):  # one iteration per *block* filled (at most one per decode step)
            parent = hash_block(self.hash_fn, parent, tokens[i * bs:(i + 1) * bs])
            new.append(parent)
        return new
