"""Checkpoint readers: (HF parameter name, tensor) pairs from safetensors directories and GGUF files, plus the
dummy initializer for --load-format dummy.

The model's own `load_weights` maps these HF names onto its (possibly packed and sharded) parameters and converts
dtypes; the iterators only read.
"""
from __future__ import annotations

import glob
import json
import os
import re
from typing import Iterator

import torch

from tokenmill.logger import init_logger
from tokenmill.transformers_utils.gguf import gguf_field, read_gguf_tensors

logger = init_logger(__name__)

_SAFETENSORS_INDEX = "model.safetensors.index.json"
_SAFETENSORS_SINGLE = "model.safetensors"


def _tqdm(iterable, desc: str, total: int, enabled: bool):
    if not enabled:
        return iterable
    import threading

    from tqdm.auto import tqdm

    # tqdm's default lock includes a multiprocessing RLock, a named semaphore registered with the resource tracker
    # the engine core shares with the API server. The engine core ends with os._exit, which never unregisters it,
    # so every shutdown printed "resource_tracker: There appear to be 1 leaked semaphore objects". These bars are
    # written by one process (each rank has its own), so a thread lock is all they need.
    tqdm.set_lock(threading.RLock())
    return tqdm(iterable, desc=desc, total=total, unit="file" if "shards" in desc else "tensor")


# -------------------------------------------------------------------------------------------------------- safetensors
def _is_excluded(rel_path: str) -> bool:
    # Meta ships a second, consolidated copy of Llama weights under original/ (for their own code): never load it.
    return rel_path.replace(os.sep, "/").split("/")[0] == "original"


def safetensors_files(model_dir: str) -> list[str]:
    """The safetensors files to read: the shards the index names, else model.safetensors, else every
    top-level *.safetensors. Raises FileNotFoundError (with how to convert) when there are none."""
    index_path = os.path.join(model_dir, _SAFETENSORS_INDEX)
    if os.path.isfile(index_path):
        with open(index_path, encoding="utf-8") as f:
            weight_map = json.load(f).get("weight_map", {})
        names = sorted({shard for shard in weight_map.values() if not _is_excluded(shard)})
        missing = [n for n in names if not os.path.isfile(os.path.join(model_dir, n))]
        if missing:
            raise FileNotFoundError(
                f"{index_path} names shards that are missing: {', '.join(missing)}. The download is incomplete; "
                "fetch the model again."
            )
        if names:
            return [os.path.join(model_dir, n) for n in names]
    single = os.path.join(model_dir, _SAFETENSORS_SINGLE)
    if os.path.isfile(single):
        return [single]
    files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    if files:
        return files
    others = sorted(
        os.path.basename(p)
        for pattern in ("*.bin", "*.pt", "*.pth")
        for p in glob.glob(os.path.join(model_dir, pattern))
    )
    found = f" It holds {', '.join(others[:5])}{' ...' if len(others) > 5 else ''}." if others else ""
    raise FileNotFoundError(
        f"No *.safetensors weights in {model_dir}.{found} tokenmill loads only safetensors (and GGUF); PyTorch "
        ".bin/.pt checkpoints are not supported (they are pickles that can run code when loaded). Convert once, "
        "with transformers:\n"
        "  python -c \"from transformers import AutoModelForCausalLM as M, AutoTokenizer as T; "
        f"M.from_pretrained('{model_dir}').save_pretrained('OUT_DIR', safe_serialization=True); "
        f"T.from_pretrained('{model_dir}').save_pretrained('OUT_DIR')\"\n"
        "then pass OUT_DIR. Or pass --load-format dummy for random weights."
    )


