"""What each layer keeps per token (or per request), as data the KV cache manager and the memory profiler share.

A spec names one kind of per-layer state and its size:
  * FullAttentionSpec: paged K/V blocks covering the whole context.
  * SlidingWindowSpec: paged K/V blocks; a query at position p reads keys (p - window, p] only (HF's sliding-window
    mask), so a block wholly below the oldest key the next query can see is dead and is freed as the request
    advances: a request holds about window / block_size + 1 blocks of such a layer, whatever its length.
  * RecurrentStateSpec: a fixed-size slot per running request (e.g. Gated DeltaNet's conv and delta-rule state),
    kept in its own slot pool; the model declares it (`state_specs()`), so the memory profiler subtracts what
    max_num_seqs slots take before it sizes the KV cache.

Layers with equal specs form a group (`group_layers`). This module reads only HF configs: the engine core (which
has no model) and the model files (which build the layers) derive each layer's window from the same function,
`layer_sliding_windows`, so they cannot disagree.
"""
from __future__ import annotations

from dataclasses import dataclass


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class FullAttentionSpec:
    """Paged K/V of one attention layer over the whole context."""
    block_size: int
    num_kv_heads: int
    head_size: int
    dtype_bytes: int

    kind = "full_attention"

    @property
    def name(self) -> str:
        return self.kind

    @property
    def bytes_per_token(self) -> int:
        return 2 * self.num_kv_heads * self.head_size * self.dtype_bytes

    @property
    def bytes_per_block(self) -> int:
        return self.block_size * self.bytes_per_token

    def max_blocks_per_request(self, max_model_len: int, max_step_tokens: int) -> int:
        """The most blocks one request of max_model_len tokens holds at once."""
        return cdiv(max_model_len, self.block_size)

    def num_dead_blocks(self, num_computed_tokens: int) -> int:
        """Leading blocks no later query reads, once `num_computed_tokens` tokens are in the cache."""
        return 0


@dataclass(frozen=True)
class SlidingWindowSpec(FullAttentionSpec):
    """Paged K/V of a layer whose queries see the last `sliding_window` positions (their own included)."""
    sliding_window: int = 0

    kind = "sliding_attention"

    @property
    def name(self) -> str:
        return f"{self.kind}(window={self.sliding_window})"

    def max_blocks_per_request(self, max_model_len: int, max_step_tokens: int) -> int:
        # The window behind the step's first query plus the step's own tokens, over at most two partial blocks.
        live = min(max_model_len, self.sliding_window - 1 + max(max_step_tokens, 1))
        return min(cdiv(max_model_len, self.block_size), cdiv(live, self.block_size) + 1)

    def num_dead_blocks(self, num_computed_tokens: int) -> int:
        # The next query sits at position num_computed_tokens and sees keys from num_computed_tokens - window + 1.
        return max(num_computed_tokens - self.sliding_window + 1, 0) // self.block_size


KVCacheSpec = FullAttentionSpec  # the base of every paged-KV spec


def layer_sliding_windows(hf_config, disable_sliding_window: bool = False) -> list[int | None]:
    """Each decoder layer's attention window (None: full attention), as HF's modeling code applies it.

    Mistral: every layer takes `sliding_window` when set; Llama never does (config_sliding_window). Qwen2 / Qwen3:
    only with `use_sliding_window`, on the layers HF's config marks sliding (`layer_types`, which it derives from
    `max_window_layers`). Gemma 2 / Gemma 3 and other configs with `layer_types`: the "sliding_attention" layers.
    disable_sliding_window (vLLM's flag) makes every layer full attention (the context is then capped at the
    window, config/model.py)."""
    from tokenmill.transformers_utils.config import config_sliding_window
    cfg = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    n = cfg.num_hidden_layers
    window = config_sliding_window(cfg)
    model_type = getattr(cfg, "model_type", "")
    if window is None or disable_sliding_window:
        return [None] * n
    types = getattr(cfg, "layer_types", None)
    if model_type == "mistral" or not types:
        return [int(window)] * n
    if len(types) != n:
        raise ValueError(f"The config's layer_types names {len(types)} layers but num_hidden_layers is {n}.")
    unknown = sorted(set(types) - {"sliding_attention", "full_attention"})
    if unknown:
        raise ValueError(f"Layer type(s) {unknown} in the config's layer_types are not supported yet "
                         "(supported: full_attention, sliding_attention).")
    return [int(window) if t == "sliding_attention" else None for t in types]


