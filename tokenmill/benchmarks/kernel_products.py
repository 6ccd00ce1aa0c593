"""The weight products of one decode step of a model, as `tokenmill bench kernels` measures them: a shipped shape
or a model directory's config.json read into Product records (N, K, the prologue folded in, the weight type), per
tensor-parallel rank, for the dense Llama / Qwen / Mistral layout and Qwen3.5's hybrid one."""
from __future__ import annotations

import dataclasses
import json
import os

from tokenmill.benchmarks.offline_common import shipped_model_dir


@dataclasses.dataclass(frozen=True)
class Product:
    """One weight product of a decode step: y[m, n] = prologue(x)[m, k] @ W[n, k]^T, W bf16 or (weight="fp8")
    float8 e4m3 with one scale per row."""

    name: str
    n: int
    k: int
    prologue: str | None = None
    weight: str | None = None

    @property
    def key_tail(self) -> tuple[int, int, str | None, str | None]:
        return self.n, self.k, self.prologue, self.weight


def fp8_products(products: list[Product]) -> list[Product]:
    """The products the FP8 linear method runs on the gemv: the plain ones but the LM head, with fp8 weights."""
    return [dataclasses.replace(p, weight="fp8") for p in products if p.prologue is None and p.name != "lm_head"]


def load_model_config(model: str) -> dict:
    """A shipped shape (`qwen3-0.6b`, `llama-3-8b`), a model directory or its config.json."""
    path = shipped_model_dir(model) or model
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    if not os.path.isfile(path):
        raise ValueError(f"--model {model!r}: neither a shipped shape (tokenmill/model_configs) nor a directory or "
                         "file with a config.json")
    with open(path) as f:
        return json.load(f)


def _per_rank(total: int, tp: int, what: str) -> int:
    if total % tp:
        raise ValueError(f"{what} = {total} does not split over --tensor-parallel-size {tp}")
    return total // tp


def model_products(cfg: dict, tp: int = 1) -> list[Product]:
    """The products of one decode step of a decoder (Llama / Qwen / Mistral layout, and Qwen3.5's hybrid of gated
    attention and Gated DeltaNet layers) on one of tp ranks. A config with a `text_config` (multimodal wrappers)
    is read from it."""
    if isinstance(cfg.get("text_config"), dict):
        cfg = {**{k: v for k, v in cfg.items() if k != "text_config"}, **cfg["text_config"]}
    hybrid = "linear_num_value_heads" in cfg
    need = ("hidden_size", "intermediate_size", "num_attention_heads", "vocab_size")
    if hybrid:
        need += ("linear_num_key_heads", "linear_key_head_dim", "linear_value_head_dim")
    missing = [k for k in need if k not in cfg]
    if missing:
        raise ValueError(f"model config lacks {missing}: not a {'hybrid' if hybrid else 'dense'} decoder tokenmill "
                         "can measure")
    hidden, vocab = cfg["hidden_size"], cfg["vocab_size"]
    heads = cfg["num_attention_heads"]
    kv = cfg.get("num_key_value_heads") or heads
    head_dim = cfg.get("head_dim") or hidden // heads
    heads_here = _per_rank(heads, tp, "num_attention_heads")
    if kv >= tp:
        kv_here = _per_rank(kv, tp, "num_key_value_heads")
    elif tp % kv:
        raise ValueError(f"num_key_value_heads = {kv} neither splits over nor divides --tensor-parallel-size {tp}")
    else:
        kv_here = 1                                  # each rank holds one KV head, replicated
    inter_here = _per_rank(cfg["intermediate_size"], tp, "intermediate_size")
    lm_head = Product("lm_head", -(-vocab // tp), hidden)
    if hybrid:
        return _hybrid_products(cfg, tp, hidden, heads_here, kv_here, head_dim, inter_here) + [lm_head]
    qkv = (heads_here + 2 * kv_here) * head_dim
    return [Product("qkv_proj", qkv, hidden), Product("qkv_proj+norm", qkv, hidden, "rmsnorm"),
            Product("o_proj", hidden, heads_here * head_dim),
            Product("gate_up_proj", 2 * inter_here, hidden), Product("gate_up_proj+norm", 2 * inter_here, hidden,
                                                                     "rmsnorm"),
            Product("down_proj", hidden, inter_here), Product("down_proj+silu", hidden, inter_here, "silu_mul"),
            lm_head]


def _hybrid_products(cfg: dict, tp: int, hidden: int, heads_here: int, kv_here: int, head_dim: int,
                     inter_here: int) -> list[Product]:
    """Qwen3.5's products but the LM head (models/qwen3_5.py, layers/gated_deltanet.py): the attention layers' q
    slot holds a query and a gate per head; the linear-attention layers' in_proj_qkv, in_proj_z, in_proj_ba and
    out_proj; the MLP's down_proj takes the SiLU-and-mul as its prologue; its norms (Gemma form) are not folded
    into products. One product per shape: out_proj is often o_proj's."""
    key_here = _per_rank(cfg["linear_num_key_heads"], tp, "linear_num_key_heads") * cfg["linear_key_head_dim"]
    hv_here = cfg["linear_num_value_heads"] // tp
    value_here = hv_here * cfg["linear_value_head_dim"]
    products = [Product("qkv_proj", (2 * heads_here + 2 * kv_here) * head_dim, hidden),
                Product("o_proj", hidden, heads_here * head_dim),
                Product("in_proj_qkv", 2 * key_here + value_here, hidden), Product("in_proj_z", value_here, hidden),
                Product("in_proj_ba", 2 * hv_here, hidden), Product("out_proj", hidden, value_here),
                Product("gate_up_proj", 2 * inter_here, hidden),
                Product("down_proj+silu", hidden, inter_here, "silu_mul")]
    seen: set = set()
    return [p for p in products if not ((p.n, p.k, p.prologue) in seen or seen.add((p.n, p.k, p.prologue)))]