def iter_safetensors_weights(model_dir: str, use_tqdm: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) for every tensor of the checkpoint in `model_dir`, in file order, dtype as stored
    (bf16/fp16/fp32 unchanged: the caller converts). Files come from `safetensors_files`."""
    from safetensors import safe_open

    files = safetensors_files(model_dir)
    for path in _tqdm(files, "Loading safetensors shards", len(files), use_tqdm and len(files) > 1):
        with safe_open(path, framework="pt", device="cpu") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


# --------------------------------------------------------------------------------------------------------------- GGUF
# llama.cpp tensor names (gguf-py's standardized names) -> HF names, for the dense decoder-only families below.
_GGUF_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_GGUF_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Tensors llama.cpp adds that have no HF parameter: Llama-3.1's precomputed RoPE frequencies (the HF config's
# rope parameters describe the same thing) and old converters' rotary tables.
_GGUF_IGNORED = re.compile(r"^(rope_freqs\.weight|blk\.\d+\.attn_rot_embd\.weight)$")
_GGUF_LAYER_RE = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")
_GGUF_GLOBAL_RE = re.compile(r"^(\w+)\.(weight|bias)$")

# general.architecture values we can name; Mistral GGUFs say "llama".
GGUF_SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3")
# llama.cpp's converter interleaves the rows of q/k for its rotary layout (the GPT-J pairing) in these
# architectures only; Qwen GGUFs keep HF's (NeoX, rotate-half) layout.
_GGUF_PERMUTED_QK = ("llama",)


def gguf_to_hf_name(gguf_name: str) -> str | None:
    """The HF parameter name of a GGUF tensor; None for tensors with no HF counterpart. ValueError if unknown."""
    if _GGUF_IGNORED.match(gguf_name):
        return None
    m = _GGUF_LAYER_RE.match(gguf_name)
    if m and m.group(2) in _GGUF_LAYER_NAMES:
        return f"model.layers.{m.group(1)}.{_GGUF_LAYER_NAMES[m.group(2)]}.{m.group(3)}"
    m = _GGUF_GLOBAL_RE.match(gguf_name)
    if m and m.group(1) in _GGUF_GLOBAL_NAMES:
        return f"{_GGUF_GLOBAL_NAMES[m.group(1)]}.{m.group(2)}"
    raise ValueError(
        f"GGUF tensor {gguf_name!r} has no known HF parameter name; tokenmill reads the dense decoder tensors of "
        f"architectures {', '.join(GGUF_SUPPORTED_ARCHITECTURES)}."
    )


def unpermute_qk_rows(weight: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation (convert_hf_to_gguf's `permute`).

    Within each head, HF orders the rotary rows rotate-half style [x0..x(d/2-1), y0..y(d/2-1)]; llama.cpp stores them
    pair-interleaved [x0, y0, x1, y1, ...]. Seen per head as a (2, d/2) grid, llama.cpp transposed it to (d/2, 2);
    transposing back restores HF's order. For k_proj, `n_head` is the number of KV heads. Works for weights
    (rows, cols) and biases (rows,).
    """
    rows = weight.shape[0]
    if rows % (2 * n_head):
        raise ValueError(f"cannot un-permute {tuple(weight.shape)} q/k rows over {n_head} heads")
    half = rows // n_head // 2
    rest = weight.shape[1:]
    return weight.reshape(n_head, half, 2, *rest).transpose(1, 2).reshape(weight.shape).contiguous()


def _head_counts(config, meta: dict, arch: str) -> tuple[int, int]:
    n_head = getattr(config, "num_attention_heads", None) if config is not None else None
    n_kv = getattr(config, "num_key_value_heads", None) if config is not None else None
    n_head = n_head or meta.get(f"{arch}.attention.head_count")
    n_kv = n_kv or meta.get(f"{arch}.attention.head_count_kv") or n_head
    if not n_head:
        raise ValueError("cannot un-permute q/k: the number of attention heads is in neither the config nor the GGUF")
    return int(n_head), int(n_kv)