def attention_specs(hf_config, block_size: int, num_kv_heads: int, head_size: int, dtype_bytes: int,
                    disable_sliding_window: bool = False) -> list[FullAttentionSpec]:
    """One spec per decoder layer (num_kv_heads: this rank's share)."""
    specs: list[FullAttentionSpec] = []
    for w in layer_sliding_windows(hf_config, disable_sliding_window):
        if w is None:
            specs.append(FullAttentionSpec(block_size, num_kv_heads, head_size, dtype_bytes))
        else:
            specs.append(SlidingWindowSpec(block_size, num_kv_heads, head_size, dtype_bytes, sliding_window=w))
    return specs


def group_layers(specs: list[FullAttentionSpec], layers) -> dict[FullAttentionSpec, list[int]]:
    """spec -> the layers (of `layers`, e.g. this pipeline stage's) that have it, in first-seen order."""
    groups: dict[FullAttentionSpec, list[int]] = {}
    for i in layers:
        groups.setdefault(specs[i], []).append(i)
    return groups


# ----- recurrent state (per-request slots, owned elsewhere) -----
@dataclass(frozen=True)
class RecurrentStateSpec:
    """A fixed-size state slot per running request (e.g. Gated DeltaNet's conv + delta-rule state) kept by its own
    slot pool, not in KV blocks. A model with such layers answers `state_specs()` with one of these per kind (bytes
    per request on this rank, all its layers together); the memory profiler (worker/worker.py) reserves
    max_num_seqs slots of each before it sizes the KV cache, and the start-up log names them."""
    name: str
    bytes_per_request: int
    num_layers: int = 1

    kind = "recurrent_state"


def model_state_specs(model) -> list[RecurrentStateSpec]:
    """The model's per-request state specs (none for a model without `state_specs`)."""
    get = getattr(model, "state_specs", None)
    return list(get()) if callable(get) else []


# ----- what the one-table KV cache manager runs with -----
def config_attention_specs(config, dtype_bytes: int = 2, num_kv_heads: int | None = None,
                           head_size: int | None = None) -> list[FullAttentionSpec] | None:
    """Per-layer specs of a TokenmillConfig's model (None when the config carries no HF config, as in unit tests'
    minimal configs). Sizes default to the whole model's KV heads and 2-byte elements; the worker passes its
    rank's share and the cache dtype's size."""
    mc = config.model_config
    hf = getattr(mc, "hf_config", None)
    if hf is None:
        return None
    text = mc.get_text_config()
    heads = num_kv_heads or getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    head = head_size or getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    return attention_specs(hf, config.cache_config.block_size, heads, head, dtype_bytes,
                           getattr(mc, "disable_sliding_window", False))


def manager_spec(specs: list[FullAttentionSpec] | None) -> FullAttentionSpec | None:
    """The spec a one-group KV cache manager allocates by (every layer alike: that spec; a model whose layers all
    slide frees the blocks below the window; several windows and no full layer: the widest window), or, for full
    attention beside sliding windows, the full spec (such models get a manager per layer group,
    core/kv_cache_groups.py, and this answers for the group that needs the most blocks)."""
    if not specs:
        return None
    if len(set(specs)) == 1:
        return specs[0]
    full = next((s for s in specs if type(s) is FullAttentionSpec), None)
    return full if full is not None else max(specs, key=lambda s: s.sliding_window)


def capacity_report(specs: list[FullAttentionSpec] | None, layers, num_blocks: int, max_model_len: int,
                    max_step_tokens: int) -> dict[str, float]:
    """{group name: how many requests of max_model_len tokens its blocks hold at once} for the layers of `layers`
    grouped by spec, under the manager's one block table (manager_spec): every group has num_blocks blocks and
    a request takes the manager spec's share of them."""
    spec = manager_spec(specs)
    if spec is None:
        return {}
    per_request = spec.max_blocks_per_request(max_model_len, max_step_tokens)
    out: dict[str, float] = {}
    for group_spec, members in group_layers(specs, layers).items():
        out[f"{group_spec.name} x{len(members)} layers"] = num_blocks / per_request
    return out
