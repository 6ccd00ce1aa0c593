"""HF architecture name -> model class, imported lazily."""
from __future__ import annotations

import importlib

_MODELS = {
    "LlamaForCausalLM": ("tokenmill.models.llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("tokenmill.models.llama", "MistralForCausalLM"),
    "Qwen2ForCausalLM": ("tokenmill.models.llama", "Qwen2ForCausalLM"),
    "Qwen3ForCausalLM": ("tokenmill.models.llama", "Qwen3ForCausalLM"),
    "Phi3ForCausalLM": ("tokenmill.models.llama", "Phi3ForCausalLM"),
    "Qwen2MoeForCausalLM": ("tokenmill.models.llama_moe", "Qwen2MoeForCausalLM"),
    "Qwen3MoeForCausalLM": ("tokenmill.models.llama_moe", "Qwen3MoeForCausalLM"),
    "MixtralForCausalLM": ("tokenmill.models.llama_moe", "MixtralForCausalLM"),
    "Gemma2ForCausalLM": ("tokenmill.models.gemma2", "Gemma2ForCausalLM"),
    "Gemma3ForCausalLM": ("tokenmill.models.gemma3", "Gemma3ForCausalLM"),
    "Gemma3ForConditionalGeneration": ("tokenmill.models.gemma3", "Gemma3ForConditionalGeneration"),
    "Qwen3_5ForCausalLM": ("tokenmill.models.qwen3_5", "Qwen3_5ForCausalLM"),
    "Qwen3_5ForConditionalGeneration": ("tokenmill.models.qwen3_5", "Qwen3_5ForConditionalGeneration"),
    "Qwen3_5MoeForCausalLM": ("tokenmill.models.qwen3_5", "Qwen3_5MoeForCausalLM"),
    "Qwen3_5MoeForConditionalGeneration": ("tokenmill.models.qwen3_5", "Qwen3_5MoeForConditionalGeneration"),
}

_MODEL_TYPES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                "qwen3": "Qwen3ForCausalLM", "phi3": "Phi3ForCausalLM", "gemma2": "Gemma2ForCausalLM",
                "qwen2_moe": "Qwen2MoeForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM", "mixtral": "MixtralForCausalLM",
                "gemma3_text": "Gemma3ForCausalLM", "gemma3": "Gemma3ForConditionalGeneration",
                "qwen3_5_text": "Qwen3_5ForCausalLM", "qwen3_5": "Qwen3_5ForConditionalGeneration",
                "qwen3_5_moe_text": "Qwen3_5MoeForCausalLM", "qwen3_5_moe": "Qwen3_5MoeForConditionalGeneration"}


def architecture_for_model_type(model_type: str | None) -> str | None:
    return _MODEL_TYPES.get(model_type or "")


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def get_model_class(architecture: str | None) -> type:
    if architecture not in _MODELS:
        raise ValueError(f"Model architecture {architecture!r} is not supported by tokenmill. Supported "
                         f"architectures: {', '.join(supported_architectures())}.")
    module, name = _MODELS[architecture]
    return getattr(importlib.import_module(module), name)
