"""Builds a model from the config and fills its weights (safetensors, GGUF or dummy)."""
from __future__ import annotations

import contextlib
import time

import torch
from torch import nn

from tokenmill.config import TokenmillConfig
from tokenmill.layers.quantization import get_quant_config
from tokenmill.logger import init_logger
from tokenmill.models.registry import get_model_class
from tokenmill.models.weight_mapping import process_weights_after_loading

logger = init_logger(__name__)


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def load_model(config: TokenmillConfig, device: torch.device, backend_cls: type) -> nn.Module:
    mc, lc = config.model_config, config.load_config
    cls = get_model_class(mc.architecture)
    dtype = mc.get_torch_dtype(device)
    quant_config = get_quant_config(mc)
    if quant_config is None and mc.is_gguf:
        quant_config = gguf_quant_config(mc, device)
    with _default_dtype(dtype), torch.device(device):
        model = cls(mc.hf_config, mc.max_model_len, backend_cls, quant_config=quant_config)
    model.eval()
    fmt = lc.load_format
    read_rate = ""
    if fmt == "dummy":
        _load_dummy(model, mc.seed)
    else:
        if fmt == "gguf" and not mc.is_gguf:
            raise ValueError("load_format='gguf' needs a .gguf model file.")
        if mc.is_gguf:
            from tokenmill.models.weight_utils import iter_gguf_weights
            weights = iter_gguf_weights(_gguf_path(mc), mc.hf_config, use_tqdm=lc.use_tqdm_on_load,
                                        raw_names=getattr(quant_config, "raw_names", frozenset()))
        else:
            from tokenmill.models.weight_utils import iter_safetensors_weights
            weights = iter_safetensors_weights(mc.resolved.path, use_tqdm=lc.use_tqdm_on_load)
        read = [0]
        t0 = time.perf_counter()
        with torch.no_grad():
            loaded = model.load_weights(_counted(weights, read))
        seconds = time.perf_counter() - t0
        # Read rate from the files into the parameters (page cache to device memory, conversions included).
        read_rate = (f"; read {read[0] / 2**30:.2f} GiB in {seconds:.2f} s "
                     f"({read[0] / max(seconds, 1e-9) / 1e9:.2f} GB/s)")
        expected = {n for n, _ in model.named_parameters()}
        missing = expected - loaded
        if missing:
            raise ValueError(f"The checkpoint lacks {len(missing)} parameters, e.g. {sorted(missing)[:5]}.")
    with torch.no_grad():
        process_weights_after_loading(model)
        if quant_config is not None:
            quant_config.process_model_after_loading(model)
    logger.info("Loaded %s (%s, %.1f M parameters, %s%s) on %s; weights %s%s", mc.architecture, fmt,
                sum(p.numel() for p in model.parameters()) / 1e6, dtype,
                f", {quant_config.name}" if quant_config is not None else "", device, weight_memory_summary(model),
                read_rate)
    return model


def gguf_quant_config(mc, device: torch.device):
    """How a GGUF file's blocks load: kept quantized unless --dtype float32 is given without --quantization gguf
    (that loads the file dense, the tests' oracle). On the CPU the 4-bit types run torch's int4 matmul
    (gguf_cpu.py; fp32 activations by default, measured faster than bf16 ones there and closer to the dense
    oracle), on a GPU every block type runs the Triton integer matmul (gguf_gpu.py)."""
    if mc.dtype == "float32" and mc.quantization != "gguf":
        return None
    types = _gguf_tensor_types(_gguf_path(mc))
    if device.type == "cpu":
        from tokenmill.layers.quantization.gguf_cpu import GGUFCpuConfig
        return GGUFCpuConfig(types)
    from tokenmill.layers.quantization.gguf_gpu import GGUFBlockConfig
    return GGUFBlockConfig(types)


def _gguf_path(mc) -> str:
    import os
    return os.path.join(mc.resolved.path, mc.resolved.gguf_file)


def _gguf_tensor_types(path: str) -> dict[str, str]:
    """{HF weight name: ggml type name} of a GGUF file's tensors, from its header."""
    import gguf

    from tokenmill.models.weight_utils import gguf_to_hf_name
    from tokenmill.transformers_utils.gguf import read_gguf_tensor_infos
    types = {}
    for name, (ttype, _) in read_gguf_tensor_infos(path).items():
        hf = gguf_to_hf_name(name)
        if hf is not None:
            types[hf] = gguf.GGMLQuantizationType(ttype).name
    return types


def _counted(weights, total: list[int]):
    """`weights` passed through, their bytes added to total[0]."""
    for name, tensor in weights:
        total[0] += tensor.numel() * tensor.element_size()
        yield name, tensor


def weight_memory_summary(model: nn.Module) -> str:
    """'1.23 GiB: float8_e4m3fn 1.00 GiB, bfloat16 0.23 GiB' over the model's parameters (each storage once)."""
    by_dtype: dict[str, int] = {}
    for p in model.parameters():
        name = str(p.dtype).removeprefix("torch.")
        by_dtype[name] = by_dtype.get(name, 0) + p.numel() * p.element_size()
    gib = lambda b: f"{b / 2**30:.2f} GiB"  # noqa: E731
    parts = sorted(by_dtype.items(), key=lambda kv: -kv[1])
    return f"{gib(sum(by_dtype.values()))}: " + ", ".join(f"{d} {gib(b)}" for d, b in parts)


def _load_dummy(model: nn.Module, seed: int) -> None:
    """Random weights. A tensor-parallel shard is cut from the full tensor one rank would draw (same seed, same
    device), through the parameter's own weight loader, so TP=N runs the very weights TP=1 runs."""
    from tokenmill.models.weight_utils import dummy_weight_init
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
                continue
            full_shape = getattr(p, "full_shape", p.shape)
            if full_shape == p.shape:
                dummy_weight_init(p.data, seed)
            else:
                full = dummy_weight_init(torch.empty(full_shape, dtype=p.dtype, device=p.device), seed)
                p.weight_loader(p, full, None)