def iter_gguf_weights(gguf_path: str, config, use_tqdm: bool = True,
                      raw_names: frozenset[str] | set[str] = frozenset()) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF name, float32 tensor) for every weight of a llama/qwen2/qwen3 GGUF, dequantized with the gguf package.

    Shapes are HF's (GGUF lists dimensions innermost first, so they are reversed). For llama-architecture files the
    q/k projection rows are un-permuted (see `unpermute_qk_rows`) using `config.num_attention_heads` /
    `num_key_value_heads` (GGUF metadata when the config lacks them), so tensors equal what transformers' own GGUF
    loader produces. No `lm_head.weight` is yielded when the file has no `output.weight` (tied embeddings).
    Tensors named in `raw_names` come as their raw ggml blocks instead, uint8 [rows, bytes per row] (rows
    un-permuted the same way) named `...qweight`, for a method that keeps them quantized
    (layers/quantization/gguf_cpu.py).
    """
    import gguf
    import numpy as np

    keys = {"general.architecture"} | {f"{a}.attention.head_count{s}" for a in GGUF_SUPPORTED_ARCHITECTURES
                                         for s in ("", "_kv")}
    table = read_gguf_tensors(gguf_path, keys)
    if table is None:  # a file only gguf.GGUFReader reads (GGUF v1, big-endian)
        reader = gguf.GGUFReader(gguf_path)
        table = ({k: gguf_field(reader, k) for k in keys},
                 [(t.name, int(t.tensor_type), tuple(int(d) for d in reversed(t.shape.tolist())), t.data)
                  for t in reader.tensors])
    meta, tensors = table
    arch = meta.get("general.architecture")
    if arch not in GGUF_SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"GGUF architecture {arch!r} ({gguf_path}) is not supported; supported: "
            f"{', '.join(GGUF_SUPPORTED_ARCHITECTURES)}."
        )
    n_head, n_kv = _head_counts(config, meta, arch) if arch in _GGUF_PERMUTED_QK else (0, 0)

    for gguf_name, ttype, shape, data in _tqdm(tensors, "Loading GGUF tensors", len(tensors), use_tqdm):
        name = gguf_to_hf_name(gguf_name)
        if name is None:
            continue
        raw = name in raw_names
        if raw:
            array = np.array(data, dtype=np.uint8).reshape(shape[0], -1)
        else:
            array = gguf.quants.dequantize(np.asarray(data).view(np.uint8), gguf.GGMLQuantizationType(ttype))
            array = np.ascontiguousarray(array, dtype=np.float32).reshape(shape)
        if not array.flags.writeable:  # unquantized tensors come back as read-only views of the memory map
            array = array.copy()
        tensor = torch.from_numpy(array)
        if arch in _GGUF_PERMUTED_QK:
            if ".self_attn.q_proj." in name:
                tensor = unpermute_qk_rows(tensor, n_head)
            elif ".self_attn.k_proj." in name:
                tensor = unpermute_qk_rows(tensor, n_kv)
        yield (name.removesuffix("weight") + "qweight" if raw else name), tensor


# -------------------------------------------------------------------------------------------------------------- dummy
_DUMMY_LOW, _DUMMY_HIGH = -1e-3, 1e-3


@torch.no_grad()
def dummy_weight_init(tensor: torch.Tensor, seed: int = 0) -> torch.Tensor:
    """Fill `tensor` in place with uniform(-1e-3, 1e-3) values from a generator seeded with `seed` (on the tensor's
    device, so CPU and GPU streams differ, but each is reproducible). Floating-point tensors only (fp8 via fp16);
    others are left untouched. Layer-norm weights (which want ones) are the caller's business. Returns `tensor`."""
    if not tensor.is_floating_point():
        return tensor
    generator = torch.Generator(device=tensor.device)
    generator.manual_seed(seed)
    if tensor.element_size() < 2:  # fp8: uniform_ is not implemented, draw in fp16 and cast
        tmp = torch.empty(tensor.shape, dtype=torch.float16, device=tensor.device)
        tmp.uniform_(_DUMMY_LOW, _DUMMY_HIGH, generator=generator)
        tensor.copy_(tmp)
    else:
        tensor.uniform_(_DUMMY_LOW, _DUMMY_HIGH, generator=generator)
    return tensor
